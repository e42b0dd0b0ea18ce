"""Shared pieces of the simulated studies (experiments/*.py): run systems over seeds, report them.

A *system* is a stack of gin files plus bindings; a run is (system, seed) through `simulate`, so
every study row uses the same code as `ddiloco-simulate`. This module never parses gin itself: the
experiments pass `ddiloco.launch.configurables.simulate_files`, which does (`SimulateFiles`). Seeds change the parameter
initialisation, the data shuffle and the step-time jitter RNG together (`seed_bindings`). Per-seed
numbers are kept in a JSON store next to the table, so a study can be resumed, re-plotted or
re-aggregated without re-running, and the tables show mean ± a 95 % Student-t confidence interval
over seeds.
"""

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from scipy import stats

from ddiloco.metrics.writer import HEADLINE_KEYS, read_events

TEXT_SEEDS = (
  "RunConfig.seed = {seed}",
  "ClusterConfig.seed = {seed}",
  "TextDataConfig.seed = {seed}",
)
VISION_SEEDS = (
  "RunConfig.seed = {seed}",
  "ClusterConfig.seed = {seed}",
  "VisionDataConfig.seed = {seed}",
)
# Summary keys kept per run in the store (the rest of summary.json stays in the run's workdir):
# the headline figures and a few more.
_KEPT = (
  *HEADLINE_KEYS,
  "final_eval_metrics",
  "virtual_time_s",
  "budget_reached",
  "stalled",
  "num_params",
)


# Runs `simulate` configured by gin files then bindings, parsed afresh, and returns its summary:
# `simulate_files(files, bindings, search_paths=[...], workdir=..., progress=..., tensorboard=False)`
# (`ddiloco.launch.configurables.simulate_files`).
SimulateFiles = Callable[..., dict[str, Any]]

# The configuration text a system's gin files then bindings resolve to, every parameter of every
# configurable with the library's defaults included:
# `resolve(files, bindings, search_paths=[...])` (`ddiloco.launch.configurables.resolved_config`).
ResolveFiles = Callable[..., str]

# The protocol a stored result was computed with: results of an older one are run again. 2: rounds
# paced by the syncer (1: learner-paced sends, re-anchored stale reports).
PROTOCOL = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class System:
  """One row of a study: gin files stacked in order, then bindings, then the seed's bindings.

  Attributes:
    name: the row label (also the store key).
    gin_files: gin files, relative to the gin root or absolute, parsed in order.
    bindings: extra gin bindings applied after the files.
    seed_bindings: templates formatted with `seed=`; the default suits text runs.
  """

  name: str
  gin_files: tuple[str, ...]
  bindings: tuple[str, ...] = ()
  seed_bindings: tuple[str, ...] = TEXT_SEEDS

  def __post_init__(self):
    if not self.name:
      raise ValueError("A system needs a name.")
    if not self.gin_files:
      raise ValueError(f"System {self.name!r} has no gin files.")
    for template in self.seed_bindings:
      if "{seed}" not in template:
        raise ValueError(f"Seed binding {template!r} of {self.name!r} has no '{{seed}}'.")

  def all_bindings(self, seed: int) -> list[str]:
    """The bindings of this system for `seed`, in the order gin applies them."""
    return [*self.bindings, *(t.format(seed=seed) for t in self.seed_bindings)]

  def signature(self, seed: int) -> dict[str, Any]:
    """What determines a run: a stored result is reused only if this matches."""
    return {
      "gin_files": list(self.gin_files),
      "bindings": self.all_bindings(seed),
      "protocol": PROTOCOL,
    }


_CONFIGURATIONS: dict[tuple, str] = {}  # (resolve, files, bindings, gin root): text, per process.


def _gin_paths(system: System, gin_root: str) -> list[str]:
  return [f if os.path.isabs(f) else os.path.join(gin_root, f) for f in system.gin_files]


def configuration(
  system: System, seed: int, *, resolve: ResolveFiles, gin_root: str = "gin_configs"
) -> str:
  """The configuration text (system, seed) resolves to, computed once per process.

  Args:
    system: the gin stack.
    seed: the seed formatted into its bindings.
    resolve: see `ResolveFiles`.
    gin_root: folder that relative gin paths and includes are resolved against.
  """
  files, bindings = _gin_paths(system, gin_root), system.all_bindings(seed)
  key = (resolve, tuple(files), tuple(bindings), gin_root)
  if key not in _CONFIGURATIONS:
    _CONFIGURATIONS[key] = resolve(files, bindings, search_paths=[gin_root])
  return _CONFIGURATIONS[key]


