"""Benchmark: the syncer's CPU per GB of learners' pushes, per uplink codec.

A syncer service (`make_syncer` + `serve`, its bulk port on loopback) runs in a process of its own,
as it does in a deployment; this process plays M learners. Each learner's δ push (a fragment of one
float32 key, `--fragment_mib`, encoded in the codec) is built once, before anything is timed, and
only its header (round, anchor version) is made again each round, so the learners' encoding is not
charged to anyone: what is timed is the syncer process's CPU (every thread's, the kernel's copies
out of the socket as system time) while the M pushes of a round are received over the bulk port,
parsed, checked, decoded and filed (`DataStreams.push` into `SyncerCore.report`), one after the
other, then while the round is merged and published (`SyncerService.advance`, run by this
benchmark in place of the merge thread, which is stopped so that it merges exactly when told).

CPU time, not wall time: on a loaded machine it is the steadier figure, and it is what a shard's
capacity is made of (docs/results.md, "Syncer capacity and shards"). Printed per codec, medians
over `--rounds` rounds: the syncer's CPU-seconds per GB of pushes (wire bytes), the GB of pushes
one core ingests per second, the same per GB of decoded float32, the merge's CPU, and the minor
page faults of the ingest and of the merge (fresh memory, which the kernel zeroes on first touch).
The syncer process runs with OPENBLAS_NUM_THREADS=1 unless set, as `ddiloco-syncer` does.

`--baseline_tree=DIR` runs a second syncer process from another checkout of the package (e.g.
`git archive HEAD~3 | tar -x -C /tmp/base`) and interleaves its rounds with this tree's, so both
see the same load: the before/after of one run. `--stages` also times the server's functions
offline in this process (chunk parsing, decode into a report, filing), and `--profile` prints
their cProfile.

  PYTHONPATH=. python scripts/bench_ingest.py --codecs=int4,bf16,fp32 --fragment_mib=32 \
    --learners=8 --rounds=5 [--baseline_tree=/tmp/base]
"""

import cProfile
import json
import os
import pstats
import resource
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

import ddiloco
from ddiloco.transport import bulk_wire, frames, messages
from ddiloco.transport.bulk_client import BulkClient
from ddiloco.transport.chunks import FRAMING_SLACK, ArrayPool
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.proto import syncer_pb2

_CODECS = flags.DEFINE_list("codecs", ["int4", "bf16", "fp32"], "uplink codecs to time")
_MIB = flags.DEFINE_integer("fragment_mib", 32, "the fragment's size in MiB of float32")
_LEARNERS = flags.DEFINE_integer("learners", 8, "M: answers per round (the round's quorum)")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "timed rounds per codec (median reported)")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed rounds first (pages faulted, pools filled)")
_BASELINE = flags.DEFINE_string(
  "baseline_tree", "", "a checkout whose `ddiloco` a second syncer runs, interleaved (before/after)"
)
_STAGES = flags.DEFINE_bool("stages", False, "also time the server's stages offline, here")
_PROFILE = flags.DEFINE_bool("profile", False, "with --stages: print their cProfile")
_PERF = flags.DEFINE_string(
  "perf_out", "", "record the syncer's timed rounds with `perf record -g` into this file"
)
_SERVE = flags.DEFINE_string("serve", "", "internal: run the syncer process for this codec")

_KEY = "w"
_TOKEN = "bench-ingest-token"
_GB = 1e9


def _init_values(n: int) -> dict[str, np.ndarray]:
  """The fragment's initial values: the same in both processes (seeded)."""
  return {_KEY: np.random.default_rng(0).standard_normal(n, dtype=np.float32)}


def _values(mib: int) -> int:
  return mib << 18


# -- the syncer process -------------------------------------------------------------------------


