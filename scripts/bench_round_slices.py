r"""One round's syncer work, whole on one shard (S = 1) or sliced over two shards (S = 2).

  python scripts/bench_round_slices.py --learners=8 --group_mib=32 --reps=5 --shard_cpus=0,1

One group of `--group_mib` float32 (`--leaves` leaves of equal size) is one fragment with S = 1
and two byte-balanced slices with S = 2 (`make_layout(slices=2)`, docs/architecture.md, "The
sharded syncer"). Each shard is its own process pinned with `taskset -c` to its own CPU, a syncer
core owning its slice (quorum M, the default outer optimizer and merge rule, no grace window).
Every shard holds M answers pre-encoded as the learners' pushes are (δ in `--codec`, as
`outer_gradient_encoder` frames it), so no learner runs during the round. Two warm-up rounds run
first; then, at one signal to all shards, each opens its round, decodes and files the M answers
(`read_layout`, `SyncerCore.report`) and merges and publishes (`RoundCloser.poll`).

The round's time is from the first shard's opening to the last shard's publication (wall clock,
one host). S = 1 and S = 2 alternate `--reps` times so that the machine's noise hits both alike;
the script prints every round, the medians and the ratio S=2 / S=1 (1 / 2 is the ideal), and the
same for the busiest shard's CPU seconds in the round (its work, without the wait for a core that
dominates the wall time on a loaded machine). What it
leaves out: the network and the transport's threads (the bulk port's reads, gRPC), which a
learner's push also costs the shard, and which slicing splits over the shards as well.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_LEARNERS = flags.DEFINE_integer("learners", 8, "M: answers per round")
_GROUP_MIB = flags.DEFINE_float("group_mib", 32.0, "the group's size, MiB of float32")
_LEAVES = flags.DEFINE_integer("leaves", 4, "leaves of the group (equal sizes)")
_CODEC = flags.DEFINE_string("codec", "bf16", "the uplink codec of the answers")
_REPS = flags.DEFINE_integer("reps", 5, "rounds per shard count (S = 1 and 2 alternate)")
_SHARD_CPUS = flags.DEFINE_list("shard_cpus", ["0", "1"], "taskset CPU of each shard")
_SHARD = flags.DEFINE_integer("shard", -1, "internal: run as this shard")
_SHARDS = flags.DEFINE_integer("shards", 1, "internal: the shard count of the child")


def _shapes(leaves: int, group_mib: float) -> dict[str, np.ndarray]:
  rows = max(2, int(group_mib * 2**20 / 4 / leaves / 256))
  return {f"layer_{i}/kernel": np.zeros((rows, 256), np.float32) for i in range(leaves)}


def _shard_main() -> None:
  """A shard: builds its core and answers, runs the warm-up round, then the timed one at "go"."""
  from ddiloco.fragments.layout import make_layout
  from ddiloco.fragments.schedule import FragmentSchedule
  from ddiloco.protocol import Report
  from ddiloco.syncer.core import SyncerConfig, SyncerCore
  from ddiloco.transport import wire
  from ddiloco.transport.fragment_encoder import outer_gradient_encoder
  from ddiloco.transport.fragment_reader import read_layout

  shard, shards, m = _SHARD.value, _SHARDS.value, _LEARNERS.value
  zeros = _shapes(_LEAVES.value, _GROUP_MIB.value)
  layout = make_layout(zeros, num_fragments=1, slices=shards)
  rng = np.random.default_rng(shard)
  keys = layout.fragments[shard]
  init = {k: v.astype(np.float32) for k, v in layout.select(zeros, shard).items()}
  init = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()}
  core = SyncerCore(
    fragment_keys=layout.fragments,
    init_values=init,
    config=SyncerConfig(use_grace=False, min_quorum=m),
    clock=time.monotonic,
    schedule=FragmentSchedule(num_fragments=1, period=2, overlap=1, slices=shards),
    owned={shard},
  )
  wire_layout = wire.make_layout(keys, layout.shapes, layout.dtypes)
  answers = []
  for i in range(m):
    core.register(i)
    core.fetch(i, shard)
    theta = {
      k: v + np.float32(0.01) * rng.standard_normal(v.shape, np.float32) for k, v in init.items()
    }
    answers.append(list(outer_gradient_encoder(theta, init, _CODEC.value).chunks()))

  def round_(step: int) -> tuple[float, float, float]:
    opened, cpu = time.time(), time.process_time()
    core.open_round(shard, step)
    base = core.version(shard)
    for i, chunks in enumerate(answers):
      values = read_layout(chunks, wire_layout, codec_name=_CODEC.value, max_bytes=None, base=None)
      report = Report(
        learner_id=i,
        fragment=shard,
        values=values,
        tokens=1000,
        steps=2,
        anchor_version=base,
        step=step,
        round_step=step,
        outer_gradient=True,
      )
      status = core.report(report, copy=False).status
      if status != "accepted":
        raise RuntimeError(f"answer {i} was {status}")
    while not core.closer.poll():
      pass
    return opened, time.time(), time.process_time() - cpu

  # Warm-up: the merge's compile and the first allocations. Two rounds: the allocator's heap
  # reaches its size only in the second (one round of warm-up left the first timed round of one
  # whole 32 MiB group decoding into fresh pages, 0.47 s against 0.03 s in steady state).
  round_(2)
  round_(4)
  print(json.dumps({"ready": sum(layout.fragment_bytes(f) for f in [shard])}), flush=True)
  sys.stdin.readline()  # "go"
  opened, published, cpu = round_(6)
  print(json.dumps({"opened": opened, "published": published, "cpu": cpu}), flush=True)


def _round(shards: int) -> tuple[float, list[float], float]:
  """Runs one timed round on `shards` pinned shard processes; (round time, each shard's, the
  busiest shard's CPU seconds in it)."""
  argv = [a for a in sys.argv[1:] if not a.startswith(("--shard=", "--shards="))]
  procs = []
  for i in range(shards):
    cpu = _SHARD_CPUS.value[i % len(_SHARD_CPUS.value)]
    cmd = ["taskset", "-c", cpu, sys.executable, __file__, *argv, f"--shard={i}"]
    cmd.append(f"--shards={shards}")
    procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
  try:
    for p in procs:
      if "ready" not in json.loads(p.stdout.readline()):
        raise RuntimeError("a shard did not start")
    for p in procs:
      p.stdin.write("go\n")
      p.stdin.flush()
    times = [json.loads(p.stdout.readline()) for p in procs]
  finally:
    for p in procs:
      p.wait(timeout=120)
  start = min(t["opened"] for t in times)
  end = max(t["published"] for t in times)
  return end - start, [t["published"] - t["opened"] for t in times], max(t["cpu"] for t in times)


def main(argv):
  del argv
  if _SHARD.value >= 0:
    _shard_main()
    return
  print(
    f"one group of {_GROUP_MIB.value} MiB ({_LEAVES.value} leaves), M = {_LEARNERS.value} "
    f"{_CODEC.value} answers, shards pinned to CPUs {','.join(_SHARD_CPUS.value)}; "
    f"load {os.getloadavg()[0]:.2f}",
    flush=True,
  )
  rounds: dict[int, list[float]] = {1: [], 2: []}
  cpus: dict[int, list[float]] = {1: [], 2: []}
  for rep in range(_REPS.value):
    for shards in (1, 2):
      total, each, cpu = _round(shards)
      rounds[shards].append(total)
      cpus[shards].append(cpu)
      per = " ".join(f"{t:.3f}" for t in each)
      print(
        f"rep {rep} S={shards}: round {total:.3f} s (per shard {per}), busiest shard's CPU "
        f"{cpu:.3f} s",
        flush=True,
      )
  one, two = statistics.median(rounds[1]), statistics.median(rounds[2])
  print(f"median round: S=1 {one:.3f} s, S=2 {two:.3f} s; ratio S=2/S=1 {two / one:.2f}")
  ratios = [b / a for a, b in zip(rounds[1], rounds[2], strict=True)]
  print(f"per-rep ratios: {' '.join(f'{r:.2f}' for r in ratios)}")
  # The CPU seconds of the busiest shard: the round's critical path without the wait for a core
  # (on a loaded machine the wall time above is mostly that wait).
  one, two = statistics.median(cpus[1]), statistics.median(cpus[2])
  print(f"median busiest-shard CPU: S=1 {one:.3f} s, S=2 {two:.3f} s; ratio {two / one:.2f}")


if __name__ == "__main__":
  app.run(main)