def configuration_digest(
  system: System, seed: int, *, resolve: ResolveFiles, gin_root: str = "gin_configs"
) -> str:
  """The SHA-256 of `configuration`: what a stored result is signed with."""
  text = configuration(system, seed, resolve=resolve, gin_root=gin_root)
  return hashlib.sha256(text.encode()).hexdigest()


def enable_compilation_cache(path: str) -> None:
  """Turns on JAX's persistent compilation cache at `path`.

  A study runs the same shapes many times (seeds and quorum rules change values, not programs), and
  on a small CPU machine compiling each learner's step is a large share of a short run. Results do
  not depend on it.
  """
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def slug(name: str) -> str:
  """A folder-safe version of a system name."""
  out = "".join(c.lower() if c.isalnum() else "_" for c in name)
  return "_".join(part for part in out.split("_") if part)


def run_system(
  system: System,
  *,
  seed: int,
  workdir: str,
  simulate_files: SimulateFiles,
  gin_root: str = "gin_configs",
  progress: Callable[[str], None] | None = None,
  resolve: ResolveFiles | None = None,
) -> dict[str, Any]:
  """Runs one (system, seed) through `simulate` and returns its kept numbers and eval curve.

  Args:
    system: the gin stack.
    seed: the run's seed (formatted into `system.seed_bindings`).
    workdir: the run's output folder; emptied first (metrics.jsonl is appended to otherwise).
    simulate_files: parses the stack and runs `simulate` (see `SimulateFiles`).
    gin_root: folder that relative gin paths and includes are resolved against.
    progress: called with simulate's one-line status.
    resolve: with it, the result is signed with the configuration the stack resolves to
      ("configuration_sha256"; the text is written to the workdir's configuration.gin), resolved
      before the run from the same files.

  Returns:
    The summary's headline keys, "learners" (steps, tokens and seconds per state of each),
    "busy_learner_s" and "provisioned_learner_s" (summed over learners),
    "curve" ([virtual time, tokens, eval loss] per evaluation),
    "elapsed_s" (wall seconds, start-up included) and "config" (the run's signature).
  """
  files = _gin_paths(system, gin_root)
  text = None
  if resolve is not None:
    text = configuration(system, seed, resolve=resolve, gin_root=gin_root)
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  t0 = time.time()
  summary = simulate_files(
    files,
    system.all_bindings(seed),
    search_paths=[gin_root],
    workdir=workdir,
    progress=progress,
    tensorboard=False,
  )
  result = {k: summary.get(k) for k in _KEPT}
  result["learners"] = summary.get("learners", {})
  # Learner-seconds of compute used (busy) and paid for (busy + blocked + down), from the ledger.
  times = [info["time"] for info in result["learners"].values()]
  result["busy_learner_s"] = sum(t.get("busy", 0.0) for t in times)
  result["provisioned_learner_s"] = sum(v for t in times for k, v in t.items() if k != "gone")
  result["curve"] = [[e["time"], e["tokens"], e["loss"]] for e in read_events(workdir, "eval")]
  result["elapsed_s"] = time.time() - t0
  result["config"] = system.signature(seed)
  if text is not None:
    result["configuration_sha256"] = configuration_digest(
      system, seed, resolve=resolve, gin_root=gin_root
    )
    with open(os.path.join(workdir, "configuration.gin"), "w") as f:
      f.write(text)
  result["workdir"] = workdir
  return result


