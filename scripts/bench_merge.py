"""Benchmark: the syncer merging 8 answers of a 16 MiB fragment against reading them once.

Everything runs in one process, interleaved in rounds so machine noise hits every row equally, and
the median of the rounds is reported. Each round opens the next round of one fragment of 4 tensors
of 1M float32 (16 MiB) (`SyncerCore.open_round`, untimed), files 8 answers to it (learners 0..7,
each registered and marked delivered, anchored at the round's base, so each weighs > 0) and times
`SyncerCore.closer.flush()`, i.e. one merge (docs/algorithm.md §4.3-4.7): the merge of the 8 outer
gradients, the optax outer step (Nesterov SGD, jitted), the new values, the digest of the new
version and its history entry. Answers carry their outer gradient δ_m, as learners send it
(`--uplink=delta`, the default), or θ_m, merged against the round's base (`--uplink=theta`).
RDA's first pass, the squared norms ‖v_m‖², is not in the merge: the core sums them when it files
each answer, in the same pass as the door's NaN/Inf check (`merge.finite_sq_norm`). Rows:
  read         the floor: one pass over the 8 × 16 MiB of answers, a float32 sum into one
               accumulator (`np.add(acc, v_m, out=acc)`). A sum rather than `np.copy`: any merge
               must read every answer once but need not write 8 copies, so a reduction is the
               least work a merge can do; a copy would also write 128 MiB and flatter the ratio.
  file         `SyncerCore.report` of the 8 answers: validation, the NaN/Inf check fused with the
               RDA norms, an aligned copy of each.
  fused        SyncerCore merging inside the outer step, one XLA program (`syncer/outer.py`; the
               default for fragments of at least `SyncerConfig.fused_merge_bytes`, 8 MiB), RDA
               (the default) and the mean.
  numpy        the numpy merge (`merge.merge_reports`, block by block into a reused buffer), then
               the jitted step (`fused_merge_bytes` above the fragment's size), RDA and the mean.
  rda + int4   the fused RDA merge in a `make_syncer` service with an int4 downlink codec: the
               merge plus `DownlinkAdopter` (encode Θ_new − Θ_old and, in the same pass, form
               what a learner holding Θ_old decodes from those bytes, the adopted values; then
               wrap the chunks in messages at publication, docs/algorithm.md §5). The service's
               public `stop(flush=True)` performs exactly that flush-and-publish; its merge
               thread is never started.
  int4 adopt   the adoption alone, timed directly: a fresh `DownlinkAdopter("int4")` called on the
               last merge's (Θ_new, Θ_old) and then `published`; it encodes a large fragment in
               two parts on two threads where the process may use two CPUs (as the service's),
               so it is also timed on one thread (`workers=1`).
The numpy merge's parts are also timed offline, with the functions the core calls:
`merge_reports` (RDA with the norms unknown, i.e. both passes, and the 8 norms on their own: the
pass filing does), RDA given the norms, the mean, the outer step as the core runs it, and
`blockwise.summarize` (the new version's digest, norm and check, one pass). Every row has a wall-clock median and a process-CPU-time median (the machine is shared:
CPU time is what contention with other processes spares; it sums all threads, so multithreaded
XLA can make it exceed wall time), each with its ratio to the read row's. It prints the
merge/read ratios against their goals (2x for the merges, 3x with int4 adoption); wall time is
the figure that counts when "process CPU/wall" in the header is near or above 1, i.e. the process
was not starved. Like `ddiloco-syncer`, the script pins one OpenBLAS thread (unless
OPENBLAS_NUM_THREADS is set): an idle OpenBLAS thread spins, and on a loaded machine the spinning
made the merge 80x the read. `--cpus=1` pins the process (XLA's threads included) to the CPUs
listed, e.g. one core of its own beside other work, where the read, single-threaded, and the
merge then get the same CPU.

  python scripts/bench_merge.py --tensors=4 --mib=16 --learners=8 --rounds=5 [--cpus=1]
"""

import os

os.environ.setdefault(
  "OPENBLAS_NUM_THREADS", "1"
)  # Before numpy loads OpenBLAS; see the docstring.

import statistics
import sys
import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ddiloco.service.downlink import DownlinkAdopter
from ddiloco.service.server import make_syncer
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer import blockwise, outer
from ddiloco.syncer import merge as merge_lib
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore
from ddiloco.syncer.merge_rules import RDA, WeightedMean

