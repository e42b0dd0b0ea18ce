"""Soak: a live syncer with 4 learners merging, under 64 stalled pushes and a control-call flood.

  python scripts/bench_door_soak.py [--phase_s=20] [--stalls=64] [--flood_calls=2000]

An in-process syncer (`serve`, shared token, default `ServiceConfig` limits) and 4 in-process fake
learners, each with its own `SyncerClient`: they register, pull, hold a Rounds stream, step every
`--step_s`, heartbeat their step (the syncer's step clock follows the slowest), answer every round
with an fp32 push of Θ + noise and pull every published version. Three phases of `--phase_s` each:

  before  the learners alone;
  during  an attacker holding `--stalls` pushes on the bulk port that send their hello and never a
          chunk (reopened as the syncer cuts them), plus `--flood_calls` Status/Heartbeat calls
          from 8 threads;
  after   the stalls released.

Per phase it prints merges/s, the learners' accepted pushes and failed calls, the control calls'
latency (p50/p99, during only), the process RSS and the door's refusal counts. CPU only.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import collections
import contextlib
import socket
import threading
import time

import grpc
import numpy as np
from absl import app, flags

from ddiloco.protocol import RoundRequest
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, SyncerConfig
from ddiloco.transport import auth, bulk_wire
from ddiloco.transport.client import SyncerClient, fragment_layouts
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

_PHASE_S = flags.DEFINE_float("phase_s", 20.0, "seconds per phase")
_STALLS = flags.DEFINE_integer("stalls", 64, "stalled pushes held during the attack")
_FLOOD = flags.DEFINE_integer("flood_calls", 2000, "Status/Heartbeat calls in the flood")
_STEP_S = flags.DEFINE_float("step_s", 0.05, "a fake learner's step time")
_LEARNERS = 4
_TOKEN = "soak"
_DIGEST = "soak-layout"
_KEYS = [["a/w"], ["b/w"]]


def _rss_mib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


class _Learner:
  """A fake learner: steps on a timer, answers rounds with pushes, pulls what is published."""

  def __init__(self, learner_id: int, address: str, init, stop: threading.Event):
    self.id, self._stop = learner_id, stop
    self.client = SyncerClient(address, token=_TOKEN, deadline_s=5.0, transfer_deadline_s=10.0)
    self._layouts = fragment_layouts(_KEYS, init)
    self._held: dict[int, tuple[int, dict]] = {}
    self._requests: collections.deque = collections.deque()
    self._published: collections.deque = collections.deque()
    self._rng = np.random.default_rng(learner_id)
    self.step = 0
    self.counts: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()

  def _pull(self, p: int) -> None:
    lay = self._layouts[p]
    known = self._held[p][0] if p in self._held else -1
    held = self._held.get(p)
    state = self.client.pull(
      self.id,
      p,
      known,
      layout_keys=list(lay),
      shapes={k: s for k, (s, _) in lay.items()},
      dtypes={k: d for k, (_, d) in lay.items()},
      base_lookup=(lambda v: held[1]) if held is not None else None,
    )
    if state is not None:
      self._held[p] = (state.version, dict(state.values))

  def run(self) -> None:
    self.client.wait_ready(10)
    self.client.register(self.id, layout_digest=_DIGEST, num_fragments=len(_KEYS))
    for p in range(len(_KEYS)):
      self._pull(p)
    threading.Thread(target=self._rounds, daemon=True).start()
    next_beat = 0.0
    while not self._stop.is_set():
      time.sleep(_STEP_S.value)
      self.step += 1
      try:
        if time.monotonic() >= next_beat:
          self.client.heartbeat(self.id, step=self.step, step_time_s=_STEP_S.value)
          next_beat = time.monotonic() + 0.1
        while self._published:
          p, version = self._published.popleft()
          if version > self._held[p][0]:
            self._pull(p)
        while self._requests:
          request = self._requests.popleft()
          try:
            self._answer(request)
          except grpc.RpcError:
            self._requests.appendleft(request)  # Retried next step, as the worker's sender does.
            raise
      except grpc.RpcError as e:
        self.counts[f"failed_{e.code().name}"] += 1

  def _answer(self, request: RoundRequest) -> None:
    version, values = self._held[request.fragment]
    noisy = {
      k: v + 0.001 * self._rng.standard_normal(v.shape, np.float32) for k, v in values.items()
    }
    report = Report(
      learner_id=self.id,
      fragment=request.fragment,
      values=noisy,
      tokens=1000,
      steps=3,
      anchor_version=version,
      step=self.step,
      round_step=request.round_step,
    )
    self.counts[self.client.push(report, "fp32").status] += 1

  def _rounds(self) -> None:
    while not self._stop.is_set():
      stream = self.client.rounds(self.id)
      try:
        for event in stream:
          if isinstance(event, RoundRequest):
            self._requests.append(event)
          else:
            self._published.append(event)
      except grpc.RpcError:
        time.sleep(0.1)
      finally:
        stream.cancel()


class _Attacker:
  """Holds `n` pushes on the bulk port that send their hello and never a chunk, reopening each as
  the syncer ends it."""

  def __init__(self, bulk_port: int, n: int):
    self._port = bulk_port
    self._release = threading.Event()
    self.ended: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()
    self._open: set[socket.socket] = set()
    self._threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(n)]

  def start(self) -> None:
    for t in self._threads:
      t.start()

  def _hold(self) -> None:
    hello = bulk_wire.hello(bulk_wire.OP_PUSH, _TOKEN, "")
    while not self._release.is_set():
      sock = None
      try:
        with socket.create_connection(("127.0.0.1", self._port), timeout=120) as sock:
          with self._lock:
            self._open.add(sock)
          sock.sendall(hello)
          (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, bulk_wire.LENGTH.size))
          code = bulk_wire.read_trailer(sock)[0] if n == bulk_wire.END else None
      except (OSError, bulk_wire.BulkClosed):
        code = None  # Cut without a trailer (the syncer's stop, or the release below).
      with self._lock:
        self._open.discard(sock)
        self.ended[code.name if code is not None else "CLOSED"] += 1
      if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        self._release.wait(0.2)  # Ask again soon: keep every place the syncer gives.

  def stop(self) -> None:
    self._release.set()
    with self._lock:
      for sock in self._open:
        with contextlib.suppress(OSError):
          sock.shutdown(socket.SHUT_RDWR)  # The stalled read ends at once.
    for t in self._threads:
      t.join(10)


def _flood(address: str, calls: int) -> list[float]:
  """`calls` Status and Heartbeat calls from 8 threads; returns their latencies in seconds."""
  latencies: list[float] = []
  lock = threading.Lock()
  channel = grpc.insecure_channel(address)
  stub = syncer_pb2_grpc.SyncerStub(channel)
  md = auth.token_metadata(_TOKEN)

  def worker(k: int) -> None:
    for i in range(k, calls, 8):
      t = time.perf_counter()
      if i % 2:
        stub.Status(syncer_pb2.StatusRequest(), timeout=10, metadata=md)
      else:  # An id that never registered: answered registered=False, as to any stranger.
        stub.Heartbeat(syncer_pb2.HeartbeatRequest(learner_id=10_000 + i), timeout=10, metadata=md)
      with lock:
        latencies.append(time.perf_counter() - t)

  threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  channel.close()
  return latencies


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  init = {
    "a/w": rng.normal(size=(256, 256)).astype(np.float32),
    "b/w": rng.normal(size=(4096,)).astype(np.float32),
  }
  svc = make_syncer(
    fragment_keys=_KEYS,
    init_values=init,
    syncer_config=SyncerConfig(min_quorum=2, grace_max_s=0.5, clock="slowest"),
    service_config=ServiceConfig(uplink_codec="fp32", downlink_codec="bf16"),
    layout_digest=_DIGEST,
  )
  srv = serve(svc, token=_TOKEN)
  address = f"127.0.0.1:{srv.port}"
  stop = threading.Event()
  learners = [_Learner(i, address, init, stop) for i in range(_LEARNERS)]
  threads = [threading.Thread(target=lrn.run, daemon=True) for lrn in learners]
  for t in threads:
    t.start()
  time.sleep(3.0)  # Warm-up: registered, pulled, the step clock running.
  print(f"syncer on {address}; {_LEARNERS} learners; limits {svc.config}")

  def phase(name: str, during=None) -> None:
    merges0, counts0 = (
      svc.status().merges,
      sum((lrn.counts for lrn in learners), start=collections.Counter()),
    )
    t0 = time.monotonic()
    extra = during() if during is not None else ""
    left = _PHASE_S.value - (time.monotonic() - t0)
    if left > 0:
      time.sleep(left)
    dt = time.monotonic() - t0
    merges = svc.status().merges - merges0
    counts = sum((lrn.counts for lrn in learners), start=collections.Counter()) - counts0
    print(
      f"{name:7s} merges/s {merges / dt:6.2f} ({merges} in {dt:.1f} s)  learners {dict(counts)}  "
      f"RSS {_rss_mib():.0f} MiB  open {svc.open_streams()}{extra}"
    )

  phase("before")
  attacker = _Attacker(srv.bulk.port, _STALLS.value)

  def attack() -> str:
    attacker.start()
    time.sleep(1.0)
    t = time.monotonic()
    lat = np.array(_flood(address, _FLOOD.value))
    return (
      f"\n        flood {len(lat)} calls in {time.monotonic() - t:.1f} s: p50 "
      f"{1e3 * np.median(lat):.1f} ms, p99 {1e3 * np.quantile(lat, 0.99):.1f} ms, max "
      f"{1e3 * lat.max():.1f} ms"
    )

  phase("during", attack)
  attacker.stop()
  print(f"        stalled streams ended: {dict(attacker.ended)}")
  phase("after")
  stop.set()
  for t in threads:
    t.join(10)
  for lrn in learners:
    lrn.client.close()
  print(f"refused {svc.refused()}")
  srv.stop(grace_s=1.0)


if __name__ == "__main__":
  app.run(main)
