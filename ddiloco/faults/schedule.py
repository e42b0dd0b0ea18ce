"""Fault schedules for the chaos harness: a seeded, time-sorted, causal list of `FaultEvent`s.

`ChaosConfig` states the fault rates of one chaos run; `make_schedule` turns it into the
events the driver executes on a real `LocalCluster` (docs/algorithm.md §6: learners crash and rejoin, the syncer
crashes and resumes, the network misbehaves).

Fault processes, each its own Poisson stream with its own RNG (so turning one rate up does not move the
others' arrival times), arrivals in [start_s, duration_s):
  learner kills     fleet-wide rate 1/learner_mtbf_s; the victim is uniform among learners that are up
                    and not in a slowdown; skipped (the clock goes on) when it would leave fewer than
                    `min_up` learners up. Every kill is followed by its restart after restart_delay_s.
  slowdowns         fleet-wide rate 1/slowdown_mtbf_s; the victim is uniform among up learners not
                    already slowed. A slowdown is SIGSTOP/SIGCONT duty-cycled over a window of
                    `slowdown_s`: every `slowdown_period_s` the learner is stopped for
                    `slowdown_fraction` of the period (it runs at ≈ 1 − fraction of its speed, a
                    straggler, docs/algorithm.md §4.2). fraction = 1 is one plain pause of `slowdown_s`.
  network delay     windows of `net_delay_s` with `net_latency_s` of added one-way latency.
  network drops     every connection through the proxy reset at once (skipped during a partition).
  partitions        windows of `net_partition_s`; params carry the proxy's partition mode.
  syncer kills      at explicit times, restarted after syncer_restart_delay_s. With a sharded
                    syncer (S > 1) each kill takes down the shard `syncer_kill_shards` names for
                    it, or every shard at once; the network faults hit the connections to
                    `net_shard` (through its proxy), or to every shard.
Completions (restart, resume, clear, heal) always follow their cause, also past duration_s.

Why `min_up` counts learners that are up (a paused process is up): with min_up ≥ K (docs/algorithm.md §4.1) a
quorum of K stays possible whenever the syncer is up, which is what "zero global downtime" asks for.
"""

import dataclasses
import heapq
import itertools
import math
from typing import Any

import numpy as np

from ddiloco.faults import COMPLETIONS, NETWORK_KINDS, FaultEvent
from ddiloco.types import check_int_fields

# The fault kinds the planner draws (a subset of ddiloco.faults.KINDS).
KINDS = (
  "kill_learner",
  "start_learner",
  "pause_learner",
  "resume_learner",
  "kill_syncer",
  "start_syncer",
  *NETWORK_KINDS,
)
PARTITION_MODES = ("hold", "reset")