_TENSORS = flags.DEFINE_integer("tensors", 4, "tensors in the fragment")
_MIB = flags.DEFINE_integer("mib", 16, "fragment size in MiB (float32 values)")
_LEARNERS = flags.DEFINE_integer("learners", 8, "contributions per merge")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "timed rounds (median reported)")
_CPUS = flags.DEFINE_list("cpus", [], "pin the process to these CPUs (default: not pinned)")
_UPLINK = flags.DEFINE_enum(
  "uplink",
  "delta",
  ["delta", "theta"],
  "what each answer carries: its outer gradient δ = Θ^(base) − θ_m, as learners send it "
  "(the default), or θ_m, merged against the round's base",
)


class _Stopwatch:
  """Wall and process CPU seconds of a block (CPU time is not inflated by other processes)."""

  def __enter__(self) -> "_Stopwatch":
    self._wall, self._cpu = time.perf_counter(), time.process_time()
    return self

  def __exit__(self, *exc) -> None:
    self.seconds = (time.perf_counter() - self._wall, time.process_time() - self._cpu)


class _Clock:
  """A manual clock: the core reads time only from its clock, and nothing here needs it to move."""

  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


# The merge rules the bench times, by the name its rows print.
_RULES = {"rda": RDA(), "mean": WeightedMean()}


def _config(method: str, fused: bool) -> SyncerConfig:
  # No grace window: the round is due as soon as it has its quorum, and flush() merges it anyway.
  return SyncerConfig(
    use_grace=False, merge_rule=_RULES[method], fused_merge_bytes=0 if fused else 1 << 62
  )


class _Bench:
  """One syncer (core or service) fed one report per learner per round; `merge()` times a flush."""

  def __init__(
    self, init: dict[str, np.ndarray], method: str, downlink: str | None, *, fused: bool = True
  ):
    self._service = None
    if downlink is None:
      self.core = SyncerCore(
        fragment_keys=[sorted(init)],
        init_values=init,
        config=_config(method, fused),
        clock=_Clock(),
      )
    else:
      self._service = make_syncer(
        fragment_keys=[sorted(init)],
        init_values=init,
        syncer_config=_config(method, fused),
        service_config=ServiceConfig(uplink_codec="fp32", downlink_codec=downlink),
        layout_digest="bench-merge",
        clock=_Clock(),
      )
      self.core = self._service.core
    for m in range(_LEARNERS.value):
      self.core.register(m)
      self.core.mark_delivered(m, 0, 0)
    self._step = 0

  def file_reports(self, thetas: list[dict[str, np.ndarray]]) -> tuple[float, float]:
    """Opens the next round and files one answer per learner against its base; returns (wall,
    CPU) seconds of the filing."""
    self._step += 1
    if self.core.open_round(0, self._step) is None:
      raise RuntimeError("The previous round of fragment 0 is still open.")
    version = self.core.version(0)
    with _Stopwatch() as watch:
      self._file(thetas, version)
    return watch.seconds

  def _file(self, thetas: list[dict[str, np.ndarray]], version: int) -> None:
    for m, theta in enumerate(thetas):
      result = self.core.report(
        Report(
          learner_id=m,
          fragment=0,
          values=theta,
          outer_gradient=_UPLINK.value == "delta",
          tokens=4096
          * (m + 1),  # Unequal token weights (docs/algorithm.md §4.4): nothing cancels out.
          steps=24,
          anchor_version=version,
          step=self._step,
          round_step=self._step,
        )
      )
      if result.status != "accepted" or result.weight <= 0:
        raise RuntimeError(f"Report of learner {m} not filed with weight > 0: {result}")

  def merge(self) -> tuple[float, float]:
    """(wall, CPU) seconds of one merge of the open round (and, for a service, its publication)."""
    before = self.core.version(0)
    with _Stopwatch() as watch:
      if self._service is None:
        self.core.closer.flush()
      else:
        self._service.stop(flush=True)  # Merge + adopt + publish under the service's lock.
    if self.core.version(0) != before + 1:
      raise RuntimeError(f"Expected exactly one merge, got {self.core.version(0) - before}.")
    return watch.seconds


def _read_once(thetas: list[dict[str, np.ndarray]]) -> tuple[float, float]:
  with _Stopwatch() as watch:
    for k in thetas[0]:
      acc = thetas[0][k].copy()
      for theta in thetas[1:]:
        np.add(acc, theta[k], out=acc)
  return watch.seconds