def _serve(codec: str, mib: int, learners: int) -> None:
  """The syncer process: answers one JSON command a line on stdin, on stdout."""
  from ddiloco.fragments import layout as layout_lib
  from ddiloco.service.server import make_syncer, serve
  from ddiloco.service.service_config import ServiceConfig
  from ddiloco.syncer.core import SyncerConfig

  init = _init_values(_values(mib))
  layout = layout_lib.make_layout(init, num_fragments=1)
  service = make_syncer(
    fragment_keys=layout.fragments,
    init_values=init,
    syncer_config=SyncerConfig(min_quorum=learners, use_grace=False),
    service_config=ServiceConfig(uplink_codec=codec, liveness_timeout_s=3600.0),
    layout_digest=layout.digest,
  )
  del init
  server = serve(service, token=_TOKEN)
  service.stop(flush=False)  # The merge thread: rounds are opened and merged when told.
  out = sys.stdout
  out.write(json.dumps({"grpc": server.port, "bulk": server.bulk.port, "pid": os.getpid()}) + "\n")
  out.flush()
  core = service.core
  for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "round":
      with service.lock:
        version = core.version(0)
        for learner in range(learners):
          core.mark_delivered(learner, 0, version)
        if core.open_round(0, cmd["step"]) is None:
          raise RuntimeError("The round could not be opened.")
      reply = {"version": version}
    elif op == "cpu":
      reply = {}
    elif op == "merge":
      service.advance(open_rounds=False)
      reply = {"version": core.version(0)}
    elif op == "stop":
      break
    else:
      raise ValueError(op)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    reply["cpu"], reply["sys"] = usage.ru_utime + usage.ru_stime, usage.ru_stime
    reply["faults"] = usage.ru_minflt
    out.write(json.dumps(reply) + "\n")
    out.flush()
  server.stop(flush=False)


