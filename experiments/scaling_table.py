"""The DiLoCo scaling table at this machine's scale: data-parallel against DiLoCo with M learners.

The tiny model (1.1M parameters, byte tokens) trains for 5,760 steps of a global batch of 32
sequences of 64 tokens: 11.8M tokens, about 10.6 tokens per parameter, and 192 outer steps per
fragment at H = 30. Every row trains the same tokens with the same inner AdamW (peak lr 3e-3, the
run files'; not tuned per M) and the global batch split as B / M, and is scored on one held-out
set of 512 windows (16 batches of 32, fixed whatever the learners' batches).

Rows:
1. **Data-parallel**: one learner with the whole batch.
2. **DiLoCo** (synchronous, P = 1, K = M, mean merge) with M in {1, 2, 4, 8}: outer SGD with
   Nesterov momentum 0.9, its learning rate searched on the grid 0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.4
   (seed 0): two neighbours first, then one step at a time towards the lower loss until a step
   is worse.
3. **Momentum warm-up**: DiLoCo at every M with its best outer lr and the momentum ramped
   from 0 to 0.9 over the first 20 outer steps, the learning rate brought from 0.7 down to the
   best over the same steps (`nesterov_warmup`, the shipped form, which short runs need:
   experiments/short_horizon.py), against the same rows without it (seed 0).
4. **Streaming DiLoCo** (synchronous, P = H = 30, τ = 2, K = M, weighted mean) and **Decoupled
   DiLoCo** (P = H = 30, τ = 2, K = 1 + grace, token weights, learner 1 down for 300 s) at M = 4
   and M = 8, with the best DiLoCo outer lr of their M and the warm-up of 3. The Decoupled rows
   run α = 0 and α = 0.5 with RDA (seed 0); the better α (mean over M = 4 and 8) is the one both
   methods then run. What Decoupled DiLoCo's gap to Streaming is made of (M = 4, seed 0): rows
   without the crash, and with the weighted mean in place of RDA. The weighted mean, which
   closed the gap, is the shipped rule: the final Decoupled rows merge by it, every seed, and
   the other α runs with it too (M = 4, seed 0), to check that α's choice holds for it.
5. Seeds 1 and 2 of data-parallel, of each M's DiLoCo row (at its best outer lr, plain or with the
   warm-up of 3, whichever is lower on seed 0), and of the rows of 4.

Runs go one per core (`--workers`, each pinned to its own core), in the order above, the sweeps
of M = 4 and 1 (the headline's) before those of 8 and 2; a run's result is stored as soon as it ends, with the commit, date and machine, so an
interrupted study resumes where it stopped. Writes docs/results/scaling_table.{md,png,json}.

  python experiments/scaling_table.py            # runs what is missing, then reports
  python experiments/scaling_table.py --tier=report
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import contextlib
import dataclasses
import datetime
import itertools
import json
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from absl import app, flags

from ddiloco.launch import cli

from studylib import study

_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table, plot and JSON")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/scaling_table", "run outputs")
_TIER = flags.DEFINE_enum(
  "tier",
  "all",
  ["all", "report", "device", "device_report"],
  "run what is missing, only report, run the final rows on this machine's accelerator "
  "(their settings chosen by --sweep_store's seed-0 sweep), or report such a run's store "
  "(--device_store)",
)
_DEVICE_STORE = flags.DEFINE_string(
  "device_store",
  "docs/results/scaling_table_h200.json",
  "device_report: the store of a --tier=device run (its --out's scaling_table.json, kept here)",
)
_SWEEP_STORE = flags.DEFINE_string(
  "sweep_store",
  "docs/results/scaling_table.json",
  "device tier: the study whose seed-0 sweep chooses each M's row",
)
_START_UNTIL = flags.DEFINE_float(
  "start_until_s", 0.0, "start no run after this many seconds of the driver (0: no limit)"
)
_STOP_AT = flags.DEFINE_float(
  "stop_at_s", 0.0, "kill the runs still going and stop after this many seconds (0: no limit)"
)
_WORKERS = flags.DEFINE_integer("workers", 2, "runs at once, each pinned to its own core")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of the final rows")
# One run, in a child process (the driver's): the system's name, its seed, where its result goes.
_RUN = flags.DEFINE_string("run", None, "internal: run this system")
_SEED = flags.DEFINE_integer("seed", 0, "internal: the run's seed")
_RESULT = flags.DEFINE_string("result", None, "internal: where the run's result goes")

STUDY = "scaling_table"
PERIOD = 30  # H.
OUTER_STEPS = 192
STEPS = PERIOD * OUTER_STEPS
GLOBAL_BATCH = 32
SEQ_LEN = 64
FRAGMENTS = 30  # P = H for the streaming rows.
MS = (1, 2, 4, 8)
MOMENTUM = 0.9
# Outer learning rates (seed 0): each M starts from two neighbours on this grid (the best one
# grows with M in the scaling-law study) and walks the grid towards the lower loss until a value
# is worse than the best so far, so a sweep costs three or four runs, not the grid's seven.
GRID = (0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.4)
START = {1: (0.2, 0.4), 2: (0.4, 0.7), 4: (0.4, 0.7), 8: (0.4, 0.7)}
ALPHAS = (0.0, 0.5)
# The streaming rows' outer optimizer: Nesterov with its momentum ramped over this many outer
# steps (`ddiloco.syncer.outer_optimizers.nesterov_warmup`), checked against plain Nesterov at
# M = 4 and 8 in the DiLoCo rows.
WARMUP = 20
# With fewer outer steps than the warm-up, the best learning rate is higher (0.7 at 4 and 10 outer
# steps: experiments/short_horizon.py) than with hundreds: the warm-up rows bring it down from
# here to their M's best over the same outer steps.
WARMUP_LR0 = 0.7
STREAMING_MS = (4, 8)
CRASH = "crash:1@2000+300"
# At this M the gap of Decoupled DiLoCo to Streaming DiLoCo is split into its parts: the protocol
# (K = 1 + grace, learners that never wait), the merge rule (RDA against the weighted mean) and
# the crash, by Decoupled rows without the crash and with the weighted mean.
DIAGNOSED_M = 4
# (crash, weighted mean in place of RDA) of the Decoupled rows that split the gap, on seed 0;
# with one crash and the weighted mean, the final row (every seed).
DIAGNOSES = ((False, False), (False, True))

# Every setting a row depends on is bound here, not left to the run files' defaults, so that a
# stored row stays the run it names when a default changes.
COMMON = (
  f"STEPS = {STEPS}",
  f"SEQ_LEN = {SEQ_LEN}",
  f"DP_BATCH = {GLOBAL_BATCH}",
  f"transformer_config.max_len = {SEQ_LEN}",
  "RunConfig.eval_batches = 16",
  "RunConfig.eval_batch_size = 32",
  "RunConfig.eval_every_s = 240.0",
  "RunConfig.log_every = 48",
  "ClusterConfig.devices_per_learner = 1",
  "ClusterConfig.step_time_s = 1.0",
  "InnerOptConfig.peak_lr = 3e-3",
  "InnerOptConfig.warmup_steps = 20",
  "InnerOptConfig.final_lr_ratio = 0.1",
)


def _outer(lr: float, warmup: int = 0, lr0: float | None = None) -> tuple[str, ...]:
  """Nesterov SGD (the literature's), or with its momentum ramped over `warmup` outer steps
  (and its learning rate brought down from `lr0` to `lr` over the same steps)."""
  if warmup:
    return (
      "SyncerConfig.outer_optimizer = @outer/nesterov_warmup",
      f"outer/nesterov_warmup.learning_rate = {lr}",
      f"outer/nesterov_warmup.momentum = {MOMENTUM}",
      f"outer/nesterov_warmup.warmup_steps = {warmup}",
      *([f"outer/nesterov_warmup.initial_learning_rate = {lr0}"] if lr0 is not None else []),
    )
  return (
    "SyncerConfig.outer_optimizer = @outer/optax.sgd",
    f"outer/optax.sgd.learning_rate = {lr}",
    f"outer/optax.sgd.momentum = {MOMENTUM}",
    "outer/optax.sgd.nesterov = True",
  )


def _lr0(lr: float) -> float | None:
  """Where the warm-up's learning rate starts: the short horizons' best, when above `lr`."""
  return WARMUP_LR0 if lr < WARMUP_LR0 else None


def _warm_name(lr: float) -> str:
  lr0 = _lr0(lr)
  return f"momentum warm-up {WARMUP}" + (f" and lr from {lr0}" if lr0 is not None else "")


def _fleet(m: int) -> tuple[str, ...]:
  return (f"LEARNERS = {m}", f"BATCH = {GLOBAL_BATCH // m}")


def data_parallel() -> study.System:
  return study.System(
    name="data-parallel",
    gin_files=("sim_tiny.gin", "baselines/data_parallel.gin"),
    bindings=(*COMMON, *_fleet(1), "ClusterConfig.faults = ()"),
  )


def diloco(m: int, lr: float, warmup: int = 0) -> study.System:
  return study.System(
    name=f"DiLoCo M={m}, outer lr {lr}" + (f", {_warm_name(lr)}" if warmup else ""),
    gin_files=("sim_tiny.gin", "baselines/diloco.gin"),
    bindings=(
      *COMMON,
      *_fleet(m),
      f"FragmentSchedule.period = {PERIOD}",
      *_outer(lr, warmup, _lr0(lr) if warmup else None),
    ),
  )


def _streamed(m: int, lr: float, alpha: float) -> tuple[str, ...]:
  return (
    *COMMON,
    *_fleet(m),
    'RunConfig.layout_strategy = "balanced"',
    f"FragmentSchedule.num_fragments = {FRAGMENTS}",
    f"FragmentSchedule.period = {PERIOD}",
    "FragmentSchedule.overlap = 2",
    *_outer(lr, WARMUP, _lr0(lr)),
    f"LearnerConfig.mixing_alpha = {alpha}",
  )


def streaming(m: int, lr: float, alpha: float) -> study.System:
  return study.System(
    name=f"Streaming DiLoCo M={m}, outer lr {lr}, {_warm_name(lr)}, alpha {alpha}",
    gin_files=("sim_tiny.gin", "baselines/streaming_diloco.gin"),
    bindings=_streamed(m, lr, alpha),
  )


def decoupled(
  m: int, lr: float, alpha: float, crash: bool = True, mean: bool = False
) -> study.System:
  """Decoupled DiLoCo (K = 1 + grace) with one learner crash, merged by RDA or (`mean`) by the
  weighted mean, the shipped rule; without the crash (`crash` False) for what its gap to
  Streaming DiLoCo is made of. The rule is bound either way: RDA was the default when the RDA
  rows ran."""
  return study.System(
    name=f"Decoupled DiLoCo M={m}, outer lr {lr}, {_warm_name(lr)}, alpha {alpha}, "
    + ("1 crash" if crash else "no crash")
    + (", weighted mean" if mean else ""),
    gin_files=("sim_tiny.gin",),
    bindings=(
      *_streamed(m, lr, alpha),
      f'FAULTS = ("{CRASH}",)' if crash else "FAULTS = ()",
      f"SyncerConfig.merge_rule = @{'WeightedMean' if mean else 'RDA'}()",
    ),
  )


# -- the plan ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
  """What to run next given what is stored: jobs ready now, and whether more will follow."""

  ready: list[tuple[study.System, int]]
  waiting: bool  # Some jobs wait for results not stored yet.


def _loss(store: study.ResultStore, system: study.System, seed: int) -> float | None:
  r = store.get(system, seed)
  return None if r is None else r["final_eval_loss"]


def sweep_of(store: study.ResultStore, m: int) -> list[float]:
  """M's outer learning rates so far: the two starting values, then one grid step at a time
  past whichever edge is best, until the best is inside the values run (or at the grid's end)."""
  lrs = list(START[m])
  while True:
    losses = {lr: _loss(store, diloco(m, lr), 0) for lr in lrs}
    if any(v is None for v in losses.values()):
      return lrs
    best = min(lrs, key=lambda lr: losses[lr])
    i = GRID.index(best)
    if best == min(lrs) and i > 0:
      lrs.insert(0, GRID[i - 1])
    elif best == max(lrs) and i < len(GRID) - 1:
      lrs.append(GRID[i + 1])
    else:
      return lrs


def best_lr(store: study.ResultStore, m: int) -> float | None:
  """M's best outer lr on seed 0, once its sweep (and any extension) is stored."""
  lrs = sweep_of(store, m)
  losses = {lr: _loss(store, diloco(m, lr), 0) for lr in lrs}
  if any(v is None for v in losses.values()):
    return None
  return min(lrs, key=lambda lr: losses[lr])


def best_diloco(store: study.ResultStore, m: int) -> tuple[str, study.System] | None:
  """M's DiLoCo row for the table: at M's best outer lr, plain Nesterov or its warm-up (the
  shipped form), whichever has the lower seed-0 loss; (its outer lr's label, its system)."""
  lr = best_lr(store, m)
  if lr is None:
    return None
  plain, warm = diloco(m, lr), diloco(m, lr, WARMUP)
  warm_loss = _loss(store, warm, 0)
  if warm_loss is None:
    return None
  if warm_loss < _loss(store, plain, 0):
    lr0 = _lr0(lr)
    return f"{lr}, warm-up" + (f" from {lr0}" if lr0 is not None else ""), warm
  return f"{lr}", plain


def best_alpha(store: study.ResultStore) -> float | None:
  """The α of the lower mean seed-0 loss of the Decoupled rows over M = 4 and 8."""
  means = {}
  for alpha in ALPHAS:
    losses = []
    for m in STREAMING_MS:
      lr = best_lr(store, m)
      loss = None if lr is None else _loss(store, decoupled(m, lr, alpha), 0)
      if loss is None:
        return None
      losses.append(loss)
    means[alpha] = sum(losses) / len(losses)
  return min(ALPHAS, key=lambda a: means[a])


def plan(store: study.ResultStore, seeds: list[int]) -> Plan:
  """The jobs of the study in order (the module docstring's), those whose inputs are known."""
  jobs: list[tuple[study.System, int]] = []
  waiting = False
  first, rest = seeds[0], seeds[1:]
  jobs.append((data_parallel(), first))
  for m in (4, 1, 8, 2):  # The headline's M = 4 and 1 first; the streaming rows need 4 and 8.
    jobs += [(diloco(m, lr), first) for lr in sweep_of(store, m)]
    if (lr := best_lr(store, m)) is not None:
      jobs.append((diloco(m, lr, WARMUP), first))  # The shipped form, at M's best lr.
  for m in STREAMING_MS:
    lr = best_lr(store, m)
    if lr is None:
      waiting = True
      continue
    jobs += [(decoupled(m, lr, alpha), first) for alpha in ALPHAS]
  alpha = best_alpha(store)
  lr = best_lr(store, DIAGNOSED_M)
  if lr is not None and alpha is not None:  # What the gap to Streaming is made of.
    jobs += [(decoupled(DIAGNOSED_M, lr, alpha, c, w), first) for c, w in DIAGNOSES]
    # α was chosen on RDA rows: the other α with the shipped rule, against the chosen one.
    jobs += [(decoupled(DIAGNOSED_M, lr, a, mean=True), first) for a in ALPHAS if a != alpha]
  for m in STREAMING_MS:
    lr = best_lr(store, m)
    if lr is None or alpha is None:
      waiting = True
      continue
    for s in seeds:  # Seed by seed, so that each pair is complete as soon as can be.
      jobs += [(streaming(m, lr, alpha), s), (decoupled(m, lr, alpha, mean=True), s)]
  jobs += [(data_parallel(), s) for s in rest]
  for m in MS:
    best = best_diloco(store, m)
    if best is None:
      waiting = True
      continue
    jobs += [(best[1], s) for s in rest]
  ready = [(sys_, s) for sys_, s in dict.fromkeys(jobs) if store.get(sys_, s) is None]
  return Plan(ready=ready, waiting=waiting)


def device_plan(sweeps: study.ResultStore, store: study.ResultStore, seeds: list[int]) -> Plan:
  """The final DiLoCo rows and data-parallel over every seed, on an accelerator host.

  Each M's row is the one `sweeps` (this study's store on the CPU) chose on seed 0: its best outer
  lr, plain or with the warm-up. Every seed, seed 0 included, runs again here so that each pair of
  the table's gaps comes from one backend; the M with no finished sweep are left out. Jobs go
  seed by seed, the longest (largest M) first, so that runs cut short by the host's time limit
  cost the fewest complete seeds. Streaming and Decoupled DiLoCo at M = 4 and 8 (both α) follow,
  for what time is left.
  """
  jobs = []
  for seed in seeds:
    for m in sorted(MS, reverse=True):
      if (best := best_diloco(sweeps, m)) is not None:
        jobs.append((best[1], seed))
    jobs.append((data_parallel(), seed))
  # Then, while the host's time lasts, Streaming and Decoupled DiLoCo (both α) seed by seed.
  for m in STREAMING_MS:
    if (lr := best_lr(sweeps, m)) is None:
      continue
    for seed in seeds:
      for alpha in ALPHAS:
        jobs += [(decoupled(m, lr, alpha, mean=True), seed), (streaming(m, lr, alpha), seed)]
  return Plan(ready=[(s, seed) for s, seed in jobs if store.get(s, seed) is None], waiting=False)


def all_systems(store: study.ResultStore) -> Iterator[study.System]:
  """Every system the study may run (for looking one up by name)."""
  yield data_parallel()
  for m in MS:
    for lr in GRID:
      yield diloco(m, lr)
      yield diloco(m, lr, WARMUP)
      for alpha in ALPHAS:
        yield streaming(m, lr, alpha)
        yield decoupled(m, lr, alpha)
        for crash, mean in (*DIAGNOSES, (True, True)):
          yield decoupled(m, lr, alpha, crash, mean)


# -- running ----------------------------------------------------------------------------------------


def provenance() -> dict[str, str]:
  """The commit, date and machine a result was measured on."""
  try:
    commit = subprocess.run(
      ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--", "ddiloco"],
      capture_output=True,
      text=True,
      timeout=10,
      check=False,
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    # A copy of the tree without its history (an accelerator host): the commit it was made from.
    commit, dirty = os.environ.get("DDILOCO_COMMIT", "unknown"), ""
  machine = f"{_cpu_model()}, {os.cpu_count()} cores, {platform.machine()}"
  import jax

  if jax.default_backend() != "cpu":
    machine += f", {jax.devices()[0].device_kind}"
  return {
    "commit": commit + ("+changes" if dirty else ""),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine,
  }


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def _store(path: str) -> study.ResultStore:
  """The results at `path`: a row counts while the configuration it resolves to is unchanged."""
  from ddiloco.launch import configurables

  return study.ResultStore(path, resolve=configurables.resolved_config)


def run_one(name: str, seed: int, result_path: str) -> None:
  """Runs one system in this process and writes its result (a child of the driver)."""
  from ddiloco.launch import configurables

  store = _store(os.path.join(_OUT.value, f"{STUDY}.json"))
  system = next(s for s in all_systems(store) if s.name == name)
  study.enable_compilation_cache("workdirs/jax_cache")
  result = study.run_system(
    system,
    seed=seed,
    workdir=os.path.join(_WORKDIR.value, study.slug(system.name), f"seed_{seed}"),
    simulate_files=configurables.simulate_files,
    progress=lambda line: print(line, flush=True),
    resolve=configurables.resolved_config,
  )
  result.update(provenance())
  tmp = result_path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f, default=str)
  os.replace(tmp, result_path)


class _Adopted:
  """A run started by an earlier driver, still running: polled through /proc like a Popen."""

  def __init__(self, pid: int):
    self.pid = pid
    self.returncode: int | None = None

  def poll(self) -> int | None:
    if self.returncode is None and not os.path.exists(f"/proc/{self.pid}"):
      self.returncode = 0  # Its result file tells whether it succeeded.
    return self.returncode


def _running_children() -> list[tuple[int, str, int, str, int]]:
  """(pid, system name, seed, result path, core) of runs of this study still running."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    except OSError:
      continue
    if not any(a.endswith("scaling_table.py") for a in argv) or "--seed=" not in " ".join(argv):
      continue
    args = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    # Only this driver's study (its --out): another study's runs are not ours to adopt or kill.
    if "run" in args and "python" in os.path.basename(argv[0]) and args.get("out") == _OUT.value:
      core = min(os.sched_getaffinity(int(entry)))
      out.append((int(entry), args["run"], int(args["seed"]), args["result"], core))
  return out


def _result_path(system: study.System, seed: int) -> str:
  return os.path.join(_WORKDIR.value, study.slug(system.name), f"seed_{seed}") + ".result.json"


def _collect_finished(
  store_path: str, plan_of: Callable[[study.ResultStore], Plan], running: set[tuple[str, int]]
) -> None:
  """Stores the results of runs that ended while no driver watched them (their result files),
  rather than running them again."""
  while True:
    store = _store(store_path)
    found = []
    for system, seed in plan_of(store).ready:
      path = _result_path(system, seed)
      if (system.name, seed) in running or not os.path.exists(path):
        continue
      try:
        with open(path) as f:
          result = json.load(f)
      except (OSError, ValueError):
        continue  # Cut short while it was written: the run goes again.
      if store.current(system, seed, result):  # Not one run with another configuration.
        found.append((system, seed, result))
    if not found:
      return
    for system, seed, result in found:
      store.put(system, seed, result)
      print(f"[{system.name} seed {seed}] eval {result['final_eval_loss']:.4f} (found)", flush=True)


def drive(seeds: list[int], plan_of: Callable[[study.ResultStore], Plan] | None = None) -> None:
  """Runs the plan's ready jobs, `--workers` at a time, each pinned to a core, until none is left.

  `plan_of` gives the jobs from the stored results (default: the study's `plan`).
  `--start_until_s` and `--stop_at_s` fit the study in a time slot: no run starts after the first
  and the runs still going are killed at the second (their results are lost, the others kept).

  Each run is a child in a session of its own at normal priority, so that the kernel's
  per-session fair share gives the study its own share beside other work on the machine. Runs
  left by an earlier driver are adopted, not started again, and the results of runs that ended
  while no driver watched are stored, not run again.
  """
  plan_of = plan_of or (lambda store: plan(store, seeds))
  store_path = os.path.join(_OUT.value, f"{STUDY}.json")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  cores = sorted(os.sched_getaffinity(0))
  started = time.monotonic()
  slots: dict[int, tuple] = {}
  store = _store(store_path)
  by_name = {s.name: s for s in all_systems(store)}
  for pid, name, seed, path, core in _running_children():
    slots[core] = (_Adopted(pid), by_name[name], seed, path, time.time())
    print(f"[{name} seed {seed}] adopted (pid {pid}, core {core})", flush=True)
  _collect_finished(store_path, plan_of, {(s.name, seed) for _, s, seed, _, _ in slots.values()})
  failed: set[tuple[str, int]] = set()  # Not offered again by this driver: a rerun retries them.
  while True:
    store = _store(store_path)
    for core, (proc, system, seed, path, t0) in list(slots.items()):
      if proc.poll() is None:
        continue
      del slots[core]
      if proc.returncode == 0 and os.path.exists(path):
        with open(path) as f:
          result = json.load(f)
        store.put(system, seed, result)
        print(
          f"[{system.name} seed {seed}] eval {result['final_eval_loss']:.4f} "
          f"({(time.time() - t0) / 60:.0f} min)",
          flush=True,
        )
        if not store.current(system, seed, result):
          # Its configuration changed while it ran (or an older driver's code started it): kept,
          # and not run again by this driver; the next one runs it unless it is signed.
          failed.add((system.name, seed))
          print(f"[{system.name} seed {seed}] not signed with today's configuration", flush=True)
      else:
        failed.add((system.name, seed))
        print(f"[{system.name} seed {seed}] FAILED (exit {proc.returncode})", flush=True)
    running = {(s.name, seed) for _, s, seed, _, _ in slots.values()} | failed
    todo = plan_of(store)
    ready = [(s, seed) for s, seed in todo.ready if (s.name, seed) not in running]
    elapsed = time.monotonic() - started
    if _STOP_AT.value and elapsed > _STOP_AT.value:
      for proc, system, seed, _, _ in slots.values():
        _kill_session(proc.pid)
        if isinstance(proc, subprocess.Popen):
          proc.wait(timeout=30)
        print(f"[{system.name} seed {seed}] killed at the time limit", flush=True)
      return
    if _START_UNTIL.value and elapsed > _START_UNTIL.value:
      ready = []
    free = [c for c in cores if c not in slots][: max(0, _WORKERS.value - len(slots))]
    for core, (system, seed) in zip(free, ready):
      path = _result_path(system, seed)
      folder = path.removesuffix(".result.json")
      os.makedirs(os.path.dirname(folder), exist_ok=True)
      if os.path.exists(path):
        os.remove(path)
      log = open(folder + ".log", "w")  # noqa: SIM115 - the child's, closed with it.
      cmd = [
        "taskset",
        "-c",
        str(core),
        sys.executable,
        os.path.abspath(__file__),
        f"--run={system.name}",
        f"--seed={seed}",
        f"--result={path}",
        f"--out={_OUT.value}",
        f"--workdir={_WORKDIR.value}",
      ]
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
      log.close()
      _share_priority(proc.pid)
      slots[core] = (proc, system, seed, path, time.time())
      print(f"[{system.name} seed {seed}] started on core {core}", flush=True)
    if not slots and not ready:
      if todo.waiting or failed:
        print(f"stopping: {len(failed)} runs failed; rows that need them were not run", flush=True)
      return
    time.sleep(10 if not _STOP_AT.value else 1)


def _autogroup_nice(pid: int | str = "self", proc: str = "/proc") -> int | None:
  """The nice value of a process's scheduler autogroup (Linux), or None where there is none."""
  try:
    with open(f"{proc}/{pid}/autogroup") as f:
      return int(f.read().split()[-1])
  except (OSError, ValueError, IndexError):
    return None


def _share_priority(pid: int, proc: str = "/proc") -> None:
  """Gives a run the driver's autogroup nice. A run leads a session of its own (so that it outlives
  the driver), and with it an autogroup of its own at nice 0: without this, a study started at
  idle priority (`echo 19 > /proc/self/autogroup`) would run its children at the normal one."""
  nice = _autogroup_nice(proc=proc)
  if nice:
    with contextlib.suppress(OSError), open(f"{proc}/{pid}/autogroup", "w") as f:
      f.write(str(nice))


def _kill_session(pid: int) -> None:
  """Kills a run and whatever it started (it leads a session of its own)."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(pid, signal.SIGKILL)


# The literature this table is read against (DiLoCo scaling laws, Charles et al. 2025, Table 4):
# eval loss gaps to data-parallel at 35M parameters, the per-M power-law fits extrapolated to this
# model's 1.1M parameters, and this table's goal (the extrapolation plus one point).
PAPER_35M = {1: -0.1, 2: 0.7, 4: 2.0, 8: 3.9}
FIT_1M = {1: 0.2, 2: 1.3, 4: 3.3, 8: 6.1}
GOAL = {m: FIT_1M[m] + 1.0 for m in MS} | {1: 0.5}
STREAMING_GOAL = 0.5  # Decoupled DiLoCo against Streaming DiLoCo at the same M, in %.


def _losses(store: study.ResultStore, system: study.System, seeds: list[int]) -> dict[int, float]:
  return {s: r["final_eval_loss"] for s in seeds if (r := store.get(system, s))}


def _cell(values: dict[int, float]) -> str:
  return study.mean_ci(list(values.values())).format(4) if values else "–"


def _gap(values: dict[int, float], reference: dict[int, float]) -> study.Interval:
  return study.paired_relative_ci(values, reference)


def _fmt(gap: study.Interval) -> str:
  return gap.format(2, scale=100, unit=" %") if gap.n else "–"


def _met(gap: study.Interval, goal: float) -> str:
  if not gap.n:
    return "–"
  return "yes" if 100 * gap.mean <= goal else "no"


def _at_tokens(curve: list, tokens: float) -> float | None:
  """The eval loss of a curve ([time, tokens, loss] rows) at `tokens`, linearly interpolated."""
  pts = sorted((c[1], c[2]) for c in curve)
  for (x0, y0), (x1, y1) in itertools.pairwise(pts):
    if x0 <= tokens <= x1:
      return y0 if x1 == x0 else y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
  return None


def gap_over_training(
  store: study.ResultStore, system: study.System, seeds: list[int], fractions: tuple[float, ...]
) -> list[study.Interval]:
  """The paired gap to data-parallel at each fraction of the token budget (eval curves)."""
  return [_paired_at(store, system, data_parallel(), seeds, f) for f in fractions]


def _paired_at(
  store: study.ResultStore, a: study.System, b: study.System, seeds: list[int], frac: float | None
) -> study.Interval:
  """a against b paired by seed: final losses (`frac` None) or their eval curves at a fraction of
  b's token budget."""
  values, reference = {}, {}
  for s in seeds:
    ra, rb = store.get(a, s), store.get(b, s)
    if ra is None or rb is None:
      continue
    if frac is None:
      values[s], reference[s] = ra["final_eval_loss"], rb["final_eval_loss"]
      continue
    at = frac * rb["tokens_trained"]
    x, y = _at_tokens(ra["curve"], at), _at_tokens(rb["curve"], at)
    if x is not None and y is not None:
      values[s], reference[s] = x, y
  return _gap(values, reference)


def gap_parts(store: study.ResultStore, seeds: list[int]) -> list[str]:
  """The report's section on what Decoupled DiLoCo's gap to Streaming DiLoCo is made of, each row
  one change paired by seed at fractions of the tokens and at the end: the merge rule, the
  protocol (K = 1 + grace, learners that never wait), the crash."""
  alpha, lr = best_alpha(store), best_lr(store, DIAGNOSED_M)
  if alpha is None or lr is None:
    return []
  m = DIAGNOSED_M
  stream = streaming(m, lr, alpha)
  rda, mean = decoupled(m, lr, alpha), decoupled(m, lr, alpha, mean=True)
  rda_clean, mean_clean = (decoupled(m, lr, alpha, c, w) for c, w in DIAGNOSES)
  fractions = (0.25, 0.5, 0.75, 0.9)
  rows = []
  for label, a, b in (
    ("Decoupled with RDA (1 crash) vs Streaming", rda, stream),
    ("the merge rule: RDA vs the weighted mean (1 crash)", rda, mean),
    ("the merge rule: RDA vs the weighted mean (no crash)", rda_clean, mean_clean),
    ("the protocol: Decoupled (weighted mean, no crash) vs Streaming", mean_clean, stream),
    ("the crash: with one vs without (RDA)", rda, rda_clean),
    ("the crash: with one vs without (weighted mean)", mean, mean_clean),
    ("Decoupled as shipped (weighted mean, 1 crash) vs Streaming", mean, stream),
    *(
      (f"α: {a} vs {alpha} (weighted mean, 1 crash)", decoupled(m, lr, a, mean=True), mean)
      for a in ALPHAS
      if a != alpha
    ),
  ):
    gaps = [_paired_at(store, a, b, seeds, f) for f in (*fractions, None)]
    rows.append([label, *(_fmt(g) for g in gaps)])
  return [
    "",
    f"## What Decoupled DiLoCo's gap to Streaming DiLoCo is made of (M = {m}, α = {alpha})",
    "",
    "Both run the same fragments, outer step and tokens. Decoupled DiLoCo closes each round at",
    "the first answer plus the grace window and its learners never wait for a merge; Streaming",
    "DiLoCo closes at M answers and its learners wait at the apply. Streaming merges by the",
    "weighted mean; Decoupled by RDA (the mean norm along the mean direction) or the weighted",
    "mean, the shipped rule. The crash takes learner 1 down for 300 s at t = 2000 s",
    f"(`{CRASH}`); the three others go on, so the fleet trains the same tokens in more steps.",
    "Each row is one change, paired by seed at fractions of the tokens (eval curves,",
    "interpolated) and at the end.",
    "",
    study.markdown_table(["change", *(f"{int(100 * f)} %" for f in fractions), "end"], rows),
  ]


def protocol_gap(store: study.ResultStore, seeds: list[int]) -> list[str]:
  """The report's section on Decoupled DiLoCo as shipped against Streaming DiLoCo at every M of
  the comparison, paired by seed at fractions of the tokens and at the end: the goal's gap and
  whether it grows over training."""
  alpha = best_alpha(store)
  fractions = (0.25, 0.5, 0.75, 0.9)
  rows = []
  for m in STREAMING_MS:
    if alpha is None or (lr := best_lr(store, m)) is None:
      continue
    a, b = decoupled(m, lr, alpha, mean=True), streaming(m, lr, alpha)
    gaps = [_paired_at(store, a, b, seeds, f) for f in (*fractions, None)]
    rows.append([m, *(_fmt(g) for g in gaps), max(g.n for g in gaps)])
  if not rows:
    return []
  return [
    "",
    "## Decoupled DiLoCo as shipped against Streaming DiLoCo over training",
    "",
    "Decoupled DiLoCo (the weighted mean, K = 1 + grace, one crash) against synchronous",
    f"Streaming DiLoCo at the same M, outer step and tokens (α = {alpha}), paired by seed at",
    "fractions of Streaming's tokens (eval curves, interpolated) and at the end. The goal is",
    "≤ +0.5 % at the end and no gap that grows over the second half.",
    "",
    study.markdown_table(
      ["M", *(f"{int(100 * f)} % of the tokens" for f in fractions), "end", "seeds"], rows
    ),
  ]


def final_rows(store: study.ResultStore) -> list[tuple[str, int, float | str, study.System]]:
  """(method, M, outer lr, system) of the table's final rows, those whose settings are known."""
  rows = []
  for m in MS:
    best = best_diloco(store, m)
    if best is not None:
      rows.append(("DiLoCo", m, *best))
  alpha = best_alpha(store)
  for m in STREAMING_MS:
    lr = best_lr(store, m)
    if lr is not None and alpha is not None:
      rows.append(("Streaming DiLoCo", m, lr, streaming(m, lr, alpha)))
      rows.append(("Decoupled DiLoCo, 1 crash", m, lr, decoupled(m, lr, alpha, mean=True)))
  return rows


def _store_paired_gaps(store: study.ResultStore, seeds: list[int]) -> dict[int, float]:
  """Gives every stored run its gap to data-parallel on its seed (for readers of the JSON alone),
  saves the store, and returns data-parallel's loss per seed."""
  dp = _losses(store, data_parallel(), seeds)
  for name, by_seed in store.results.items():
    for seed, result in by_seed.items():
      ref = dp.get(int(seed))
      result["paired_gap_vs_data_parallel"] = (
        None if ref is None or name == data_parallel().name else result["final_eval_loss"] / ref - 1
      )
  store.save()
  return dp


def report(store: study.ResultStore, seeds: list[int]) -> None:
  """Writes docs/results/scaling_table.{md,png} and each run's paired gap into the JSON."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  dp = _store_paired_gaps(store, seeds)

  parts = [
    "# DiLoCo against data-parallel: the scaling table at 1.1M parameters",
    "",
    f"Tiny model (1.1M parameters, byte tokens), {STEPS} steps of a global batch of "
    f"{GLOBAL_BATCH} x {SEQ_LEN} tokens ({STEPS * GLOBAL_BATCH * SEQ_LEN / 1e6:.1f}M tokens, "
    f"{STEPS * GLOBAL_BATCH * SEQ_LEN / 1.115e6:.1f} per parameter), H = {PERIOD}: "
    f"{OUTER_STEPS} outer steps per fragment. The global batch is split as B / M; the inner AdamW "
    "(peak lr 3e-3, warm-up 20, cosine to 0.1) is the same for every row and was not tuned per M. "
    "Every row is scored on one held-out set (512 windows of 64 tokens). Gaps are paired by seed: "
    "mean ± 95 % t-interval over seeds.",
    "",
    "Reproduce: `python experiments/scaling_table.py` (resumable; one run per core).",
  ]
  rows = [["data-parallel", "–", "–", _cell(dp), "–", "–", "–", "–", "–", len(dp)]]
  streaming_by_m = {}
  for method, m, lr, system in final_rows(store):
    values = _losses(store, system, seeds)
    gap = _gap(values, dp)
    paper = fit = goal = met = "–"
    if method == "DiLoCo":
      paper, fit, goal = f"{PAPER_35M[m]:+.1f} %", f"{FIT_1M[m]:+.1f} %", f"≤ {GOAL[m]:+.1f} %"
      met = _met(gap, GOAL[m])
    elif method == "Streaming DiLoCo":
      streaming_by_m[m] = values
    else:
      vs = _gap(values, streaming_by_m.get(m, {}))
      goal = f"≤ {STREAMING_GOAL:+.1f} % vs Streaming ({_fmt(vs)})"
      met = _met(vs, STREAMING_GOAL)
    rows.append([method, m, lr, _cell(values), _fmt(gap), paper, fit, goal, met, len(values)])
  parts += [
    "",
    "## The table",
    "",
    study.markdown_table(
      [
        "method",
        "M",
        "outer lr",
        "eval loss",
        "vs data-parallel",
        "paper, 35M",
        "fit, 1.1M",
        "goal",
        "met",
        "seeds",
      ],
      rows,
    ),
  ]
  # The sweep.
  dp0 = _losses(store, data_parallel(), seeds[:1])
  sweep_rows = []
  for m in MS:
    for lr in sweep_of(store, m):
      loss = _losses(store, diloco(m, lr), seeds[:1])
      sweep_rows.append([m, lr, _cell(loss) if loss else "not run", _fmt(_gap(loss, dp0))])
  parts += [
    "",
    f"## Outer learning rate (DiLoCo, Nesterov momentum {MOMENTUM}, seed {seeds[0]})",
    "",
    study.markdown_table(["M", "outer lr", "eval loss", "vs data-parallel"], sweep_rows),
  ]
  # The momentum warm-up at this horizon.
  warm_rows = []
  for m in MS:
    lr = best_lr(store, m)
    if lr is None:
      continue
    plain, warm = (
      _losses(store, diloco(m, lr), seeds[:1]),
      _losses(store, diloco(m, lr, WARMUP), seeds[:1]),
    )
    warm_rows.append(
      [m, lr, _cell(plain), _cell(warm) if warm else "not run", _fmt(_gap(warm, plain))]
    )
  parts += [
    "",
    f"## Momentum warm-up at {OUTER_STEPS} outer steps (DiLoCo, seed {seeds[0]})",
    "",
    f"Nesterov 0.9 against the same with its momentum ramped over the first {WARMUP} outer steps",
    f"and its learning rate brought from {WARMUP_LR0} down to M's best over the same steps",
    "(`nesterov_warmup`): the form the syncer ships.",
    "",
    study.markdown_table(
      ["M", "outer lr", "Nesterov", "with warm-up", "warm-up vs Nesterov"], warm_rows
    ),
  ]
  # α.
  alpha_rows = []
  for m in STREAMING_MS:
    lr = best_lr(store, m)
    if lr is None:
      continue
    for alpha in ALPHAS:
      loss = _losses(store, decoupled(m, lr, alpha), seeds[:1])
      alpha_rows.append([m, lr, alpha, _cell(loss) if loss else "not run", _fmt(_gap(loss, dp0))])
  parts += [
    "",
    f"## Overwrite or mix at the apply (Decoupled DiLoCo, seed {seeds[0]})",
    "",
    "α = 0 overwrites θ_p with the merged Θ_p; α = 0.5 keeps half of θ_p. The better mean over",
    f"M = 4 and 8 is the α of the final rows: {best_alpha(store)}.",
    "",
    study.markdown_table(["M", "outer lr", "α", "eval loss", "vs data-parallel"], alpha_rows),
  ]
  parts += gap_parts(store, seeds)
  parts += protocol_gap(store, seeds)
  # The gap over the second half.
  fractions = (0.5, 0.625, 0.75, 0.875, 1.0)
  half_rows = []
  for method, m, _, system in final_rows(store):
    gaps = gap_over_training(store, system, seeds, fractions)
    half_rows.append([method, m, *(_fmt(g) for g in gaps)])
  parts += [
    "",
    "## The gap to data-parallel over the second half of training",
    "",
    "Paired gap to data-parallel at fractions of the token budget (eval curves, interpolated).",
    "",
    study.markdown_table(
      ["method", "M", *(f"{int(100 * f)} % of the tokens" for f in fractions)], half_rows
    ),
    "",
    f"![eval curves]({STUDY}.png)",
  ]

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  curves = {"data-parallel": store.runs(data_parallel(), seeds)}
  for method, m, _, system in final_rows(store):
    curves[f"{method} M={m}"] = store.runs(system, seeds)
  study.plot_curves(axes[0], curves, x="tokens")
  axes[0].set_ylim(top=min(2.0, axes[0].get_ylim()[1]))
  for i, (method, m, _, system) in enumerate(final_rows(store)):
    fr = [0.25 + 0.05 * k for k in range(16)]
    gaps = gap_over_training(store, system, seeds, tuple(fr))
    xs = [f for f, g in zip(fr, gaps) if g.n]
    ys = [100 * g.mean for g in gaps if g.n]
    axes[1].plot(xs, ys, marker=".", color=f"C{(i + 1) % 10}", label=f"{method} M={m}")
  axes[1].axhline(0.0, color="C0", lw=1)
  axes[1].set_xlabel("fraction of the token budget")
  axes[1].set_ylabel("eval loss vs data-parallel (%)")
  axes[1].grid(alpha=0.3)
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  study.publish(_OUT.value, STUDY, "\n".join(parts), fig, "python experiments/scaling_table.py")


def report_device(sweeps: study.ResultStore, store: study.ResultStore, seeds: list[int]) -> str:
  """Writes the table of a `--tier=device` run beside its store (`<store>.md`): each final row
  over the seeds it ran, its gap paired by seed with data-parallel of the same backend, and
  seed 0 against the CPU study's seed 0 (what the backend changes). Returns the table's path."""
  name = os.path.splitext(os.path.basename(store.path))[0]
  dp = _store_paired_gaps(store, seeds)
  machines = sorted({r.get("machine", "?") for by in store.results.values() for r in by.values()})
  commits = sorted({r.get("commit", "?") for by in store.results.values() for r in by.values()})
  rows = [["data-parallel", "–", "–", _cell(dp), "–", "–", "–", "–", len(dp)]]
  cross = []
  systems = [(1, "–", data_parallel())]
  for m in MS:
    if (best := best_diloco(sweeps, m)) is None:
      continue
    label, system = best
    systems.append((m, label, system))
    values = _losses(store, system, seeds)
    gap = _gap(values, dp)
    per_seed = ", ".join(
      f"{100 * (values[s] / dp[s] - 1):+.2f}" for s in seeds if s in values and s in dp
    )
    rows.append(
      [
        "DiLoCo",
        m,
        label,
        _cell(values),
        _fmt(gap),
        per_seed or "–",
        f"≤ {GOAL[m]:+.1f} %",
        _met(gap, GOAL[m]),
        len(values),
      ]
    )
  for m, label, system in systems:
    here, there = store.get(system, 0), sweeps.get(system, 0)
    if here and there:
      a, b = here["final_eval_loss"], there["final_eval_loss"]
      title = "data-parallel" if system == data_parallel() else f"DiLoCo M={m}, {label}"
      cross.append([title, f"{b:.4f}", f"{a:.4f}", f"{100 * (a / b - 1):+.2f} %"])
  fractions = (0.5, 0.625, 0.75, 0.875, 1.0)
  half_rows = []
  for m, _, system in systems[1:]:
    gaps = gap_over_training(store, system, seeds, fractions)
    half_rows.append(["DiLoCo", m, *(_fmt(g) for g in gaps)])
  streamed_rows = []
  for m in STREAMING_MS:
    if (lr := best_lr(sweeps, m)) is None:
      continue
    for alpha in ALPHAS:
      stream = _losses(store, streaming(m, lr, alpha), seeds)
      dec = _losses(store, decoupled(m, lr, alpha, mean=True), seeds)
      if not stream and not dec:
        continue
      vs = _gap(dec, stream)
      streamed_rows.append(
        [
          m,
          alpha,
          f"{_cell(stream)} ({len(stream)})",
          _fmt(_gap(stream, dp)),
          f"{_cell(dec)} ({len(dec)})",
          _fmt(_gap(dec, dp)),
          _fmt(vs),
          _met(vs, STREAMING_GOAL),
        ]
      )
  parts = [
    "# The scaling table's final rows on an accelerator",
    "",
    f"The rows of scaling_table.md (tiny model, {STEPS} steps of {GLOBAL_BATCH} x {SEQ_LEN} "
    f"tokens, H = {PERIOD}, {OUTER_STEPS} outer steps, one held-out set of 512 windows), each M's "
    "outer step as the CPU study's seed-0 sweep chose it, run again over every seed on "
    f"{'; '.join(machines)} (commit {', '.join(commits)}), float32 with float32 matrix products. "
    "Every gap is paired by seed with data-parallel run on the same backend.",
    "",
    "Reproduce (on a host with a GPU): "
    "`python experiments/scaling_table.py --tier=device --seeds=1,2,0 --out=OUT`, then "
    f"`python experiments/scaling_table.py --tier=device_report --device_store=OUT/{STUDY}.json`.",
    "",
    study.markdown_table(
      [
        "method",
        "M",
        "outer lr",
        "eval loss",
        "vs data-parallel",
        "per seed (%)",
        "goal",
        "met",
        "seeds",
      ],
      rows,
    ),
    "",
    "## The gap to data-parallel over the second half of training",
    "",
    study.markdown_table(
      ["method", "M", *(f"{int(100 * f)} % of the tokens" for f in fractions)], half_rows
    ),
    "",
    "## Streaming DiLoCo and Decoupled DiLoCo (1 crash)",
    "",
    f"P = H = {PERIOD}, τ = 2, each M's outer lr with the warm-up, Decoupled merged by the weighted",
    "mean (the shipped rule); seeds run in parentheses.",
    "",
    study.markdown_table(
      [
        "M",
        "α",
        "Streaming",
        "vs data-parallel",
        "Decoupled",
        "vs data-parallel",
        "Decoupled vs Streaming",
        f"≤ {STREAMING_GOAL:+.1f} %",
      ],
      streamed_rows,
    )
    if streamed_rows
    else "Not run.",
    "",
    "## Seed 0 on both backends",
    "",
    "The same run (config and seed) on the CPU study's machine and here.",
    "",
    study.markdown_table(["row", "CPU", "here", "here vs CPU"], cross),
  ]
  path = study.write_report(os.path.dirname(store.path) or ".", name, "\n".join(parts))
  print("\n".join(parts))
  return path


def main(argv: list[str]) -> None:
  del argv
  cli.quiet_logs()  # gin's "Path not found" for each include it then finds on a search path.
  if _RUN.value is not None:
    run_one(_RUN.value, _SEED.value, _RESULT.value)
    return
  seeds = [int(s) for s in _SEEDS.value]
  if _TIER.value == "device_report":
    report_device(_store(_SWEEP_STORE.value), _store(_DEVICE_STORE.value), seeds)
    return
  if _TIER.value == "device":
    sweeps = _store(_SWEEP_STORE.value)
    drive(seeds, lambda store: device_plan(sweeps, store, seeds))
    return
  if _TIER.value != "report":
    drive(seeds)
  report(_store(os.path.join(_OUT.value, f"{STUDY}.json")), seeds)


if __name__ == "__main__":
  app.run(main)