def _adopt_int4(bench: _Bench, workers: int | None = None) -> tuple[float, float]:
  """(wall, CPU) of int4 adoption of the bench's last merge: encode, decode, adopt, chunk, on
  `workers` threads (None: the service's default)."""
  cur = bench.core.state(0)
  prev = bench.core.state_at(0, cur.version - 1)
  cfg = ServiceConfig()
  kwargs = {"block_size": cfg.block_size, "chunk_size": cfg.max_chunk_bytes}
  try:
    adopter = DownlinkAdopter("int4", **kwargs, workers=workers)
  except TypeError:  # An adopter without threads (older code, timed side by side): one thread.
    adopter = DownlinkAdopter("int4", **kwargs)
  with _Stopwatch() as watch:
    adopter(0, cur.values, prev.values)
    adopter.published(0, cur.version, cur.digest)
  if adopter.delta_chunks(0, cur.version) is None:
    raise RuntimeError("The adopter cached no chunks.")
  return watch.seconds


class _OuterStep:
  """The core's outer step (`outer.OuterStep.step`, docs/algorithm.md §4.6), with its state."""

  def __init__(self, init: dict[str, np.ndarray]):
    self._step = outer.OuterStep(SyncerConfig().outer_optimizer(), dict.fromkeys(init, 1e37))
    self._state = self._step.init({k: jnp.asarray(v) for k, v in init.items()})
    # The state each step replaces holds the next one (donated, as the syncer does); the new
    # values are returned as views, so they get fresh memory.
    self._spare = self._step.spare(None, self._state)

  def __call__(self, theta: dict[str, np.ndarray], merged: dict[str, np.ndarray]) -> dict:
    old = self._state
    ones = dict.fromkeys(merged, 1.0)
    new, self._state, _ = self._step.step(theta, merged, ones, old, self._spare)
    self._spare = (None, old)
    return {k: np.asarray(v) for k, v in new.items()}


def _parts(
  anchor: dict[str, np.ndarray], thetas: list[dict[str, np.ndarray]], outer_step: _OuterStep
) -> dict[str, tuple[float, float]]:
  """(wall, CPU) of the merge's main parts, timed offline with the functions the core calls."""
  weights = [float(m + 1) for m in range(len(thetas))]
  delta = _UPLINK.value == "delta"
  anchors = [None if delta else anchor] * len(thetas)
  # One merge output alive at a time: a third 16 MiB buffer is fresh memory, and on this VM the
  # first touch of fresh memory costs more than the merge itself (~40 ms per 16 MiB measured).
  with _Stopwatch() as rda_watch:
    merged = merge_lib.merge_reports(anchors, thetas, weights, rule=RDA())
  with _Stopwatch() as digest_watch:
    blockwise.summarize(merged)
  with _Stopwatch() as step_watch:
    outer_step(anchor, merged)
  del merged
  with _Stopwatch() as norms_watch:
    norms = [
      {k: merge_lib.finite_sq_norm(None if delta else anchor[k], v) for k, v in theta.items()}
      for theta in thetas
    ]
  with _Stopwatch() as rda_known_watch:
    merge_lib.merge_reports(anchors, thetas, weights, rule=RDA(), sq_norms=norms)
  with _Stopwatch() as mean_watch:
    merge_lib.merge_reports(anchors, thetas, weights, rule=WeightedMean())
  return {
    "rda alone": rda_watch.seconds,
    "norms": norms_watch.seconds,
    "rda known": rda_known_watch.seconds,
    "mean alone": mean_watch.seconds,
    "digest": digest_watch.seconds,
    "step": step_watch.seconds,
  }


