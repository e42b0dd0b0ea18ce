"""Benchmark: pushing and pulling a 64 MiB fragment over the syncer's bulk port against raw TCP.

Every receiver runs in a second process, as the syncer does in a deployment (`ddiloco-syncer`
is a process of its own, on its own host): one Python process would put the sender's and the
receiver's Python work under one GIL, which no real push pays. Transfers run on loopback from this
process to that one, interleaved in rounds so machine noise hits them equally, and the median of
the rounds is reported:
  bulk   `SyncerClient.push` of one fragment (a single key of 16M float32 = 64 MiB) to a served
         `SyncerService` with the shared token on, over its bulk port (service/bulk_server.py),
         as learners push. What is timed is everything a learner's push costs end to end: the
         client's encoding (`messages.push_pieces`: the fp32 delta θ − Θ^(anchor), the wire
         format, chunks of `ServiceConfig.bulk_chunk_bytes`, sent piece by piece from the
         encoder's runs), the loopback transfer, the server's validation at the door (token
         check, chunk message parsing, header and size checks, chunk reassembly, `wire` parsing,
         decode into the output arrays the chunks are received in, transport/placement.py) and
         `SyncerCore.report` (validation again, and the NaN/Inf check of every value fused with
         RDA's squared norm of the outer gradient, which for this delta push the decode sums as
         the values arrive, `Report.sq_norms`; the service files the decoded values without a
         copy). The receiving process opens one round of the fragment (`open_round`), and the
         syncer runs with min_quorum=3 and two learners, so the round never merges: no merge is
         timed. A learner answers a round once (a second answer is a refused duplicate), so before
         each push the receiving process restarts the learner in the core, untimed: it registers it
         again and marks the fragment delivered, as a rejoined learner's pull would. Each push then
         supersedes the previous answer in the round, whose memory the next push reuses. The pull
         of the same fragment is timed likewise. "bulk push of pre-built chunks" sends learner 0's
         whole chunk messages over the port (`BulkClient`). "bulk port push of θ" is the same
         answer sent as θ itself, fp32, not as δ: the learner hands out θ's own bytes, each run
         checked for NaN/Inf in place, and the syncer's door sums ‖Θ^(anchor) − θ‖² against its
         kept anchor when it files the answer: the subtraction moves from the learner to the
         syncer (learners send δ; this row measures the alternative).
  raw    `socket.sendall` of the same number of bytes in 1 MiB pieces over one TCP connection to a
         thread that reads them, in order, into one preallocated buffer of their size (reused, its
         pages faulted in the warm-up, as the service's recycled output arrays are: the bytes land
         in memory as a push's do), then acknowledges with one byte. "raw into a 1 MiB buffer"
         reads them into one reused 1 MiB buffer instead: the bytes never leave the cache, which
         no receiver that keeps them gets. Raw, bulk push and bulk pull are each timed twice in a
         row, at their place in the loop and at once again ("settled": right after themselves),
         and bulk push/raw is printed against each raw.
  bare   gRPC's own floor, why data does not travel over gRPC: the same bytes as 1 MiB raw
         `bytes` messages (no protobuf) streamed to a generic handler that counts and drops them,
         no token, no service code, with the service's channel options.
  options  gRPC's own options on the bare stream, each against a bare server of its own: 256 KiB
         and 4 MiB messages, the bytes split over 2 and 4 channels at once, TCP TX zero-copy,
         16 MiB HTTP/2 frames with larger reads; and a bare pull (unary-stream), plain and with
         gRPC Python's SingleThreadedUnaryStream channel option (`--nogrpc_options` skips them).
Every path has a wall-clock median and a CPU-time median: CPU time sums every thread of both
processes (both ends, gRPC's threads, the kernel's socket copies) and is what contention with other
processes spares, so on a loaded machine it is the steadier figure; wall time counts when "CPU/wall"
in the header is at most 2 (both ends busy at once). It prints the throughputs, the ratios push/raw
(δ and θ; goal >= 0.5), pull/push and bare gRPC/raw, and the push's time split: the client's
encoding with each piece dropped as it is made (as the client sends them), then a bulk push of
pre-built chunk messages (everything after the encoding), of which the parsing of the chunk
messages, the server's reassembly/decode/validation and the core's filing, each timed offline in
this process in one thread with the functions the two ends call, and the rest (the socket, the
token check, locks); and the CPU of raw TCP, the bulk δ push and the bulk θ push split by process
(learner / syncer), the cost a θ push moves onto the syncer. The end-to-end push overlaps the
client's encoding with the server's decoding, so it may take less than the encoding plus the
pre-built push.

  python scripts/bench_wire.py --mib=64 --rounds=5
"""

