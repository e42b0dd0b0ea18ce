"""scripts/bench_capacity.py's fake learners: cheap clients that answer every round of every shard.

A fake learner registers with every shard, pulls each fragment once (the syncer counts an answer
only from a learner that received the fragment), holds a Rounds stream per shard and answers every
round with a pre-encoded δ push: the payload is encoded once per fragment, cut in chunks of the
size the shard advertises at Register (`bulk_chunk_bytes`, as a learner's bulk pushes are), and a
push re-makes only its first chunk (the header). Two sender threads per shard, as a learner's. A push goes over the
shard's bulk port (RegisterResponse.bulk_port, as real learners push: one connection per push, the
chunk messages in the port's framing, sent in one gathered write), and so does the pull; the
control calls (Register, Rounds, Heartbeat) over gRPC. A heartbeat loop reports steps at `step_s`, which
paces the syncer's step clock, every `heartbeat_interval_s` the syncer gives at Register (as a
learner's listener does; 0.2 s before).
"""

import contextlib
import dataclasses
import json
import os
import queue
import socket
import threading
import time

import grpc
import numpy as np

TOKEN = "capacity"
TIMEOUT_S = 120.0  # Longest wait for the coordinator or a shard.


class _Answerer:
  """One fake learner's connection to one shard: pulls once, then answers every round."""

  def __init__(self, learner: int, shard: int, pt, *, chunks, log: list, asks: list, stop):
    from ddiloco.transport.client import SyncerClient

    self.client = SyncerClient(pt.addresses[shard], token=TOKEN, transfer_deadline_s=60.0)
    self.learner, self.shard, self._pt, self._chunks = learner, shard, pt, chunks
    self._log, self._asks, self._stop = log, asks, stop
    self._requests: queue.Queue = queue.Queue()
    self._bulk = None
    self.refusals: list = []  # (code, message start) of each transient refusal, retried.
    self.heartbeat_s = 0.25

  def start(self) -> None:
    from ddiloco.transport import bulk_client

    pt = self._pt
    self.client.wait_ready(TIMEOUT_S)
    resp = self.client.register(
      self.learner, layout_digest=pt.digest, num_fragments=pt.total_fragments
    )
    self.heartbeat_s = float(resp.heartbeat_interval_s)  # Learners heartbeat at the syncer's.
    if resp.bulk_chunk_bytes != bulk_chunk_bytes():
      raise RuntimeError(
        f"Shard {self.shard} advertises {resp.bulk_chunk_bytes}-byte bulk chunks; the fleet's "
        f"pushes were cut at {bulk_chunk_bytes()}, so they would not be a learner's."
      )
    self._bulk = (bulk_client.address_host(pt.addresses[self.shard]), resp.bulk_port)
    for p in sorted(pt.owned(self.shard)):  # The shard's own fragments: ids are global.
      key = f"f{p}"
      self.client.pull(
        self.learner,
        p,
        -1,
        layout_keys=[key],
        shapes={key: (pt.fragment_params,)},
        dtypes={key: "float32"},
      )
    for target in (self._rounds, self._sender, self._sender):  # Two senders, as a learner's.
      threading.Thread(target=target, daemon=True).start()

  def _rounds(self) -> None:
    from ddiloco.protocol import RoundRequest

    stream = self.client.rounds(self.learner)
    try:
      for event in stream:
        if isinstance(event, RoundRequest):
          self._asks.append(
            (self.shard, self.learner, time.monotonic(), event.fragment, event.round_step)
          )
          self._requests.put((time.monotonic(), event))
    except grpc.RpcError:  # The stream ends when the shard stops.
      pass

  def _sender(self) -> None:
    while not self._stop.is_set():
      try:
        asked, req = self._requests.get(timeout=0.2)
      except queue.Empty:
        continue
      outcome = self._answer(req)
      if outcome is None:  # The fleet is stopping.
        return
      status, tries = outcome
      now = time.monotonic()
      self._log.append(
        (self.shard, asked, now, status, self.learner, req.fragment, req.round_step, tries)
      )

  def _answer(self, req) -> tuple[str, int] | None:
    """Pushes the answer to `req`, retrying a transient refusal with backoff as a learner's sender
    does (learner_process/retry.py: a round with quorum M waits for every answer, so an answer given up
    would leave its fragment's round open for good). (final status, tries); None when stopping."""
    from ddiloco.learner_process.retry import TRANSIENT, Backoff
    from ddiloco.transport import bulk_wire, events
    from ddiloco.transport.frames import chunk_prefix
    from ddiloco.transport.proto import syncer_pb2

    pt = self._pt
    first, rest, total, tail = self._chunks[req.fragment]
    backoff = Backoff(seed=self.learner)
    tries = 0
    while not self._stop.is_set():
      tries += 1
      step = max(req.round_step, int((time.monotonic() - pt.t0) / pt.step_s))
      header = syncer_pb2.PushHeader(
        learner_id=self.learner,
        fragment=req.fragment,
        anchor_version=req.base_version,
        tokens=1000,
        steps=pt.fragments,
        step=step,
        step_time_s=pt.step_s,
        new_tokens=1000,
        round_step=req.round_step,
        codec=pt.codec,
        total_bytes=total,
        num_chunks=1 + len(rest),
        delta=True,
      ).SerializeToString()
      messages = [chunk_prefix(0, len(first), header) + first, *rest]
      try:
        sent = messages[:1] if tail is not None else messages
        body = _bulk_push(self._bulk, sent, self.client.session(self.learner), tail)
        resp = syncer_pb2.PushResponse.FromString(body)
        return events.report_result(resp).status, tries
      except grpc.RpcError as e:  # A bulk refusal is one too (bulk_wire.BulkError).
        if e.code() not in TRANSIENT:
          return e.code().name, tries
        self.refusals.append((e.code().name, (e.details() or "")[:60]))
      except (OSError, bulk_wire.BulkClosed):
        pass  # Retried, as a learner's sender retries an unavailable bulk port.
      except ValueError:  # The channel closed under the call: the fleet is stopping.
        return None
      self._stop.wait(backoff.next_delay())
    return None

  def set_point(self, pt) -> None:
    self._pt = pt

  def close(self) -> None:
    self.client.close()