def _check_delay(name: str, value: float | tuple[float, float]) -> None:
  lo, hi = (value, value) if isinstance(value, int | float) else tuple(value)
  if not 0 <= lo <= hi or not math.isfinite(hi):
    raise ValueError(f"{name} must be a finite delay >= 0 or a (min, max) range, got {value}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig:
  """A chaos run's fault rates and invariant bounds (see the module docstring).

  A rate's `*_mtbf_s` of 0 turns that fault process off.

  Attributes:
    duration_s: injections arrive in [start_s, duration_s).
    start_s: no injection before this (the processes start and compile first).
    seed: the schedule's seed; the same config and seed give the same schedule.
    learner_mtbf_s: mean time between learner kills over the whole fleet.
    restart_delay_s: a killed learner's restart delay: fixed, or (min, max) uniform.
    min_up: never kill a learner when fewer than this many others would stay up.
    slowdown_mtbf_s: mean time between slowdown onsets over the fleet.
    slowdown_s: length of a slowdown window.
    slowdown_fraction: stopped fraction of each period, in (0, 1]; 1 = one plain pause.
    slowdown_period_s: duty-cycle period of a slowdown with fraction < 1.
    net_delay_mtbf_s: mean time between network-delay windows.
    net_delay_s: length of a delay window.
    net_latency_s: one-way latency added during a delay window.
    net_drop_mtbf_s: mean time between drops (all connections reset).
    net_partition_mtbf_s: mean time between partitions.
    net_partition_s: length of a partition.
    net_partition_mode: "hold" (traffic stalls, connections survive) or "reset" (connections reset
      and new ones refused), see ddiloco.chaos.proxy.
    syncer_kill_times_s: explicit syncer kill times, increasing.
    syncer_kill_shards: with a sharded syncer, the shard each kill of `syncer_kill_times_s` takes
      down (its restart brings back the same shard), one per kill; empty: every kill takes down
      every shard at once. An unsharded syncer is shard 0.
    syncer_restart_delay_s: the syncer's restart delay after each kill.
    net_shard: the shard whose connections (its proxy) the network faults hit; None: every
      shard's.
    max_gap_s: invariant bound: the longest merge-free interval with >= K learners up (outside
      syncer outages), see ddiloco.chaos.invariants.
    eval_tolerance: invariant bound: final eval loss at most this much above the fault-free one,
      relative.
  """

  duration_s: float = 120.0
  start_s: float = 0.0
  seed: int = 0
  learner_mtbf_s: float = 0.0
  restart_delay_s: float | tuple[float, float] = 5.0
  min_up: int = 1
  slowdown_mtbf_s: float = 0.0
  slowdown_s: float = 5.0
  slowdown_fraction: float = 1.0
  slowdown_period_s: float = 1.0
  net_delay_mtbf_s: float = 0.0
  net_delay_s: float = 5.0
  net_latency_s: float = 0.1
  net_drop_mtbf_s: float = 0.0
  net_partition_mtbf_s: float = 0.0
  net_partition_s: float = 3.0
  net_partition_mode: str = "hold"
  syncer_kill_times_s: tuple[float, ...] = ()
  syncer_kill_shards: tuple[int, ...] = ()
  syncer_restart_delay_s: float = 5.0
  net_shard: int | None = None
  max_gap_s: float = 30.0
  eval_tolerance: float = 0.03

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    if not 0 <= self.start_s <= self.duration_s or not math.isfinite(self.duration_s):
      raise ValueError(
        f"Need 0 <= start_s <= duration_s < inf, got {self.start_s}, {self.duration_s}."
      )
    rates = ("learner_mtbf_s", "slowdown_mtbf_s", "net_delay_mtbf_s", "net_drop_mtbf_s")
    for name in (*rates, "net_partition_mtbf_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}.")
    for name in ("slowdown_s", "slowdown_period_s", "net_delay_s", "net_partition_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
    _check_delay("restart_delay_s", self.restart_delay_s)
    _check_delay("syncer_restart_delay_s", self.syncer_restart_delay_s)
    if not 0 < self.slowdown_fraction <= 1:
      raise ValueError(f"slowdown_fraction must be in (0, 1], got {self.slowdown_fraction}.")
    if self.min_up < 0:
      raise ValueError(f"min_up must be >= 0, got {self.min_up}.")
    if not (self.net_latency_s >= 0 and math.isfinite(self.net_latency_s)):
      raise ValueError(f"net_latency_s must be finite and >= 0, got {self.net_latency_s}.")
    if self.net_partition_mode not in PARTITION_MODES:
      raise ValueError(f"net_partition_mode must be one of {PARTITION_MODES}.")
    kills = tuple(self.syncer_kill_times_s)
    if any(t < 0 for t in kills) or any(
      b < a + self.syncer_restart_delay_s for a, b in itertools.pairwise(kills)
    ):
      raise ValueError(
        f"syncer_kill_times_s {kills} must be >= 0, increasing, and at least "
        f"syncer_restart_delay_s ({self.syncer_restart_delay_s}) apart (no kill of a dead syncer)."
      )
    shards = tuple(self.syncer_kill_shards)
    if shards and (len(shards) != len(kills) or min(shards) < 0):
      raise ValueError(
        f"syncer_kill_shards {shards} must name a shard >= 0 for each of the {len(kills)} "
        "syncer kills, or be empty (every kill takes down every shard)."
      )
    if self.net_shard is not None and self.net_shard < 0:
      raise ValueError(f"net_shard must be >= 0 or None, got {self.net_shard}.")
    if not self.max_gap_s > 0 or not self.eval_tolerance >= 0:
      raise ValueError("max_gap_s must be > 0 and eval_tolerance >= 0.")


def _arrivals(rng: np.random.Generator, mtbf_s: float, start: float, end: float) -> list[float]:
  """Poisson arrival times in [start, end): exponential inter-arrivals with mean mtbf_s."""
  if mtbf_s <= 0:
    return []
  out, t = [], start
  while True:
    t += float(rng.exponential(mtbf_s))
    if t >= end:
      return out
    out.append(t)


def _draw_delay(rng: np.random.Generator, delay: float | tuple[float, float]) -> float:
  if isinstance(delay, int | float):
    return float(delay)
  lo, hi = delay
  return float(rng.uniform(lo, hi))


def _t(x: float) -> float:
  return round(x, 6)  # Readable tapes; the schedule stays a pure function of config and seed.


class _Planner:
  """The state machine behind `make_schedule`: who is up, slowed, which windows are open."""

  def __init__(self, config: ChaosConfig, num_learners: int):
    self.config = config
    self.rngs = {
      name: np.random.default_rng([config.seed, i])
      for i, name in enumerate(("kill", "slow", "delay", "drop", "partition"))
    }
    self.heap: list[tuple[float, int, int, str, Any]] = []
    self.seq = itertools.count()
    self.windows = itertools.count()
    self.up, self.slowed = set(range(num_learners)), set()
    self.delaying = self.partitioned = False
    self.out: list[FaultEvent] = []

  def push(self, t: float, action: str, payload: Any = None) -> None:
    prio = 0 if action in COMPLETIONS else 1
    heapq.heappush(self.heap, (_t(t), prio, next(self.seq), action, payload))

  def emit(
    self, t: float, kind: str, learner: int | None = None, *, shard: int | None = None, **params
  ) -> None:
    self.out.append(FaultEvent(t, kind, learner, params, shard))

  def emit_net(self, t: float, kind: str, **params: Any) -> None:
    self.emit(t, kind, shard=self.config.net_shard, **params)

  def run(self) -> list[FaultEvent]:
    cfg = self.config
    for name, mtbf in (
      ("kill", cfg.learner_mtbf_s),
      ("slow", cfg.slowdown_mtbf_s),
      ("delay", cfg.net_delay_mtbf_s),
      ("drop", cfg.net_drop_mtbf_s),
      ("partition", cfg.net_partition_mtbf_s),
    ):
      for t in _arrivals(self.rngs[name], mtbf, cfg.start_s, cfg.duration_s):
        self.push(t, name)
    shards = cfg.syncer_kill_shards or (None,) * len(cfg.syncer_kill_times_s)
    for t, shard in zip(cfg.syncer_kill_times_s, shards, strict=True):
      self.push(t, "kill_syncer", shard)
    while self.heap:  # Popped in time order, so `out` comes out sorted.
      t, _, _, action, payload = heapq.heappop(self.heap)
      getattr(self, f"_on_{action}")(t, payload)
    return self.out

  # -- arrivals (may be skipped) --------------------------------------------------------------

  def _on_kill(self, t: float, _) -> None:
    candidates = sorted(self.up - self.slowed)
    if len(self.up) - 1 < self.config.min_up or not candidates:
      return  # min_up would be broken, or every up learner is in a slowdown: skipped.
    victim = int(self.rngs["kill"].choice(candidates))
    delay = _draw_delay(self.rngs["kill"], self.config.restart_delay_s)
    self.up.discard(victim)
    self.emit(t, "kill_learner", victim, restart_delay_s=_t(delay))
    self.push(t + delay, "start_learner", victim)

  def _on_slow(self, t: float, _) -> None:
    candidates = sorted(self.up - self.slowed)
    if not candidates:
      return
    victim = int(self.rngs["slow"].choice(candidates))
    self.slowed.add(victim)
    cfg = self.config
    if cfg.slowdown_fraction >= 1:
      starts, pause = [t], cfg.slowdown_s
    else:
      n = max(1, round(cfg.slowdown_s / cfg.slowdown_period_s))
      starts = [t + k * cfg.slowdown_period_s for k in range(n)]
      pause = cfg.slowdown_fraction * cfg.slowdown_period_s
    params = {
      "window": next(self.windows),
      "fraction": cfg.slowdown_fraction,
      "window_s": _t(starts[-1] + pause - t),
      "pause_s": _t(pause),
    }
    # The last resume closes the window; until then the learner is neither killed nor slowed again,
    # so every pause keeps its resume.
    for k, start in enumerate(starts):
      self.push(start, "pause_learner", (victim, params))
      self.push(start + pause, "resume_learner", (victim, k == len(starts) - 1))

  def _on_delay(self, t: float, _) -> None:
    if not self.delaying:
      self.delaying = True
      self.emit_net(t, "net_delay", latency_s=self.config.net_latency_s)
      self.push(t + self.config.net_delay_s, "net_clear")

  def _on_drop(self, t: float, _) -> None:
    if not self.partitioned:  # A partition has no connections to drop that it has not cut.
      self.emit_net(t, "net_drop")

  def _on_partition(self, t: float, _) -> None:
    cfg = self.config
    if not self.partitioned:
      self.partitioned = True
      self.emit_net(t, "net_partition", duration_s=cfg.net_partition_s, mode=cfg.net_partition_mode)
      self.push(t + cfg.net_partition_s, "net_heal")

  def _on_kill_syncer(self, t: float, shard: int | None) -> None:
    delay = self.config.syncer_restart_delay_s
    self.emit(t, "kill_syncer", shard=shard, restart_delay_s=delay)
    self.push(t + delay, "start_syncer", shard)

  # -- scheduled consequences (always happen) -------------------------------------------------

  def _on_pause_learner(self, t: float, payload: tuple[int, dict]) -> None:
    learner, params = payload
    self.emit(t, "pause_learner", learner, **params)

  def _on_resume_learner(self, t: float, payload: tuple[int, bool]) -> None:
    learner, last = payload
    self.emit(t, "resume_learner", learner)
    if last:
      self.slowed.discard(learner)

  def _on_start_learner(self, t: float, learner: int) -> None:
    self.up.add(learner)
    self.emit(t, "start_learner", learner)

  def _on_net_clear(self, t: float, _) -> None:
    self.delaying = False
    self.emit_net(t, "net_clear")

  def _on_net_heal(self, t: float, _) -> None:
    self.partitioned = False
    self.emit_net(t, "net_heal")

  def _on_start_syncer(self, t: float, shard: int | None) -> None:
    self.emit(t, "start_syncer", shard=shard)


def make_schedule(config: ChaosConfig, num_learners: int, num_shards: int = 1) -> list[FaultEvent]:
  """The injected events of one chaos run, sorted by time (see the module docstring).

  Args:
    config: the fault rates.
    num_learners: learners 0..num_learners-1, all up at t = 0.
    num_shards: the syncer's shards (JobConfig.syncer_shards).

  Returns:
    Causal events: no kill or pause of a learner that is down or already paused, every kill followed
    by its restart, every pause by its resume, every window by its end, kills never leaving fewer
    than `min_up` learners up.

  Raises:
    ValueError: if num_learners < 1, min_up > num_learners, or a shard named in the config is not
      one of the syncer's.
  """
  if num_learners < 1:
    raise ValueError(f"num_learners must be >= 1, got {num_learners}.")
  named = [*config.syncer_kill_shards, *([] if config.net_shard is None else [config.net_shard])]
  if num_shards < 1 or any(s >= num_shards for s in named):
    raise ValueError(
      f"ChaosConfig names syncer shards {sorted(set(named))}; the syncer has {num_shards} "
      "(JobConfig.syncer_shards)."
    )
  if config.min_up > num_learners:
    raise ValueError(f"min_up ({config.min_up}) exceeds the fleet ({num_learners} learners).")
  return _Planner(config, num_learners).run()