class _Syncer:
  """A syncer process (`_serve`) running the `ddiloco` of `tree`."""

  def __init__(self, tree: str, codec: str, mib: int, learners: int):
    env = dict(os.environ, PYTHONPATH=tree)
    # As `ddiloco-syncer` sets it (launch/syncer_main.py): an idle OpenBLAS thread spins, and its
    # spinning is charged to the syncer's CPU (scripts/bench_merge.py).
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    argv = [sys.executable, os.path.abspath(__file__), f"--serve={codec}"]
    argv += [f"--fragment_mib={mib}", f"--learners={learners}"]
    self.tree = tree
    self._proc = subprocess.Popen(
      argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    self.ports = json.loads(self._proc.stdout.readline())

  def call(self, op: str, **kw) -> dict:
    self._proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
    self._proc.stdin.flush()
    line = self._proc.stdout.readline()
    if not line:
      raise RuntimeError(f"The syncer process of {self.tree} ended.")
    return json.loads(line)

  def close(self) -> None:
    if self._proc.poll() is None:
      self._proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
      self._proc.stdin.flush()
      try:
        self._proc.wait(30)
      except subprocess.TimeoutExpired:
        self._proc.kill()


# -- the learners -------------------------------------------------------------------------------


def _pushes(codec: str, mib: int, learners: int, chunk_bytes: int) -> list[list[bytes]]:
  """Each learner's δ push as its chunk messages (chunk 0's header is made again each round)."""
  from ddiloco.syncer.core import Report

  init = _init_values(_values(mib))
  out = []
  for m in range(learners):
    noise = np.random.default_rng(1 + m).standard_normal(init[_KEY].size, dtype=np.float32)
    theta = {_KEY: init[_KEY] + np.float32(1e-3) * noise}
    report = Report(
      learner_id=m, fragment=0, values=theta, tokens=1024, steps=1, anchor_version=0, step=1
    )
    pieces = messages.push_pieces(
      report, codec, bulk_wire.frame_head, chunk_size=chunk_bytes, anchor_values=init
    )
    out.append([bytes(c) for c in bulk_wire.messages_of(pieces)])
  return out


def _with_header(chunks: list[bytes], step: int, version: int) -> list[bytes]:
  """The push answering round `step` of a fragment at `version`: chunk 0 made again."""
  first = frames.parse_chunk(chunks[0], syncer_pb2.PushHeader)
  header = first.header
  header.step, header.round_step, header.anchor_version = step, step, version
  head = frames.chunk_prefix(0, len(first.data), header.SerializeToString())
  return [head + bytes(first.data), *chunks[1:]]


class _Fleet:
  """M registered learners of one syncer process, pushing their pre-built answers."""

  def __init__(self, syncer: _Syncer, learners: int, layout_digest: str, chunk_bytes: int):
    self.syncer = syncer
    self.client = SyncerClient(f"127.0.0.1:{syncer.ports['grpc']}", token=_TOKEN)
    self.client.wait_ready(60.0)
    for m in range(learners):
      self.client.register(m, layout_digest=layout_digest, num_fragments=1)
    self.bulk = BulkClient(
      "127.0.0.1",
      syncer.ports["bulk"],
      token=_TOKEN,
      max_frame_bytes=chunk_bytes + FRAMING_SLACK,
      chunk_bytes=chunk_bytes,
    )
    self.step = 0

  def round(self, pushes: list[list[bytes]]) -> tuple[float, float, int, int]:
    """One round: M pushes, then the merge; (ingest, merge) CPU seconds of the syncer, then the
    minor page faults of each (fresh memory touched)."""
    self.step += 1
    version = self.syncer.call("round", step=self.step)["version"]
    framed = [_with_header(c, self.step, version) for c in pushes]
    before = self.syncer.call("cpu")
    for m, chunks in enumerate(framed):
      body = self.bulk.push(bulk_wire.message_frames(chunks), self.client.session(m), 300.0)
      response = syncer_pb2.PushResponse.FromString(body)
      if response.status != "accepted" or response.weight <= 0:
        raise RuntimeError(f"Push of learner {m} not filed with weight > 0: {response}")
    pushed = self.syncer.call("cpu")
    merged = self.syncer.call("merge")
    if merged["version"] != version + 1:
      raise RuntimeError(f"The round did not merge: version {merged['version']}.")
    return (
      pushed["cpu"] - before["cpu"],
      merged["cpu"] - pushed["cpu"],
      pushed["faults"] - before["faults"],
      merged["faults"] - pushed["faults"],
    )

  def close(self) -> None:
    self.client.close()


# -- offline stages -----------------------------------------------------------------------------


def _stages(codec: str, mib: int, chunks: list[bytes], chunk_bytes: int) -> dict[str, float]:
  """CPU seconds of the server's stages for one push, run here in one thread."""
  from ddiloco.fragments import layout as layout_lib
  from ddiloco.syncer.core import SyncerConfig, SyncerCore

  n = _values(mib)
  init = _init_values(n)
  layout = layout_lib.make_layout(init, num_fragments=1)
  core = SyncerCore(
    fragment_keys=layout.fragments,
    init_values=init,
    config=SyncerConfig(min_quorum=2, use_grace=False),
    clock=time.monotonic,
  )
  pool = ArrayPool(8 * 4 * n)
  chunks = _with_header(chunks, 1, 0)

  def once() -> dict[str, float]:
    t0 = time.process_time()
    parsed = [frames.parse_chunk(c, syncer_pb2.PushHeader) for c in chunks]
    t1 = time.process_time()
    report = messages.chunks_to_report(
      parsed,
      [_KEY],
      {_KEY: (n,)},
      {_KEY: np.float32},
      max_chunk_bytes=chunk_bytes,
      alloc=pool.empty,
      check_finite=False,  # As the service decodes: the filing checks every value.
    )
    t2 = time.process_time()
    core.register(0)  # Restarted: its answer supersedes the last.
    core.mark_delivered(0, 0, 0)
    if core.rounds[0].step != 1:
      core.open_round(0, 1)
    t3 = time.process_time()
    result = core.report(report, copy=False)
    t4 = time.process_time()
    if result.weight <= 0:
      raise RuntimeError(f"Offline filing refused: {result}")
    return {"parse": t1 - t0, "decode": t2 - t1, "file": t4 - t3}

  once()
  runs = [once() for _ in range(5)]
  if _PROFILE.value:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
      once()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
  return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# -- main ---------------------------------------------------------------------------------------


def _tree() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(ddiloco.__file__)))