def _bulk_push(
  address: tuple[str, int], messages: list[bytes], session: str, tail: "_Tail | None" = None
) -> bytes:
  """One push over the bulk port, the cheapest way: the hello, every frame and the end mark in
  one gathered send (the kernel copies each byte once), then the syncer's answer. With `tail`
  (`--fleet_send=sendfile`), `messages` is only the first chunk: the other frames and the end mark
  are the same bytes, sent from `tail`'s file with sendfile, which lends the kernel the file's
  pages instead of copying them (what a fake learner costs the machine is then mostly the
  syncer's receive, as with learners on other hosts).

  Returns the serialized PushResponse. Raises `bulk_wire.BulkError` (a grpc.RpcError) on a
  refusal, OSError or `bulk_wire.BulkClosed` if the connection fails.
  """
  from ddiloco.transport import bulk_wire

  parts = [bulk_wire.hello(bulk_wire.OP_PUSH, TOKEN, session)]
  for m in messages:
    parts += [bulk_wire.LENGTH.pack(len(m)), m]
  if tail is None:
    parts.append(bulk_wire.LENGTH.pack(bulk_wire.END))
  with socket.create_connection(address, timeout=60.0) as sock:
    bulk_wire.tune(sock)
    with contextlib.suppress(OSError):  # A refusal from the header may close it before the rest.
      bulk_wire.send_parts(sock, parts)
      if tail is not None:
        sock.sendfile(tail.file, 0, tail.nbytes)
    (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, bulk_wire.LENGTH.size))
    if n != bulk_wire.END:
      raise bulk_wire.BulkClosed(f"expected the syncer's answer, got a {n}-byte frame")
    code, message, body = bulk_wire.read_trailer(sock)
  if code != grpc.StatusCode.OK:
    raise bulk_wire.BulkError(code, message)
  return body


@dataclasses.dataclass(frozen=True)
class _Tail:
  """A push's frames after the first chunk and its end mark, in an in-memory file (sendfile)."""

  file: object
  nbytes: int