class ResultStore:
  """Per-seed results of one study, {system name: {seed: result}}, persisted as JSON after each run.

  A stored result counts for (system, seed) when it was run with the same gin files and
  bindings and, given `resolve`, signed with the configuration they resolve to now: a default or
  a gin file changed since makes it stale (`get` gives None, `run_grid` runs it again), and so does
  a result stored before results were signed.

  Args:
    path: the JSON file (loaded if it exists).
    resolve: see `ResolveFiles`; None compares the gin files and bindings only.
    gin_root: folder that relative gin paths and includes are resolved against.
  """

  def __init__(
    self, path: str, *, resolve: ResolveFiles | None = None, gin_root: str = "gin_configs"
  ):
    self.path = path
    self.resolve = resolve
    self.gin_root = gin_root
    self.results: dict[str, dict[str, dict[str, Any]]] = {}
    if os.path.exists(path):
      with open(path) as f:
        self.results = json.load(f)

  def stored(self, system: System, seed: int) -> dict[str, Any] | None:
    """The result stored under (system, seed) with its gin files and bindings, current or not."""
    result = self.results.get(system.name, {}).get(str(seed))
    if result is None or result.get("config") != system.signature(seed):
      return None
    return result

  def current(self, system: System, seed: int, result: Mapping[str, Any]) -> bool:
    """Whether `result` was signed with the configuration (system, seed) resolves to now."""
    if self.resolve is None:
      return True
    try:
      digest = configuration_digest(system, seed, resolve=self.resolve, gin_root=self.gin_root)
    except (ValueError, OSError):  # Its files no longer resolve: a run of it says why.
      return False
    return result.get("configuration_sha256") == digest

  def get(self, system: System, seed: int) -> dict[str, Any] | None:
    """The stored result of (system, seed), or None if missing, stale or run with another config."""
    result = self.stored(system, seed)
    if result is None or not self.current(system, seed, result):
      return None
    return result

  def put(self, system: System, seed: int, result: dict[str, Any]) -> None:
    self.results.setdefault(system.name, {})[str(seed)] = result
    self.save()

  def save(self) -> None:
    """Writes every result to `path` (atomically: a reader never sees half a file)."""
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.results, f, indent=1, default=str)
    os.replace(tmp, self.path)

  def runs(self, system: System, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The stored results of `system` for those of `seeds` that have one, in seed order."""
    return [r for s in seeds if (r := self.get(system, s)) is not None]


def run_grid(
  plan: Sequence[tuple[System, Sequence[int]]],
  *,
  store: ResultStore,
  workdir: str,
  simulate_files: SimulateFiles,
  gin_root: str = "gin_configs",
  rerun: bool = False,
) -> None:
  """Runs every (system, seed) of `plan` in order, one at a time, skipping those already stored.

  Args:
    plan: systems with the seeds to run each for.
    store: where results are kept (written after every run, so an interrupted study resumes).
    workdir: parent folder of the runs' workdirs (`workdir/<system slug>/seed_<seed>`).
    simulate_files: see `run_system`.
    gin_root: see `run_system`.
    rerun: run even if a matching result is stored.
  """
  for system, seeds in plan:
    for seed in seeds:
      tag = f"[{system.name} seed {seed}]"
      if not rerun and store.get(system, seed) is not None:
        print(f"{tag} stored, skipped", file=sys.stderr, flush=True)
        continue
      if not rerun and store.stored(system, seed) is not None:
        print(f"{tag} stored with another configuration: run again", file=sys.stderr, flush=True)
      try:
        result = run_system(
          system,
          seed=seed,
          workdir=os.path.join(workdir, slug(system.name), f"seed_{seed}"),
          simulate_files=simulate_files,
          gin_root=gin_root,
          progress=lambda line, tag=tag: print(f"{tag} {line}", file=sys.stderr, flush=True),
          resolve=store.resolve,
        )
      except Exception:
        # Reported loudly and not stored, so the table shows the row as "not run" and a rerun
        # retries it.
        print(f"{tag} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        continue
      print(
        f"{tag} eval {result['final_eval_loss']:.4f} goodput {result['goodput']:.3f} "
        f"({result['elapsed_s']:.0f} s)",
        file=sys.stderr,
        flush=True,
      )
      store.put(system, seed, result)


# -- statistics ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Interval:
  """Mean of n values with the half-width of its confidence interval (nan when n < 2)."""

  mean: float
  half_width: float
  n: int

  def format(self, digits: int = 4, scale: float = 1.0, unit: str = "") -> str:
    """ "m ± h" (or "m (1 seed)"), both scaled by `scale`, with `digits` decimals."""
    if self.n == 0:
      return "–"
    m = f"{self.mean * scale:.{digits}f}{unit}"
    if self.n < 2:
      return f"{m} (1 seed)"
    return f"{m} ± {self.half_width * scale:.{digits}f}{unit}"


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Interval:
  """Mean and Student-t confidence half-width: t_{(1+c)/2, n−1} · s / √n, s with ddof = 1.

  Args:
    values: the per-seed values (finite).
    confidence: the interval's coverage.

  Returns:
    The interval; half_width is nan for one value and 0-length input gives n = 0, mean nan.

  Raises:
    ValueError: for a confidence outside (0, 1) or a non-finite value.
  """
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
  x = np.asarray(list(values), dtype=np.float64)
  if not np.all(np.isfinite(x)):
    raise ValueError(f"Non-finite value in {x.tolist()}.")
  n = int(x.size)
  if n == 0:
    return Interval(math.nan, math.nan, 0)
  if n == 1:
    return Interval(float(x[0]), math.nan, 1)
  t = float(stats.t.ppf((1 + confidence) / 2, n - 1))
  return Interval(float(x.mean()), t * float(x.std(ddof=1)) / math.sqrt(n), n)


def paired_relative_ci(
  values: Mapping[int, float], reference: Mapping[int, float], confidence: float = 0.95
) -> Interval:
  """Mean and CI of values[s] / reference[s] − 1 over the seeds present in both (paired by seed)."""
  seeds = sorted(set(values) & set(reference))
  return mean_ci([values[s] / reference[s] - 1.0 for s in seeds], confidence)


def interpolate_crossing(curve: Sequence[Sequence[float]], target: float) -> float:
  """First x at which y falls to `target`, linearly interpolated; inf if it never does.

  Args:
    curve: (x, y) points in increasing x, e.g. (virtual time, eval loss).
    target: the level.
  """
  prev = None
  for x, y in curve:
    if y <= target:
      if prev is None or prev[1] == y:
        return float(x)
      x0, y0 = prev
      return float(x0 + (x - x0) * (y0 - target) / (y0 - y))
    prev = (x, y)
  return math.inf


# -- reporting ----------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table.

  Raises:
    ValueError: if a row's length differs from the header's.
  """
  for row in rows:
    if len(row) != len(headers):
      raise ValueError(f"Row {list(row)} has {len(row)} cells, expected {len(headers)}.")
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def reproduce_command(script: str, args: Sequence[str]) -> str:
  """The shell command that re-runs a study (quoting arguments that need it)."""
  quoted = [a if all(c.isalnum() or c in "-_=./,:" for c in a) else f"'{a}'" for a in args]
  return " ".join(["python", script, *quoted])


def write_report(out_dir: str, study: str, markdown: str) -> str:
  """Writes `out_dir/<study>.md`; returns its path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{study}.md")
  with open(path, "w") as f:
    f.write(markdown.rstrip() + "\n")
  return path


def publish(out_dir: str, study: str, markdown: str, fig: Any, command: str) -> str:
  """Writes a study's table (`<study>.md`) and figure (`<study>.png`), prints both paths and the
  command that reproduces them, and closes the figure. Returns the table's path."""
  import matplotlib.pyplot as plt

  path = write_report(out_dir, study, markdown)
  fig.savefig(os.path.join(out_dir, f"{study}.png"), dpi=110)
  plt.close(fig)
  print(markdown)
  print(f"\nwrote {path}\nreproduce: {command}")
  return path


def plot_curves(
  ax: Any,
  runs_by_label: Mapping[str, Sequence[Mapping[str, Any]]],
  *,
  x: str = "tokens",
) -> None:
  """Eval loss per run on `ax`: one colour per label, one thin line per seed.

  Args:
    ax: a matplotlib Axes.
    runs_by_label: label -> stored results (each with "curve").
    x: "tokens" or "time" (virtual seconds).

  Raises:
    ValueError: for another `x`.
  """
  if x not in ("tokens", "time"):
    raise ValueError(f"x must be 'tokens' or 'time', got {x!r}.")
  col = 1 if x == "tokens" else 0
  for i, (label, runs) in enumerate(runs_by_label.items()):
    color = f"C{i % 10}"
    for j, run in enumerate(runs):
      pts = np.asarray(run["curve"], dtype=np.float64)
      if pts.size == 0:
        continue
      ax.plot(
        pts[:, col], pts[:, 2], color=color, lw=1.2, alpha=0.8, label=label if j == 0 else None
      )
  ax.set_xlabel("tokens trained" if x == "tokens" else "virtual time (s)")
  ax.set_ylabel("held-out loss of the global model")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