import multiprocessing
import os
import socket
import statistics
import struct
import sys
import threading
import time
from concurrent import futures

import grpc
import grpc.experimental
import numpy as np
from absl import app, flags

from ddiloco.fragments import buffers
from ddiloco.fragments import layout as layout_lib
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore
from ddiloco.transport import bulk_wire, frames, messages
from ddiloco.transport.bulk_client import BulkClient
from ddiloco.transport.chunks import FRAMING_SLACK, ArrayPool
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.proto import syncer_pb2

_MIB = flags.DEFINE_integer("mib", 64, "fragment size in MiB (float32 values)")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "timed rounds (median reported)")
_DELTA = flags.DEFINE_bool(
  "delta",
  True,
  "push θ − Θ^(anchor) as the worker does once it holds the fragment (docs/algorithm.md §5)",
)
_OPTIONS = flags.DEFINE_bool(
  "grpc_options", True, "also time gRPC's own options on the bare stream (sizes, channels...)"
)
_PIECE = 1 << 20  # Raw TCP: sendall of 1 MiB pieces, the service's chunk size.
_KEY = "w"
_TOKEN = "bench-wire-token"
_LEN = struct.Struct("<Q")
Seconds = tuple[float, float, float]  # (wall, CPU of both processes, the receiver's CPU) seconds.


class _Stopwatch:
  """Wall and CPU seconds of a block: CPU time sums every thread of this process and, with `peer`,
  of the receiving process (gRPC's own threads, the kernel's socket copies as system time) and is
  not inflated when other processes take the cores, which wall time on a shared machine is."""

  def __init__(self, peer: "_Peer | None" = None):
    self._peer = peer

  def _cpu(self) -> tuple[float, float]:
    return time.process_time(), (self._peer.cpu_s() if self._peer is not None else 0.0)

  def __enter__(self) -> "_Stopwatch":
    self._c0 = self._cpu()
    self._wall = time.perf_counter()  # After the peer's answer: its round trip is not timed.
    return self

  def __exit__(self, *exc) -> None:
    wall = time.perf_counter() - self._wall
    mine, peer = (b - a for a, b in zip(self._c0, self._cpu(), strict=True))
    self.seconds = (wall, mine + peer, peer)


