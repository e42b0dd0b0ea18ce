"""Fleet-scale goodput simulator (docs/algorithm.md §7).

Chips are grouped into slices; a slice fails when any of its chips is interrupted (Poisson,
per-chip MTBI) and comes back after an exponentiated-Weibull recovery delay. A synchronous job
(goodput_job.py) reacts as follows:

- a failure of a running configuration hangs the job for `detection_s`, then costs `downscale_s`
  (elastic) or `restart_s` plus the work since the last checkpoint (no elasticity);
- a recovered slice waits to be re-admitted: for free at the next failure-driven
  reconfiguration, or after `rejoin_window_s` by an `upscale_s` pause (elastic) or a restart;
- events that arrive during a pause are folded into it (the reconfiguration that ends the pause
  accounts for them) and do not extend it;
- a synchronous job runs at the pace of its slowest slice.

Decoupled DiLoCo is M such elastic jobs that never wait for each other (docs/algorithm.md §1); they only
couple through the quorum K (a learner blocks once fewer than K learners run for longer than
the overlap hides) and, with heterogeneous learners, through the pace of the K-th fastest
learner. Nothing in here encodes the "M learners on N chips ≈ one elastic job on N/M chips"
rule of thumb: it follows from the learners' independence.
"""

from collections.abc import Sequence

import numpy as np

from ddiloco.goodput.job import JobTrace, simulate_job
from ddiloco.goodput.model import (
  Costs,
  DataParallel,
  DecoupledDiLoCo,
  Fleet,
  Result,
  System,
)


def _slices_for(chips: float, learners: int, slice_chips: int) -> int:
  slices = round(chips / (learners * slice_chips))
  if slices < 1:
    raise ValueError(
      f"{chips} chips cannot give {learners} learner(s) a slice of {slice_chips} chips each."
    )
  return slices


def _learner_traces(
  *,
  chips: float,
  learners: int,
  horizon_s: float,
  fleet: Fleet,
  costs: Costs,
  rejoin_window_s: float,
  seed: np.random.SeedSequence,
) -> list[JobTrace]:
  slices = _slices_for(chips, learners, fleet.slice_chips)
  return [
    simulate_job(
      slices=slices,
      horizon_s=horizon_s,
      fleet=fleet,
      costs=costs,
      elastic=True,
      rejoin_window_s=rejoin_window_s,
      checkpoint_interval_s=None,
      rng=np.random.default_rng(child),
    )
    for child in seed.spawn(learners)
  ]


def _union_length(
  traces: Sequence[JobTrace], starts: Sequence[np.ndarray], ends: Sequence[np.ndarray]
) -> float:
  """Seconds during which at least one learner runs with at least one slice."""
  keep = [tr.run_rate > 0 for tr in traces]
  st = np.concatenate([s[k] for s, k in zip(starts, keep)])
  en = np.concatenate([e[k] for e, k in zip(ends, keep)])
  if st.size == 0:
    return 0.0
  times = np.concatenate([st, en])
  step = np.concatenate([np.ones(st.size), -np.ones(en.size)])
  order = np.argsort(times, kind="stable")
  count = np.cumsum(step[order])
  return float(np.sum(np.diff(times[order])[count[:-1] > 0]))


def coupled_work(
  traces: Sequence[JobTrace],
  offsets: np.ndarray,
  paces: np.ndarray,
  *,
  quorum: int,
  slack_s: float,
  horizon_s: float,
) -> tuple[float, float]:
  """Work of learners coupled by the quorum, and the time during which the syncer merged.

  Time is cut into elementary intervals at every run boundary of every learner; on each, a
  learner runs or not at a constant rate, so the integrals are exact.

  Args:
    traces: one per learner, times relative to `offsets`.
    offsets: when each learner's trace starts (temporary learners join late).
    paces: relative pace of each learner.
    quorum: K.
    slack_s: how long running learners keep computing below quorum.
    horizon_s: simulated seconds.

  Returns:
    (useful work in slice-seconds at unit pace, seconds with at least K learners running).
  """
  starts = [tr.run_start + off for tr, off in zip(traces, offsets)]
  ends = [tr.run_end + off for tr, off in zip(traces, offsets)]
  if quorum == 1 and np.all(paces == paces[0]):
    # Nobody ever waits: work adds up, and the syncer merges while anyone runs.
    return sum(tr.work for tr in traces) * float(paces[0]), _union_length(traces, starts, ends)
  bounds = np.unique(np.concatenate([[0.0, horizon_s], *starts, *ends]))
  bounds = bounds[(bounds >= 0) & (bounds <= horizon_s)]
  left, width = bounds[:-1], np.diff(bounds)
  mid = left + width / 2
  rate = np.zeros((len(traces), len(mid)))
  for m, (st, en, tr) in enumerate(zip(starts, ends, traces)):
    if st.size == 0:
      continue  # paused for the whole horizon
    j = np.searchsorted(st, mid, side="right") - 1
    inside = (j >= 0) & (mid < en[np.maximum(j, 0)])
    rate[m] = np.where(inside, tr.run_rate[np.maximum(j, 0)], 0.0)
  running = rate > 0
  count = running.sum(axis=0)
  merging = count >= quorum
  # Below quorum, learners block once the overlap no longer hides the wait (docs/algorithm.md §2, §4).
  below = ~merging
  episode_start = below & np.concatenate([[True], merging[:-1]])
  episode_time = np.maximum.accumulate(np.where(episode_start, left, -np.inf))
  unblocked = np.where(
    below, np.clip((episode_time + slack_s - left) / np.maximum(width, 1e-12), 0.0, 1.0), 1.0
  )
  # A learner faster than the K-th fastest running one waits for the quorum at that pace.
  ranked = np.sort(np.where(running, paces[:, None], 0.0), axis=0)[::-1]
  kth_pace = ranked[min(quorum, len(traces)) - 1]
  throttle = np.minimum(1.0, kth_pace[None, :] / paces[:, None])
  throttle = np.where(below[None, :], 1.0, throttle)
  work = float(np.sum(rate * paces[:, None] * throttle * (unblocked * width)[None, :]))
  lost = sum(tr.lost_work * p for tr, p in zip(traces, paces))
  return work - lost, float(np.sum(width[merging]))


