"""Replay of a chaos run's event tape on the simulated cluster.

The injected learner events of a tape become fault strings (`ddiloco.faults.grammar`), with wall times
scaled to virtual times so that a real step and a simulated step line up:
  virtual = (t − t0) · time_scale,   time_scale = sim step_time_s / real mean step time,
t0 being the fleet's start: the tape's first learner_up (else its run_start, else 0). The chaos
schedule counts from there too; before it, the real run only started and compiled its syncer.
  kill_learner L at a, start_learner L at b   → crash:L@a'+(b'−a')   (no start: crash:L@a')
  a slowdown window (pauses sharing a `window`, fraction f < 1) over [a, b]
                                              → slow:L@a'+(b'−a')x(1/(1−f))
  a plain pause (fraction 1, or no window) of d seconds from a
                                              → slow:L@a'+max(d', s)x(1 + d'/s)
where s is the simulator's step time. The simulator draws a step's duration when it starts, so a
plain pause becomes exactly one step that takes d' longer (the window is long enough for one step to
start in it and short enough for only one), which is what SIGSTOP does to the step in progress.
Syncer kills and network events have no simulator counterpart (the simulated syncer cannot crash and
its latency is fixed per run); they are listed in `ReplayPlan.skipped`.
"""

import dataclasses
import glob
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddiloco.faults import parse_fault, parse_faults
from ddiloco.metrics.writer import read_event_lines
from ddiloco.run_config import RunConfig
from ddiloco.simulation.config import ClusterConfig

_SKIPPED_KINDS = (
  "kill_syncer",
  "start_syncer",
  "net_delay",
  "net_clear",
  "net_drop",
  "net_partition",
  "net_heal",
)


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
  """Simulator faults from a tape.

  Attributes:
    faults: fault strings for ClusterConfig.faults, sorted by time.
    skipped: "kind@t" of the injected events that cannot be replayed ("kind:shard@t" for one
      aimed at one shard of a sharded syncer).
    time_scale: virtual seconds per real second.
  """

  faults: tuple[str, ...]
  skipped: tuple[str, ...]
  time_scale: float


def _num(x: float) -> str:
  """A time or factor in the fault grammar's plain decimal form (no exponent)."""
  text = f"{x:.6f}".rstrip("0").rstrip(".")
  return text or "0"


def _skipped(r: Mapping[str, Any]) -> str:
  shard = f":{r['shard']}" if "shard" in r else ""
  return f"{r['kind']}{shard}@{r['t']}"


def _pairs(
  records: Sequence[Mapping[str, Any]], start_kind: str, end_kind: str
) -> list[tuple[Mapping[str, Any], Mapping[str, Any] | None]]:
  """Each `start_kind` record with the next `end_kind` record of the same learner (or None)."""
  open_: dict[int, Mapping[str, Any]] = {}
  out = []
  for r in records:
    if r["kind"] == start_kind:
      if r["learner"] in open_:
        raise ValueError(f"{start_kind} of learner {r['learner']} at t={r['t']} while already so.")
      open_[r["learner"]] = r
    elif r["kind"] == end_kind and r["learner"] in open_:
      out.append((open_.pop(r["learner"]), r))
  out.extend((r, None) for r in open_.values())
  return out


def tape_to_faults(
  tape: Sequence[Mapping[str, Any]],
  *,
  time_scale: float,
  sim_step_time_s: float,
  t0: float | None = None,
) -> ReplayPlan:
  """Converts a tape's injected learner events into simulator faults (module docstring).

  Args:
    tape: tape records (ddiloco.chaos.tape.read_tape).
    time_scale: virtual seconds per real second (> 0).
    sim_step_time_s: the simulator's nominal step time (ClusterConfig.step_time_s).
    t0: the real time that maps to virtual 0 (default: the first learner_up record's t, else the
      run_start record's, else 0).

  Returns:
    The plan.

  Raises:
    ValueError: for a non-positive scale or step time, or a learner killed or paused twice over.
  """
  if not time_scale > 0 or not sim_step_time_s > 0:
    raise ValueError(
      f"time_scale and sim_step_time_s must be > 0: {time_scale}, {sim_step_time_s}."
    )
  records = sorted(tape, key=lambda r: r["t"])
  if t0 is None:
    t0 = next((r["t"] for r in records if r["kind"] == "learner_up"), None)
  if t0 is None:
    t0 = next((r["t"] for r in records if r["kind"] == "run_start"), 0.0)

  def virtual(t: float) -> float:
    return max(0.0, (t - t0) * time_scale)

  faults: list[str] = []
  for kill, start in _pairs(records, "kill_learner", "start_learner"):
    a = virtual(kill["t"])
    down = "" if start is None else f"+{_num(virtual(start['t']) - a)}"
    faults.append(f"crash:{kill['learner']}@{_num(a)}{down}")

  windows: dict[tuple[int, Any], list[tuple[Mapping, Mapping | None]]] = defaultdict(list)
  for n, (pause, resume) in enumerate(_pairs(records, "pause_learner", "resume_learner")):
    key = pause.get("window", f"pause{n}")  # A pause without a window is a window of its own.
    windows[(pause["learner"], key)].append((pause, resume))
  for (learner, _), pairs in windows.items():
    pairs.sort(key=lambda pr: pr[0]["t"])
    fraction = float(pairs[0][0].get("fraction", 1.0))
    a = virtual(pairs[0][0]["t"])
    last_resume = pairs[-1][1]
    d = virtual(records[-1]["t"] if last_resume is None else last_resume["t"]) - a
    if fraction < 1:  # Duty-cycled: the learner runs at 1 − f of its speed over the window.
      faults.append(f"slow:{learner}@{_num(a)}+{_num(d)}x{_num(1 / (1 - fraction))}")
    else:
      window, factor = max(d, sim_step_time_s), 1 + d / sim_step_time_s
      faults.append(f"slow:{learner}@{_num(a)}+{_num(window)}x{_num(factor)}")

  parsed = [parse_fault(f)[0] for f in faults]  # Validates the grammar.
  order = sorted(range(len(faults)), key=lambda i: (parsed[i].t, parsed[i].learner, faults[i]))
  skipped = tuple(_skipped(r) for r in records if r["kind"] in _SKIPPED_KINDS)
  return ReplayPlan(faults=tuple(faults[i] for i in order), skipped=skipped, time_scale=time_scale)