class _DiscardServer:
  """A loopback TCP reader thread: per message, a u64 length, then that many bytes; acks b"k".

  With `ring=False` the bytes are read, in order, into one preallocated buffer of the message's
  size, as a push's bytes land in the output arrays it is decoded into: the buffer is made once
  (64-byte aligned, as the service's recycled arrays are) and reused, so its pages are faulted in
  the warm-up only, as the service's are. With `ring=True` they are read into one reused 1 MiB
  buffer, overwritten piece by piece (the baseline of earlier sessions): the bytes never leave the
  cache, which no receiver that keeps them gets.
  """

  def __init__(self, *, ring: bool):
    self._ring = ring
    self._sock = socket.create_server(("127.0.0.1", 0))
    self.port = self._sock.getsockname()[1]
    self._thread = threading.Thread(target=self._serve, name="discard", daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    conn, _ = self._sock.accept()
    buf = buffers.aligned_empty(_PIECE, np.uint8)
    with conn:
      while True:
        header = conn.recv(_LEN.size, socket.MSG_WAITALL)
        if len(header) < _LEN.size:
          return  # The client closed the connection.
        (left,) = _LEN.unpack(header)
        if not self._ring and buf.size != left:
          buf = buffers.aligned_empty(left, np.uint8)
        view, at = memoryview(buf), 0
        while left:
          if self._ring:
            at = 0
          n = conn.recv_into(view[at:], min(left, len(view) - at))
          if n == 0:
            return
          left, at = left - n, at + n
        conn.sendall(b"k")

  def close(self) -> None:
    self._sock.close()
    self._thread.join(timeout=5)


def _identity(b: bytes) -> bytes:
  return b


def _drain(request_iterator, context) -> bytes:
  del context
  return sum(len(r) for r in request_iterator).to_bytes(8, "little")


def _spew(request: bytes, context):
  """A bare pull: `request` holds (total bytes, piece bytes); yields that many raw pieces."""
  del context
  total, piece = struct.unpack("<QQ", request)
  block = bytes(piece)
  for _ in range(total // piece):
    yield block


# gRPC's own options, each on a bare server of its own in the receiving process (server options)
# and its client channel: {name: (server and channel options, piece bytes, channels)}.
_ZEROCOPY = [("grpc.experimental.tcp_tx_zerocopy_enabled", 1)]
_BIG = [("grpc.max_send_message_length", 5 << 20), ("grpc.max_receive_message_length", 5 << 20)]
_VARIANTS = {
  "256 KiB messages": (_BIG, 256 << 10, 1),
  "4 MiB messages": (_BIG, 4 << 20, 1),
  "1 MiB, 2 channels": (_BIG, 1 << 20, 2),
  "1 MiB, 4 channels": (_BIG, 1 << 20, 4),
  "1 MiB, tx zerocopy": (_BIG + _ZEROCOPY, 1 << 20, 1),
  "4 MiB, 16 MiB frames+reads": (
    [
      *_BIG,
      ("grpc.http2.max_frame_size", 16 << 20),
      ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
      ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
    ],
    4 << 20,
    1,
  ),
}
_SINGLE_THREADED = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


def _bare_server(options) -> tuple[grpc.Server, int]:
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
  handlers = {
    "S": grpc.stream_unary_rpc_method_handler(_drain, _identity, _identity),
    "P": grpc.unary_stream_rpc_method_handler(_spew, _identity, _identity),
  }
  server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Bare", handlers)])
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  return server, port


def _init_values(n: int) -> dict[str, np.ndarray]:
  """The fragment's initial global values: the same in both processes (seeded)."""
  return {_KEY: np.random.default_rng(0).standard_normal(n, dtype=np.float32)}


_ROUND_STEP = 1  # The one round every push answers; opened by the receiving process at start.


def _syncer_configs() -> tuple[ServiceConfig, SyncerConfig]:
  # min_quorum=3 with two learners (0 pushing pre-built chunks, 1 as learners push): a push files
  # into the round and never triggers a merge.
  # No learner is declared dead between its calls, however long a loaded round takes.
  service = ServiceConfig(uplink_codec="fp32", downlink_codec="fp32", liveness_timeout_s=3600.0)
  return service, SyncerConfig(min_quorum=3, use_grace=False)


def _restart_learner(core: SyncerCore, learner: int = 0) -> None:
  """The learner rejoins and holds the current version: its next answer supersedes its last one."""
  core.register(learner)
  core.mark_delivered(learner, 0, core.version(0))


def _receivers(conn, n: int) -> None:
  """The receiving process: the syncer service, the raw TCP reader and the bare gRPC server.

  Sends their ports, then answers b"cpu" with this process's CPU seconds, b"restart0" and
  b"restart1" by restarting learner 0 or 1 in the core (`_restart_learner`), and b"stop" with the
  service's counters, and exits.
  """
  init = _init_values(n)
  layout = layout_lib.make_layout(init, num_fragments=1)
  service_config, syncer_config = _syncer_configs()
  service = make_syncer(
    fragment_keys=layout.fragments,
    init_values=init,
    syncer_config=syncer_config,
    service_config=service_config,
    layout_digest=layout.digest,
  )
  del init
  if service.core.open_round(0, _ROUND_STEP) is None:
    raise RuntimeError("Could not open the round the pushes answer.")
  server = serve(service, token=_TOKEN)
  discards = [_DiscardServer(ring=False), _DiscardServer(ring=True)]
  bares = {"bare": _bare_server(service_config.channel_options())}
  bares |= {name: _bare_server(opts) for name, (opts, _, _) in _VARIANTS.items()}
  ports = {"syncer": server.port, "bulk": server.bulk.port}
  ports |= {"raw": discards[0].port, "raw_ring": discards[1].port}
  conn.send(ports | {name: port for name, (_, port) in bares.items()})
  while (msg := conn.recv()) in (b"cpu", b"restart0", b"restart1"):
    if msg == b"cpu":
      conn.send(time.process_time())
    else:
      with service.lock:
        _restart_learner(service.core, int(msg[-1:]))
      conn.send(True)
  status = server.service.status()
  conn.send({**status.counters, "merges": status.merges, "refused": sum(status.refused.values())})
  for bare, _ in bares.values():
    bare.stop(None)
  for discard in discards:
    discard.close()
  server.stop(flush=False)


class _Peer:
  """The receiving process (`_receivers`), started with spawn: no copy of this one's threads."""

  def __init__(self, n: int):
    ctx = multiprocessing.get_context("spawn")
    self._conn, child = ctx.Pipe()
    self._proc = ctx.Process(target=_receivers, args=(child, n), name="receivers", daemon=True)
    self._proc.start()
    if not self._conn.poll(120.0):
      self._proc.kill()
      raise RuntimeError("The receiving process did not start within 120 s.")
    self.ports = self._conn.recv()

  def cpu_s(self) -> float:
    self._conn.send(b"cpu")
    return self._conn.recv()

  def restart_learner(self, learner: int = 0) -> None:
    """Restarts a learner in the service's core (`_restart_learner`), so it may answer again."""
    self._conn.send(b"restart%d" % learner)
    self._conn.recv()

  def stop(self) -> dict[str, int]:
    """Stops the receivers; returns the service's counters (accepted, superseded, merges...)."""
    self._conn.send(b"stop")
    counters = self._conn.recv()
    self._proc.join(timeout=30)
    return counters

  def close(self) -> None:
    """Ends the receiving process if it is still there (after `stop`, or on an error)."""
    if self._proc.is_alive():
      self._proc.kill()
      self._proc.join(timeout=10)


class _Floors:
  """The two baselines over the same bytes: raw TCP `sendall` and a bare gRPC byte stream."""

  def __init__(self, payload: bytes, options: list[tuple[str, int]], peer: _Peer):
    self._payload = payload
    self._peer = peer
    self._conns = {
      kind: socket.create_connection(("127.0.0.1", peer.ports[kind]))
      for kind in ("raw", "raw_ring")
    }
    self._channel = grpc.insecure_channel(f"127.0.0.1:{peer.ports['bare']}", options)
    self._call = self._channel.stream_unary(
      "/bench.Bare/S", request_serializer=_identity, response_deserializer=_identity
    )
    self._pieces = [payload[i : i + _PIECE] for i in range(0, len(payload), _PIECE)]
    self._pull = self._channel.unary_stream(
      "/bench.Bare/P", request_serializer=_identity, response_deserializer=_identity
    )
    self._variants = {}
    for name, (opts, piece, channels) in _VARIANTS.items():
      chans = [
        grpc.insecure_channel(
          f"127.0.0.1:{peer.ports[name]}", [*opts, ("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(channels)
      ]
      calls = [
        c.stream_unary(
          "/bench.Bare/S", request_serializer=_identity, response_deserializer=_identity
        )
        for c in chans
      ]
      self._variants[name] = (chans, calls, piece)
    single = grpc.insecure_channel(f"127.0.0.1:{peer.ports['bare']}", options + _SINGLE_THREADED)
    self._variants["single"] = ([single], [], _PIECE)
    self._pull_single = single.unary_stream(
      "/bench.Bare/P", request_serializer=_identity, response_deserializer=_identity
    )

  def raw(self, kind: str = "raw") -> Seconds:
    """Time to send the payload in 1 MiB sendall pieces and receive the reader's ack; `kind`:
    "raw" (read into a full-size buffer) or "raw_ring" (into one 1 MiB buffer), `_DiscardServer`."""
    view = memoryview(self._payload)
    conn = self._conns[kind]
    with _Stopwatch(self._peer) as watch:
      conn.sendall(_LEN.pack(len(view)))
      for i in range(0, len(view), _PIECE):
        conn.sendall(view[i : i + _PIECE])
      if conn.recv(1) != b"k":
        raise RuntimeError("The discard server did not acknowledge.")
    return watch.seconds

  def bare(self) -> Seconds:
    """Time to stream the payload as 1 MiB bytes messages through gRPC and get the count back."""
    with _Stopwatch(self._peer) as watch:
      got = int.from_bytes(self._call(iter(self._pieces), timeout=300.0), "little")
    if got != len(self._payload):
      raise RuntimeError(f"The bare gRPC server counted {got} bytes of {len(self._payload)}.")
    return watch.seconds

  def variant(self, name: str) -> Seconds:
    """The bare stream with one of gRPC's own options (`_VARIANTS`): the payload split evenly
    over the variant's channels, each one stream, all at once."""
    _, calls, piece = self._variants[name]
    share = len(self._payload) // len(calls)
    pieces = [self._payload[i : min(i + piece, share)] for i in range(0, share, piece)]
    with _Stopwatch(self._peer) as watch, futures.ThreadPoolExecutor(len(calls)) as pool:
      got = sum(
        pool.map(lambda call: int.from_bytes(call(iter(pieces), timeout=300.0), "little"), calls)
      )
    if got != sum(map(len, pieces)) * len(calls):
      raise RuntimeError(f"The bare gRPC server counted {got} bytes.")
    return watch.seconds

  def bare_pull(self, *, single_threaded: bool = False) -> Seconds:
    """The same bytes as 1 MiB raw messages streamed back by a bare unary-stream method."""
    call = self._pull_single if single_threaded else self._pull
    with _Stopwatch(self._peer) as watch:
      got = sum(map(len, call(struct.pack("<QQ", len(self._payload), _PIECE), timeout=300.0)))
    if got != len(self._payload) // _PIECE * _PIECE:
      raise RuntimeError(f"The bare pull got {got} bytes.")
    return watch.seconds

  def close(self) -> None:
    for conn in self._conns.values():
      conn.close()
    self._channel.close()
    for chans, _, _ in self._variants.values():
      for c in chans:
        c.close()


class _Service:
  """The learner's side of a served syncer (in the peer) holding one fragment: two registered
  learners that pulled it, and their pushes over its bulk port."""

  def __init__(self, init: dict[str, np.ndarray], peer: _Peer, *, delta: bool):
    n = init[_KEY].size
    layout = layout_lib.make_layout(init, num_fragments=1)
    self.config, syncer_config = _syncer_configs()
    self._peer = peer
    address = f"127.0.0.1:{peer.ports['syncer']}"
    # Learner 0 registers for a session, with which pre-built chunk messages go over the bulk
    # port itself (`BulkClient`).
    self.client = SyncerClient(address, token=_TOKEN, transfer_deadline_s=300.0)
    self.client.wait_ready(30.0)
    self.client.register(0, layout_digest=layout.digest, num_fragments=1)
    chunk = self.config.bulk_chunk_bytes
    self.bulk = BulkClient(
      "127.0.0.1",
      peer.ports["bulk"],
      token=_TOKEN,
      max_frame_bytes=chunk + FRAMING_SLACK,
      chunk_bytes=chunk,
    )
    # Learner 1 is a `SyncerClient` as learners run it: its pushes and pulls go over the bulk
    # port the syncer advertises.
    self.bulk_client = SyncerClient(address, token=_TOKEN, transfer_deadline_s=300.0)
    self.bulk_client.register(1, layout_digest=layout.digest, num_fragments=1)
    if self.bulk_client.bulk_port != peer.ports["bulk"]:
      raise RuntimeError("The syncer did not advertise its bulk port.")
    self.shapes, self.dtypes = {_KEY: (n,)}, {_KEY: np.float32}
    # Registered and delivered: the learners' reports now weigh > 0 (docs/algorithm.md §3).
    anchor = self.client.pull(0, 0, -1, layout_keys=[_KEY], shapes=self.shapes, dtypes=self.dtypes)
    before = self.bulk_client.bytes_down
    self.bulk_pull()
    self.pull_bytes = self.bulk_client.bytes_down - before
    noise = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    self._theta = {_KEY: anchor.values[_KEY] + np.float32(1e-3) * noise}
    self.anchor_values = anchor.values if delta else None
    # The core's filing of a decoded report, timed offline on a core of its own (same config).
    self.filing = SyncerCore(
      fragment_keys=layout.fragments, init_values=init, config=syncer_config, clock=time.monotonic
    )
    self.filing.register(0)
    self.filing.mark_delivered(0, 0, 0)
    self.filing.open_round(0, _ROUND_STEP)
    self._pool = ArrayPool(max_free_bytes=4 * n)  # Recycles memory as the service does.
    self._step = 0

  def report(self, learner: int = 0) -> Report:
    # Every report answers the one open round; the learner is restarted before each is filed.
    self._step += 1
    return Report(
      learner_id=learner,
      fragment=0,
      values=self._theta,
      tokens=1024,
      steps=1,
      anchor_version=0,
      step=self._step,
      round_step=_ROUND_STEP,
    )

  def pieces(self, report: Report):
    """A report's push as the client sends it: pieces of its framed chunk messages."""
    return messages.push_pieces(
      report,
      "fp32",
      bulk_wire.frame_head,
      chunk_size=self.config.bulk_chunk_bytes,
      anchor_values=self.anchor_values,
    )

  def chunks(self, report: Report) -> list[bytes]:
    """The serialized PushChunk messages of a report, all made up front."""
    return [bytes(m) for m in bulk_wire.messages_of(self.pieces(report))]

  def bulk_push(self) -> Seconds:
    report = self.report(learner=1)
    self._peer.restart_learner(1)
    with _Stopwatch(self._peer) as watch:
      result = self.bulk_client.push(report, "fp32", anchor_values=self.anchor_values)
    if result.status not in ("accepted", "superseded") or result.weight <= 0:
      raise RuntimeError(f"Bulk push was not filed with weight > 0: {result}")
    return watch.seconds

  def bulk_push_theta(self) -> Seconds:
    """`bulk_push` of θ itself (no anchor values): fp32, θ's own bytes, checked in place; the
    syncer's door sums ‖Θ^(anchor) − θ‖² against its kept anchor at filing."""
    report = self.report(learner=1)
    self._peer.restart_learner(1)
    with _Stopwatch(self._peer) as watch:
      result = self.bulk_client.push(report, "fp32")
    if result.status not in ("accepted", "superseded") or result.weight <= 0:
      raise RuntimeError(f"Bulk θ push was not filed with weight > 0: {result}")
    return watch.seconds

  def bulk_prebuilt(self) -> Seconds:
    chunks = self.chunks(self.report())
    self._peer.restart_learner()
    with _Stopwatch(self._peer) as watch:
      body = self.bulk.push(bulk_wire.message_frames(chunks), self.client.session(0), 300.0)
    if syncer_pb2.PushResponse.FromString(body).status not in ("accepted", "superseded"):
      raise RuntimeError("Pre-built bulk push was not filed.")
    return watch.seconds

  def bulk_pull(self) -> Seconds:
    with _Stopwatch(self._peer) as watch:
      state = self.bulk_client.pull(
        1, 0, -1, layout_keys=[_KEY], shapes=self.shapes, dtypes=self.dtypes
      )
    if state is None or state.version != 0:
      raise RuntimeError("The bulk pull did not return version 0 of the fragment.")
    return watch.seconds

  def offline_split(self) -> dict[str, Seconds]:
    """Time of each step of a push, run in this thread with the functions the two ends call."""
    report = self.report()
    with _Stopwatch() as serialize:  # As the client sends them: each piece dropped once sent.
      for _ in self.pieces(report):
        pass
    chunks = self.chunks(report)
    with _Stopwatch() as parse:
      parsed = [frames.parse_chunk(c, syncer_pb2.PushHeader) for c in chunks]
    with _Stopwatch() as decode:
      decoded = messages.chunks_to_report(
        parsed,
        [_KEY],
        self.shapes,
        self.dtypes,
        max_chunk_bytes=self.config.bulk_chunk_bytes,
        alloc=self._pool.empty,
        check_finite=False,  # As the service decodes: the core's filing checks every value.
      )
    _restart_learner(self.filing)
    with _Stopwatch() as filing:
      result = self.filing.report(decoded, copy=False)  # As the service files it.
    if result.weight <= 0:
      raise RuntimeError(f"The offline filing was refused: {result}")
    return {
      "serialize": serialize.seconds,
      "parse": parse.seconds,
      "decode": decode.seconds,
      "filing": filing.seconds,
    }

  def close(self) -> None:
    self.client.close()
    self.bulk_client.close()


def _mib_s(nbytes: int, seconds: float) -> float:
  return nbytes / (1 << 20) / seconds


def _print(med: dict[str, Seconds], *, n: int, wire_bytes: int, pull_bytes: int, note: str) -> None:
  print(
    f"fragment: 1 key x {n:,} float32 = {n * 4 / (1 << 20):.0f} MiB; wire bytes per push "
    f"{wire_bytes:,} (fp32{' delta' if _DELTA.value else ''}, the bulk port's chunks); loopback, "
    "token on; "
    f"{_ROUNDS.value} rounds (median); {note}"
  )
  print(f"  {'path':28s} {'wall s':>7s} {'MiB/s':>8s} {'cpu s':>7s} {'MiB/cpu-s':>10s}")
  for label, key, nbytes in (
    ("raw TCP into a full buffer", "raw", wire_bytes),
    ("  again at once (settled)", "raw_settled", wire_bytes),
    ("raw TCP into a 1 MiB buffer", "raw_ring", wire_bytes),
    ("bare gRPC stream (1 MiB)", "bare", wire_bytes),
    ("bulk port push (end to end)", "bulk_push", wire_bytes),
    ("  again at once (settled)", "bulk_push_settled", wire_bytes),
    ("bulk port push of θ (fp32)", "bulk_theta", wire_bytes),
    ("  again at once (settled)", "bulk_theta_settled", wire_bytes),
    ("bulk port pull (end to end)", "bulk_pull", pull_bytes),
    ("  again at once (settled)", "bulk_pull_settled", pull_bytes),
  ):
    wall, cpu = med[key][:2]
    print(
      f"  {label:28s} {wall:7.3f} {_mib_s(nbytes, wall):8.1f} {cpu:7.3f} {_mib_s(nbytes, cpu):10.1f}"
    )
  print("  push split (medians, wall / cpu s; each step but the transfer timed offline):")
  rows = (
    ("client encode (push_pieces, streamed)", "serialize"),
    ("pre-built chunks over the bulk port", "bulk_prebuilt"),
    ("  parse of the chunk messages (parse_chunk)", "parse"),
    ("  server reassemble+decode+validate", "decode"),
    ("  core filing (SyncerCore.report)", "filing"),
  )
  for label, key in rows:
    print(f"    {label:45s} {med[key][0]:7.3f} {med[key][1]:7.3f}")
  rest = [
    med["bulk_prebuilt"][i] - sum(med[k][i] for k in ("parse", "decode", "filing")) for i in (0, 1)
  ]
  print(f"    {'  rest: the socket, token, locks':45s} {rest[0]:7.3f} {rest[1]:7.3f}")
  if "bare_pull" in med:
    print("  gRPC's own options on the bare stream (same bytes; ratio to raw TCP, wall / cpu):")
    rows = [("1 MiB (the service's options)", "bare", wire_bytes)]
    rows += [(name, f"opt:{name}", wire_bytes) for name in _VARIANTS]
    rows += [("bare pull, 1 MiB", "bare_pull", wire_bytes)]
    rows += [("bare pull, SingleThreadedUnaryStream", "bare_pull_single", wire_bytes)]
    for label, key, nbytes in rows:
      (wall, cpu), (raw_wall, raw_cpu) = med[key][:2], med["raw"][:2]
      print(
        f"    {label:38s} {_mib_s(nbytes, wall):8.1f} MiB/s  {raw_wall / wall:.3f} / "
        f"{raw_cpu / cpu:.3f}"
      )
  _print_ratios(med, wire_bytes=wire_bytes, pull_bytes=pull_bytes)


def _print_ratios(med: dict[str, Seconds], *, wire_bytes: int, pull_bytes: int) -> None:
  """Each path's throughput over raw TCP's: the goal's figure, bulk push/raw, against each raw.

  A raw right after the other paths (its place in the loop) may run slower than one right after
  itself (settled): the push is compared with each, and the settled push with the settled raw.
  """

  # Throughput ratios are inverse time ratios; a pull's bytes differ a little from a push's.
  def ratio(key: str, raw: str, i: int, nbytes: int = wire_bytes) -> float:
    return _mib_s(nbytes, med[key][i]) / _mib_s(wire_bytes, med[raw][i])

  for i, what in ((0, "wall"), (1, "cpu")):
    print(
      f"  {what:4s}: bulk push/raw = {ratio('bulk_push', 'raw', i):.3f} in the loop, "
      f"{ratio('bulk_push_settled', 'raw_settled', i):.3f} settled, "
      f"{ratio('bulk_push', 'raw_settled', i):.3f} against the settled raw (goal >= 0.5), "
      f"{ratio('bulk_push', 'raw_ring', i):.3f} against the 1 MiB-buffer raw; "
      f"bulk pull/push = {ratio('bulk_pull', 'bulk_push', i, pull_bytes):.3f}, settled "
      f"{ratio('bulk_pull_settled', 'bulk_push_settled', i, pull_bytes):.3f} (goal >= 1)"
    )
    print(
      f"        bulk push of θ/raw = {ratio('bulk_theta', 'raw', i):.3f} in the loop, "
      f"{ratio('bulk_theta_settled', 'raw_settled', i):.3f} settled, "
      f"{ratio('bulk_theta', 'raw_settled', i):.3f} against the settled raw (goal >= 0.5)"
    )
    print(f"        bare gRPC/raw = {ratio('bare', 'raw', i):.3f}")
  # Where the CPU goes: a θ push moves the subtraction Θ^(anchor) − θ from the learner to the
  # syncer (one more read of the anchor there, per push, for every learner it serves).
  sides = ", ".join(
    f"{label} {1e3 * (med[k][1] - med[k][2]):.1f} / {1e3 * med[k][2]:.1f}"
    for label, k in (("raw", "raw"), ("δ push", "bulk_push"), ("θ push", "bulk_theta"))
  )
  print(f"  cpu ms per transfer, learner / syncer process: {sides}")


def main(argv: list[str]) -> None:
  del argv
  n = _MIB.value * (1 << 20) // 4
  peer = _Peer(n)
  try:
    _run(n, peer)
  finally:
    peer.close()


def _run(n: int, peer: _Peer) -> None:
  service = _Service(_init_values(n), peer, delta=_DELTA.value)
  wire_bytes = sum(map(len, service.chunks(service.report())))
  floors = _Floors(bytes(wire_bytes), service.config.channel_options(), peer)
  paths = {
    "raw": floors.raw,
    "raw_settled": floors.raw,  # The same, at once again: settled on itself (`_print`).
    "raw_ring": lambda: floors.raw("raw_ring"),
    "bare": floors.bare,
    "bulk_push": service.bulk_push,
    "bulk_push_settled": service.bulk_push,
    "bulk_theta": service.bulk_push_theta,
    "bulk_theta_settled": service.bulk_push_theta,
    "bulk_pull": service.bulk_pull,
    "bulk_pull_settled": service.bulk_pull,
    "bulk_prebuilt": service.bulk_prebuilt,
  }
  if _OPTIONS.value:
    paths["bare_pull"] = floors.bare_pull
    paths["bare_pull_single"] = lambda: floors.bare_pull(single_threaded=True)
    paths |= {f"opt:{name}": (lambda name=name: floors.variant(name)) for name in _VARIANTS}
  for fn in paths.values():  # Warm-up of every path (connections, allocator).
    fn()
  times: dict[str, list[Seconds]] = {name: [] for name in paths}
  with _Stopwatch(peer) as total:
    for _ in range(_ROUNDS.value):
      for name, fn in paths.items():
        times[name].append(fn())
      for part, t in service.offline_split().items():
        times.setdefault(part, []).append(t)
  pull_bytes = service.pull_bytes
  floors.close()
  service.close()
  counters = peer.stop()
  if counters["merges"] or counters["refused"]:
    raise RuntimeError(f"Pushes must only file into the round: {counters}")
  # Medians of wall and of CPU time, each taken separately.
  med = {k: tuple(statistics.median(t[i] for t in v) for i in range(3)) for k, v in times.items()}
  _print(
    med,
    n=n,
    wire_bytes=wire_bytes,
    pull_bytes=pull_bytes,
    note=f"load avg {os.getloadavg()[0]:.1f}, CPU/wall {total.seconds[1] / total.seconds[0]:.2f}",
  )
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