def simulate(system: System, *, chips: int, fleet: Fleet, costs: Costs, seed: int = 0) -> Result:
  """Simulates one system on `chips` chips over the fleet's horizon.

  Args:
    system: what to simulate.
    chips: chips given to the system (split evenly between learners).
    fleet: failure, recovery and speed model.
    costs: pause lengths.
    seed: random seed; the streams depend on (seed, chips, learner index) only, so the same
      seed gives a one-learner Decoupled DiLoCo exactly the elastic data-parallel job's events.

  Returns:
    The result.

  Raises:
    ValueError: if the chips do not give every learner at least one slice.
  """
  cell_seed = np.random.SeedSequence(entropy=seed, spawn_key=(int(chips),))
  if isinstance(system, DataParallel):
    return _simulate_data_parallel(system, chips, fleet, costs, cell_seed)
  return _simulate_diloco(system, chips, fleet, costs, cell_seed)


def _simulate_data_parallel(
  system: DataParallel, chips: int, fleet: Fleet, costs: Costs, seed: np.random.SeedSequence
) -> Result:
  horizon_s = fleet.horizon_s
  trace = simulate_job(
    slices=_slices_for(chips, 1, fleet.slice_chips),
    horizon_s=horizon_s,
    fleet=fleet,
    costs=costs,
    elastic=system.elastic,
    rejoin_window_s=system.rejoin_window_s,
    checkpoint_interval_s=system.checkpoint_interval_s,
    rng=np.random.default_rng(seed.spawn(1)[0]),
  )
  return Result(
    system=system.name,
    learners=1,
    chips=int(chips),
    goodput=trace.work / (trace.ideal_rate * horizon_s),
    uptime=trace.up_time / horizon_s,
    useful_chip_hours=trace.work * fleet.slice_chips / 3600.0,
    failures=trace.failures,
    reconfigurations=trace.reconfigurations,
  )


def _simulate_diloco(
  system: DecoupledDiLoCo, chips: int, fleet: Fleet, costs: Costs, seed: np.random.SeedSequence
) -> Result:
  horizon_s = fleet.horizon_s
  base_seed, extra_seed = seed.spawn(2) if system.scavenging else (seed, None)
  traces = _learner_traces(
    chips=chips,
    learners=system.learners,
    horizon_s=horizon_s,
    fleet=fleet,
    costs=costs,
    rejoin_window_s=system.rejoin_window_s,
    seed=base_seed,
  )
  offsets = np.zeros(system.learners)
  paces = system.speeds()
  ideal = sum(tr.ideal_rate * p for tr, p in zip(traces, paces)) * horizon_s
  scav = system.scavenging
  if scav is not None:
    start_s = scav.start_hours * 3600.0
    stay_s = min(scav.duration_hours * 3600.0, horizon_s - start_s)
    if stay_s <= 0:
      raise ValueError("Scavenging starts after the horizon.")
    extra = _learner_traces(
      chips=chips * scav.chips_fraction,
      learners=scav.learners,
      horizon_s=stay_s,
      fleet=fleet,
      costs=costs,
      rejoin_window_s=system.rejoin_window_s,
      seed=extra_seed,
    )
    # Temporary learners run at the base learners' mean pace.
    mean_pace = float(np.mean(paces))
    traces = traces + extra
    offsets = np.concatenate([offsets, np.full(scav.learners, start_s)])
    paces = np.concatenate([paces, np.full(scav.learners, mean_pace)])
    ideal += sum(tr.ideal_rate for tr in extra) * mean_pace * stay_s
  work, merging_s = coupled_work(
    traces,
    offsets,
    paces,
    quorum=system.quorum,
    slack_s=system.overlap_slack_s,
    horizon_s=horizon_s,
  )
  return Result(
    system=system.name,
    learners=system.learners,
    chips=int(chips),
    goodput=float(work / ideal),
    uptime=merging_s / horizon_s,
    useful_chip_hours=float(work * fleet.slice_chips / 3600.0),
    failures=sum(tr.failures for tr in traces),
    reconfigurations=sum(tr.reconfigurations for tr in traces),
  )


def run_table(
  systems: Sequence[System],
  chips: Sequence[int],
  *,
  fleet: Fleet,
  costs: Costs,
  seed: int = 0,
) -> list[Result]:
  """Simulates every system on every fleet size.

  Args:
    systems: systems to simulate.
    chips: fleet sizes.
    fleet: failure, recovery and speed model.
    costs: pause lengths.
    seed: random seed.

  Returns:
    One result per (system, chips), systems outermost.
  """
  return [
    simulate(system, chips=n, fleet=fleet, costs=costs, seed=seed)
    for system in systems
    for n in chips
  ]


__all__ = ["coupled_work", "run_table", "simulate"]