def logged_step_times(metrics_path: str) -> list[float]:
  """The step times (> 0) a learner logged in its train events, over all its incarnations.

  A torn last line (the process was SIGKILLed mid-write) is skipped.
  """
  return [
    float(event["step_time_s"])
    for event in read_event_lines(metrics_path)
    if event.get("kind") == "train" and event.get("step_time_s", 0) > 0
  ]


def logged_step_time(run_dir: str) -> float:
  """A real run's typical step time: the median of the step times its learners logged.

  Read from `run_dir/learner_*/metrics.jsonl` (the chaos cluster's folder, which holds the tape),
  over every incarnation of every learner; a torn last line (a SIGKILLed process) is skipped. A
  summary's own step time covers only a learner's last steps, when the machine may have been far
  less loaded.

  Raises:
    ValueError: if no step time was logged there.
  """
  times = []
  for path in sorted(glob.glob(os.path.join(run_dir, "learner_*", "metrics.jsonl"))):
    times += logged_step_times(path)
  if not times:
    raise ValueError(f"No logged step time under {run_dir}: pass the real step time explicitly.")
  return statistics.median(times)


def replay(
  tape: Sequence[Mapping[str, Any]],
  *,
  workdir: str,
  real_step_time_s: float,
  run: RunConfig,
  fleet: ClusterConfig | None = None,
  t0: float | None = None,
  progress: Callable[[str], None] | None = None,
  simulate_fn: Callable[..., dict[str, Any]] | None = None,
  **simulate_kwargs: Any,
) -> dict[str, Any]:
  """Runs the simulated cluster with a tape's faults and returns its summary.

  Everything but the faults comes from `run` and `fleet`: `ddiloco-replay` passes them as its gin
  files (e.g. gin_configs/sim_tiny.gin) configure them, and gin's `simulate`.

  Args:
    tape: tape records.
    workdir: the simulation's output folder.
    real_step_time_s: the real run's mean learner step time, for the time scale.
    run: the run.
    fleet: the virtual fleet (default: `ClusterConfig()`); its faults are replaced.
    t0: see `tape_to_faults`.
    progress: passed to simulate.
    simulate_fn: runs the simulation, called as `simulate` is (default: `simulate` itself, which
      then needs the rest of its configuration in `simulate_kwargs`).
    **simulate_kwargs: more simulate() arguments (e.g. tensorboard=False).

  Returns:
    simulate()'s summary, plus "replay": {"faults", "skipped", "time_scale", "outside_run" (the
    faults planned after the simulated run had ended, which never fired), "end_s"}.

  Raises:
    ValueError: for a non-positive step time or a tape learner outside the simulated fleet.
  """
  if simulate_fn is None:
    from ddiloco.simulation.simulate import simulate as simulate_fn  # Heavy (jax, models).

  if not real_step_time_s > 0:
    raise ValueError(f"real_step_time_s must be > 0, got {real_step_time_s}.")
  fleet = fleet or ClusterConfig()
  plan = tape_to_faults(
    tape,
    time_scale=fleet.step_time_s / real_step_time_s,
    sim_step_time_s=fleet.step_time_s,
    t0=t0,
  )
  beyond = sorted({f.learner for f in parse_faults(plan.faults)} - set(range(run.num_learners)))
  if beyond:
    raise ValueError(
      f"The tape has learners {beyond} but the simulated fleet has {run.num_learners}."
    )
  fleet = dataclasses.replace(fleet, faults=plan.faults)
  summary = simulate_fn(workdir=workdir, run=run, fleet=fleet, progress=progress, **simulate_kwargs)
  end = float(summary.get("virtual_time_s", math.inf))
  summary["replay"] = {
    "faults": list(plan.faults),
    "skipped": list(plan.skipped),
    "time_scale": plan.time_scale,
    # Faults planned after the simulated run ended never fired: the replay is then not the tape.
    "outside_run": [f for f in plan.faults if parse_fault(f)[0].t > end],
    "end_s": end,
  }
  return summary