def _tail(rest: list[bytes]) -> _Tail:
  from ddiloco.transport import bulk_wire

  fd = os.memfd_create("bench-capacity-push")
  with contextlib.ExitStack() as undo:
    undo.callback(os.close, fd)
    for m in rest:
      os.write(fd, bulk_wire.LENGTH.pack(len(m)))
      view = memoryview(m)
      while view:
        view = view[os.write(fd, view) :]
    os.write(fd, bulk_wire.LENGTH.pack(bulk_wire.END))
    undo.pop_all()
  f = os.fdopen(fd, "rb")
  return _Tail(f, os.fstat(fd).st_size)


def bulk_chunk_bytes() -> int:
  """The chunk size of a push: the one the shards advertise at Register (their `ServiceConfig`'s,
  the default), which a learner's bulk pushes are cut at (`SyncerClient`); checked at Register."""
  from ddiloco.service.service_config import ServiceConfig

  return ServiceConfig().bulk_chunk_bytes


def _encode_payloads(
  pt, send: str = "sendmsg"
) -> dict[int, tuple[bytes, list[bytes], int, _Tail | None]]:
  """Per fragment: first chunk's data, the other chunk messages, total payload bytes, and with
  `send="sendfile"` the other frames in a file (`_bulk_push`)."""
  from ddiloco.transport.fragment_encoder import FragmentEncoder
  from ddiloco.transport.frames import chunk_prefix

  delta = 1e-3 * np.random.default_rng(0).standard_normal(pt.fragment_params, np.float32)
  out = {}
  for p in range(pt.total_fragments):
    enc = FragmentEncoder({f"f{p}": delta}, pt.codec)
    data = list(enc.chunks(bulk_chunk_bytes()))
    rest = [chunk_prefix(i, len(d)) + d for i, d in enumerate(data) if i]
    out[p] = (data[0], rest, enc.nbytes, _tail(rest) if send == "sendfile" else None)
  return out


def _wait_for(path: str, why: str) -> None:
  """Waits for the coordinator to write `path`; raises TimeoutError(why) after TIMEOUT_S."""
  deadline = time.monotonic() + TIMEOUT_S
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(why)
    time.sleep(0.02)


def fleet_main(pt, out: str, *, index: int, procs: int, send: str = "sendmsg") -> None:
  """Fake learners `index::procs` of the M in `pt` (bench_capacity.Point) against every shard, until
  its window ends, pushing over the bulk port, its frames by `send` (`_bulk_push`); writes their
  pushes and round requests to `out`."""
  stop = threading.Event()
  chunks = _encode_payloads(pt, send)  # While the shards start: the coordinator starts both.
  _wait_for(out + ".serving", "no word from the coordinator that the shards serve")
  log: list = []
  asks: list = []
  ids = range(index, pt.learners, procs)
  conns = [
    _Answerer(m, s, pt, chunks=chunks, log=log, asks=asks, stop=stop)
    for m in ids
    for s in range(pt.shards)
  ]
  for c in conns:
    c.start()
  with open(out + ".ready", "w"):
    pass
  _wait_for(out + ".go", "no go from the coordinator")  # Once every fleet process has pulled.
  with open(out + ".go") as f:
    pt = dataclasses.replace(pt, t0=float(f.read()))
  for c in conns:
    c.set_point(pt)
  end = pt.t0 + pt.warmup_s + pt.windows * pt.window_s + 0.5
  while (now := time.monotonic()) < end:  # Heartbeats: the steps the syncer's clock follows.
    step = max(0, int((now - pt.t0) / pt.step_s))
    for c in conns:  # A late heartbeat under load is dropped: the next one carries the step.
      with contextlib.suppress(grpc.RpcError):
        c.client.heartbeat(c.learner, step=step, step_time_s=pt.step_s)
    time.sleep(min(c.heartbeat_s for c in conns))
  stop.set()
  with open(out, "w") as f:
    refusals = [r for c in conns for r in c.refusals]
    json.dump({"pushes": list(log), "asks": list(asks), "refusals": refusals}, f)
  for c in conns:
    c.close()