def _line(name: str, wire: int, decoded: int, samples: tuple[list, list, list]) -> str:
  ingest, merge, faults = samples
  s = statistics.median(ingest)
  per_gb = s / (wire / _GB)
  merge_s = statistics.median(merge)
  return (
    f"  {name:<9} ingest {per_gb:6.3f} CPU-s/GB = {1 / per_gb:5.2f} GB/s per core "
    f"({decoded / _GB / s:5.2f} GB/s decoded; {s * 1e3:6.1f} ms a round, "
    f"spread {min(ingest) * 1e3:.0f}-{max(ingest) * 1e3:.0f}) | merge {merge_s * 1e3:6.1f} ms, "
    f"with it {(s + merge_s) / (wire / _GB):6.3f} CPU-s/GB | page faults "
    f"{statistics.median(f[0] for f in faults):.0f} + {statistics.median(f[1] for f in faults):.0f}"
  )


def _run_codec(codec: str) -> None:
  from ddiloco.fragments import layout as layout_lib
  from ddiloco.service.service_config import ServiceConfig

  mib, learners = _MIB.value, _LEARNERS.value
  chunk_bytes = ServiceConfig().bulk_chunk_bytes
  digest = layout_lib.make_layout(_init_values(_values(mib)), num_fragments=1).digest
  pushes = _pushes(codec, mib, learners, chunk_bytes)
  wire = sum(len(c) for chunks in pushes for c in chunks)
  decoded = learners * _values(mib) * 4
  trees = {"this": _tree()}
  if _BASELINE.value:
    trees = {"baseline": os.path.abspath(_BASELINE.value), **trees}
  syncers = {name: _Syncer(tree, codec, mib, learners) for name, tree in trees.items()}
  try:
    fleets = {name: _Fleet(s, learners, digest, chunk_bytes) for name, s in syncers.items()}
    times = {name: ([], [], []) for name in fleets}
    perf = None
    for r in range(_WARMUP.value + _ROUNDS.value):
      if r == _WARMUP.value and _PERF.value:
        pid = syncers["this"].ports["pid"]
        perf = subprocess.Popen(
          ["perf", "record", "-g", "-F", "999", "-p", str(pid), "-o", f"{_PERF.value}.{codec}"]
        )
        time.sleep(1.0)
      for name, fleet in fleets.items():  # Interleaved: both see the same load.
        ingest, merge, *faults = fleet.round(pushes)
        if r >= _WARMUP.value:
          times[name][0].append(ingest)
          times[name][1].append(merge)
          times[name][2].append(faults)
    if perf is not None:
      perf.send_signal(signal.SIGINT)
      perf.wait(60)
    print(
      f"{codec}: {learners} pushes of a {mib} MiB fragment, {wire / learners / 2**20:.2f} MiB "
      f"on the wire each, {_ROUNDS.value} rounds"
    )
    for name, samples in times.items():
      print(_line(name, wire, decoded, samples))
    if "baseline" in times:
      ratio = statistics.median(times["baseline"][0]) / statistics.median(times["this"][0])
      print(f"  ingest CPU, baseline / this: {ratio:.2f}x")
    for fleet in fleets.values():
      fleet.close()
  finally:
    for s in syncers.values():
      s.close()
  if _STAGES.value:
    st = _stages(codec, mib, pushes[0], chunk_bytes)
    per = {k: v / (wire / learners / _GB) for k, v in st.items()}
    print("  offline, one push: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st.items()))
    print("  offline CPU-s/GB: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))


def main(argv: list[str]) -> None:
  del argv
  if _SERVE.value:
    _serve(_SERVE.value, _MIB.value, _LEARNERS.value)
    return
  print(f"load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M')}")
  for codec in _CODECS.value:
    _run_codec(codec)


if __name__ == "__main__":
  app.run(main)