def main(argv: list[str]) -> None:
  del argv
  if _CPUS.value:
    os.sched_setaffinity(0, {int(c) for c in _CPUS.value})
  n = _MIB.value * (1 << 20) // 4 // _TENSORS.value
  side = round(n**0.5)
  shape = (side, n // side) if side * (n // side) == n else (n,)
  rng = np.random.default_rng(0)
  init = {
    f"tensor_{i}": rng.standard_normal(shape, dtype=np.float32) for i in range(_TENSORS.value)
  }
  benches = {
    "rda merge": _Bench(init, "rda", None),
    "mean merge": _Bench(init, "mean", None),
    "rda numpy": _Bench(init, "rda", None, fused=False),
    "mean numpy": _Bench(init, "mean", None, fused=False),
    "rda + int4 adopt": _Bench(init, "rda", "int4"),
  }

  def contributions(bench: _Bench) -> list[dict[str, np.ndarray]]:
    # δ_m: a small, learner-specific outer gradient, as after a period of inner steps; θ_m = Θ − δ_m.
    cur = bench.core.state(0).values
    deltas = [
      {k: np.float32(1e-2) * rng.standard_normal(shape, dtype=np.float32) for k in cur}
      for _ in range(_LEARNERS.value)
    ]
    if _UPLINK.value == "delta":
      return deltas
    return [{k: cur[k] - d[k] for k in cur} for d in deltas]

  outer_step = _OuterStep(init)
  outer_step(init, {k: np.zeros_like(v) for k, v in init.items()})  # Warm-up: the jit.
  times: dict[str, list[tuple[float, float]]] = {
    "read": [],
    "file 8 reports": [],
    "adopt": [],
    "adopt 1": [],
  }
  times.update({name: [] for name in benches})
  for bench in benches.values():  # Warm-up: jit of the outer step, allocator.
    bench.file_reports(contributions(bench))
    bench.merge()
  with _Stopwatch() as total:
    for _ in range(_ROUNDS.value):
      for name, bench in benches.items():
        thetas = contributions(bench)
        filed = bench.file_reports(thetas)
        if name == "rda merge":
          times["file 8 reports"].append(filed)
          times["read"].append(_read_once(thetas))
          for part, t in _parts(bench.core.state(0).values, thetas, outer_step).items():
            times.setdefault(part, []).append(t)
        times[name].append(bench.merge())
        if name == "rda merge":
          times["adopt"].append(_adopt_int4(bench))
          times["adopt 1"].append(_adopt_int4(bench, workers=1))

  # Medians of wall and of CPU time, each taken separately.
  med = {k: tuple(statistics.median(t[i] for t in v) for i in (0, 1)) for k, v in times.items()}
  total_mib = _LEARNERS.value * _MIB.value
  print(
    f"fragment: {_TENSORS.value} tensors x {shape} float32 = {_MIB.value} MiB; "
    f"{_LEARNERS.value} contributions ({total_mib} MiB); {_ROUNDS.value} rounds (median); "
    f"load avg {os.getloadavg()[0]:.1f}, process CPU/wall {total.seconds[1] / total.seconds[0]:.2f}"
    f"{', CPUs ' + ','.join(_CPUS.value) if _CPUS.value else ''}"
  )
  print(f"  {'row':40s} {'wall ms':>8s} {'cpu ms':>8s} {'/read':>7s} {'/read':>6s}")
  rows = [
    ("read once (float32 sum of 8 arrays)", "read"),
    ("file 8 reports (+ norms; not in merges)", "file 8 reports"),
    ("RDA merge (RoundCloser.flush, fused)", "rda merge"),
    ("mean merge (RoundCloser.flush, fused)", "mean merge"),
    ("RDA merge (numpy merge, then step)", "rda numpy"),
    ("mean merge (numpy merge, then step)", "mean numpy"),
    ("RDA merge + int4 adoption (make_syncer)", "rda + int4 adopt"),
    ("int4 adoption alone (DownlinkAdopter)", "adopt"),
    ("  the same on one thread", "adopt 1"),
    ("parts, offline: rda, norms unknown", "rda alone"),
    ("  1st pass, norms x 8 (now at filing)", "norms"),
    ("  rda, norms given (2nd pass: flush)", "rda known"),
    ("  merge_reports mean", "mean alone"),
    ("  outer step (views in, jit, view out)", "step"),
    ("  summarize: digest, norm, check", "digest"),
  ]
  read = med["read"]
  for label, key in rows:
    wall, cpu = med[key]
    print(
      f"  {label:40s} {1e3 * wall:8.1f} {1e3 * cpu:8.1f} {wall / read[0]:7.2f} {cpu / read[1]:6.2f}"
    )
  for label, key, goal in (
    ("RDA merge", "rda merge", 2),
    ("mean merge", "mean merge", 2),
    ("RDA merge + int4 adoption", "rda + int4 adopt", 3),
  ):
    ratio_wall, ratio_cpu = (med[key][i] / read[i] for i in (0, 1))
    print(f"  {label} / read = {ratio_wall:.2f}x wall, {ratio_cpu:.2f}x cpu   (goal <= {goal}x)")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
