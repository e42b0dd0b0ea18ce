"""Tests for the fleet-scale goodput simulator (docs/algorithm.md §7)."""

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from ddiloco.goodput import fleet as goodput
from ddiloco.goodput import job as goodput_job
from ddiloco.goodput import model as goodput_model
from ddiloco.goodput.model import (
  Costs,
  DataParallel,
  DecoupledDiLoCo,
  Fleet,
  RecoveryDelay,
  Scavenging,
)

_FAIL, _RECOVER = 0, 1
_CHIPS = goodput_model.PAPER_CHIPS


@pytest.fixture(scope="module")
def paper_table() -> np.ndarray:
  """The fitted defaults' table (percent), shaped like docs/algorithm.md §7's; ~1 s."""
  results = goodput.run_table(
    goodput_model.paper_systems(), _CHIPS, fleet=Fleet(), costs=Costs(), seed=0
  )
  return 100 * np.array([r.goodput for r in results]).reshape(6, 5)


def _play(events, *, slices=4, horizon_s=1000.0, elastic=True, window=160.0, ckpt=None):
  times, kinds, ids = (np.array(x) for x in zip(*events)) if events else ([], [], [])
  costs = Costs(detection_s=20, downscale_s=1, upscale_s=17, restart_s=40)
  return goodput_job.play_events(
    np.asarray(times, dtype=np.float64),
    np.asarray(kinds, dtype=np.int8),
    np.asarray(ids, dtype=np.int64),
    speeds=np.ones(slices),
    horizon_s=horizon_s,
    failure_pause_s=costs.detection_s + (costs.downscale_s if elastic else costs.restart_s),
    rejoin_pause_s=costs.upscale_s if elastic else costs.restart_s,
    rejoin_window_s=window,
    checkpoint_interval_s=ckpt,
  )


def test_job_without_events_runs_throughout():
  trace = _play([])
  assert trace.work == 4000.0  # 4 slices x 1000 s
  assert trace.up_time == 1000.0
  assert (trace.failures, trace.reconfigurations) == (0, 0)


def test_elastic_failure_then_rejoin_after_the_window():
  # Slice 0 fails at 100: pause 20 + 1 until 121, then 3 slices. It recovers at 300 and waits
  # the 160 s window: upscale pause [460, 477), then 4 slices again.
  trace = _play([(100.0, _FAIL, 0), (300.0, _RECOVER, 0)])
  assert trace.work == 100 * 4 + (460 - 121) * 3 + (1000 - 477) * 4  # 3509 slice-seconds
  assert trace.up_time == 100 + (460 - 121) + (1000 - 477)  # 962 s
  assert (trace.failures, trace.reconfigurations) == (1, 2)


def test_failure_before_the_window_re_admits_for_free():
  # Slice 0 recovers at 300 (deadline 460); slice 1 fails at 400: the downscale [400, 421)
  # also re-admits slice 0, so no upscale follows.
  trace = _play([(100.0, _FAIL, 0), (300.0, _RECOVER, 0), (400.0, _FAIL, 1)])
  assert trace.work == 100 * 4 + (400 - 121) * 3 + (1000 - 421) * 3  # 2974
  assert trace.reconfigurations == 2


def test_failures_during_a_pause_are_folded_into_it():
  # Slice 1 fails during the pause [100, 121) of slice 0: same pause, 2 slices after it.
  trace = _play([(100.0, _FAIL, 0), (110.0, _FAIL, 1)])
  assert trace.work == 100 * 4 + (1000 - 121) * 2  # 2158
  assert (trace.failures, trace.reconfigurations) == (2, 1)


def test_restart_rolls_back_to_the_last_checkpoint():
  # No elasticity: pause 20 + 40 after the failure at 100; checkpoints every 30 s of running
  # time, so 100 mod 30 = 10 s of 4 slices are lost.
  trace = _play([(100.0, _FAIL, 0)], elastic=False, ckpt=30.0)
  assert trace.lost_work == 40.0
  assert trace.work == 100 * 4 + (1000 - 160) * 3 - 40  # 2880


def test_slowest_slice_sets_the_pace():
  times = np.array([100.0])
  trace = goodput_job.play_events(
    times,
    np.array([_FAIL], np.int8),
    np.array([2]),
    speeds=np.array([1.0, 0.9, 0.5, 1.1]),
    horizon_s=200.0,
    failure_pause_s=0.0,
    rejoin_pause_s=0.0,
    rejoin_window_s=math.inf,
    checkpoint_interval_s=None,
  )
  # 4 slices at the slowest pace 0.5, then 3 at 0.9 once slice 2 (0.5) is gone.
  assert trace.work == pytest.approx(100 * 4 * 0.5 + 100 * 3 * 0.9)


def test_recovery_sampler_matches_scipy():
  rec = RecoveryDelay(a=2.0, c=0.7, scale_s=300.0)
  x = rec.sample(np.random.default_rng(0), 200_000)
  q = [0.1, 0.5, 0.9, 0.99]
  np.testing.assert_allclose(
    np.quantile(x, q), stats.exponweib.ppf(q, 2.0, 0.7, scale=300.0), rtol=0.03
  )
  assert rec.mean_s == pytest.approx(stats.exponweib.mean(2.0, 0.7, scale=300.0))


def test_slice_events_follow_poisson_failures():
  fleet = Fleet(chip_mtbi_hours=100.0)  # a 256-chip slice fails every 100/256 h
  times, kinds, ids = goodput_job.slice_events(
    slices=50, horizon_s=fleet.horizon_s, fleet=fleet, rng=np.random.default_rng(1)
  )
  assert np.all(np.diff(times) >= 0) and np.all(times < fleet.horizon_s)
  # Expected: 50 slices x 168 h / (100/256 h + mean recovery) failures.
  up_s = 100 * 3600 / 256
  expected = 50 * fleet.horizon_s / (up_s + fleet.recovery.mean_s)
  assert abs(np.sum(kinds == _FAIL) - expected) < 4 * math.sqrt(expected)
  # Per slice, failures and recoveries alternate, starting with a failure.
  for s in range(50):
    k = kinds[ids == s]
    assert np.all(k[::2] == _FAIL) and np.all(k[1::2] == _RECOVER)


def _all_systems():
  return [
    *goodput_model.paper_systems(),
    DecoupledDiLoCo(name="K=M", learners=4, quorum=4),
    DecoupledDiLoCo(name="hetero", learners=2, quorum=2, learner_speeds=(1.0, 1 / 1.18)),
  ]


@pytest.mark.parametrize("system", _all_systems(), ids=lambda s: s.name)
def test_no_failures_gives_full_goodput(system):
  fleet = Fleet(chip_mtbi_hours=math.inf, slice_speed_cv=0.0, horizon_hours=24)
  result = goodput.simulate(system, chips=16 * 256, fleet=fleet, costs=Costs())
  if system.name == "hetero":
    # K = M: the fast learner runs at the slow one's pace: (1/1.18 + 1/1.18) / (1 + 1/1.18).
    assert result.goodput == pytest.approx(2 / (1 + 1.18))
  else:
    assert result.goodput == pytest.approx(1.0)
  assert result.uptime == pytest.approx(1.0)
  assert result.failures == 0


def test_speed_spread_alone_costs_the_slowest_slices_lag():
  # No failures: a synchronous job of n slices runs at its slowest slice's pace, about
  # 1 - cv * E[max of n standard normals]; E[max] = 3.08 for 586 slices, 2.13 for 37.
  fleet = Fleet(chip_mtbi_hours=math.inf, slice_speed_cv=0.01, horizon_hours=1)
  dp = goodput.simulate(
    DataParallel(name="dp", elastic=True), chips=150_000, fleet=fleet, costs=Costs()
  )
  m16 = goodput.simulate(
    DecoupledDiLoCo(name="m16", learners=16), chips=150_000, fleet=fleet, costs=Costs()
  )
  assert dp.goodput == pytest.approx(1 - 0.01 * 3.08, abs=0.005)
  assert m16.goodput == pytest.approx(1 - 0.01 * 2.13, abs=0.004)
  assert dp.uptime == m16.uptime == 1.0


def test_one_learner_equals_elastic_data_parallel():
  fleet = Fleet()
  for chips in (150_000, 1_200_000):
    dp = goodput.simulate(
      DataParallel(name="x", elastic=True), chips=chips, fleet=fleet, costs=Costs(), seed=3
    )
    diloco = goodput.simulate(
      DecoupledDiLoCo(name="x", learners=1), chips=chips, fleet=fleet, costs=Costs(), seed=3
    )
    assert dataclasses.replace(diloco, learners=1) == dp


def test_goodput_falls_with_chips_and_rises_with_learners(paper_table):
  # Rows: no elasticity, elastic, M = 2, 4, 8, 16; columns: 150k ... 2.4M chips.
  assert np.all(np.diff(paper_table, axis=1) < 0)
  assert np.all(np.diff(paper_table, axis=0) > 0)


def test_fitted_defaults_reproduce_the_paper_table(paper_table):
  paper = np.array([row for _, _, row in goodput_model.PAPER_GOODPUT])
  err = np.abs(paper_table - paper)
  assert err.max() <= 3.0, f"worst cell off by {err.max():.2f} points:\n{paper_table.round(1)}"


def test_rule_of_thumb_emerges(paper_table):
  # M learners on N chips ~ one elastic job on N/M chips: M = 2 on 300k vs elastic on 150k, etc.
  elastic = paper_table[1]
  for row, m in ((2, 2), (3, 4), (4, 8), (5, 16)):
    shift = int(math.log2(m))
    np.testing.assert_allclose(paper_table[row, shift:], elastic[: 5 - shift], atol=1.0)


def test_same_seed_same_results_other_seed_differs():
  system = DecoupledDiLoCo(name="m4", learners=4)

  def run(seed):
    return goodput.simulate(system, chips=300_000, fleet=Fleet(), costs=Costs(), seed=seed)

  assert run(7) == run(7)
  assert run(7).goodput != run(8).goodput


def test_coupled_work_quorum_and_slack():
  def trace(starts, ends):
    return goodput_job.JobTrace(
      np.array(starts, float), np.array(ends, float), np.ones(len(starts)), 0.0, 1.0, 0, 0
    )

  a, b = trace([0], [100]), trace([0, 60], [50, 100])
  offsets, paces = np.zeros(2), np.ones(2)
  # K = 1: nobody waits: 100 + 90 slice-seconds; the syncer merges throughout.
  assert goodput.coupled_work([a, b], offsets, paces, quorum=1, slack_s=2, horizon_s=100) == (
    190.0,
    100.0,
  )
  # K = 2: during [50, 60) A keeps going for the 2 s of slack, then blocks: 52 + 40 + 90.
  assert goodput.coupled_work([a, b], offsets, paces, quorum=2, slack_s=2, horizon_s=100) == (
    pytest.approx(182.0),
    90.0,
  )


def test_heterogeneous_learners_wait_only_with_a_large_quorum():
  speeds = (1.0, 1.0, 1 / 1.18, 1 / 1.18)
  fleet = Fleet(chip_mtbi_hours=math.inf, slice_speed_cv=0.0, horizon_hours=10)
  costs = Costs()
  k1, k4 = (
    goodput.simulate(
      DecoupledDiLoCo(name="h", learners=4, quorum=k, learner_speeds=speeds),
      chips=4 * 256,
      fleet=fleet,
      costs=costs,
    )
    for k in (1, 4)
  )
  assert k1.goodput == pytest.approx(1.0)
  # K = 4: the fast pair runs at 1/1.18: 4/1.18 / (2 + 2/1.18).
  assert k4.goodput == pytest.approx((4 / 1.18) / (2 + 2 / 1.18))


def test_scavenged_learners_add_their_work():
  fleet = Fleet(chip_mtbi_hours=math.inf, slice_speed_cv=0.0, horizon_hours=10)
  base = DecoupledDiLoCo(name="base", learners=2)
  scav = dataclasses.replace(
    base, scavenging=Scavenging(learners=2, chips_fraction=1.0, start_hours=2, duration_hours=4)
  )
  r0 = goodput.simulate(base, chips=2048, fleet=fleet, costs=Costs())
  r1 = goodput.simulate(scav, chips=2048, fleet=fleet, costs=Costs())
  assert r0.useful_chip_hours == pytest.approx(2048 * 10)
  assert r1.useful_chip_hours == pytest.approx(2048 * 10 + 2048 * 4)
  assert r1.goodput == pytest.approx(1.0)


def test_diloco_keeps_global_progress_where_data_parallel_stops():
  fleet, chips = Fleet(), 1_200_000
  dp = goodput.simulate(
    DataParallel(name="dp", elastic=True), chips=chips, fleet=fleet, costs=Costs()
  )
  m8 = goodput.simulate(
    DecoupledDiLoCo(name="m8", learners=8), chips=chips, fleet=fleet, costs=Costs()
  )
  assert dp.uptime < 0.7
  assert m8.uptime > 0.999


@pytest.mark.parametrize(
  "make",
  [
    lambda: RecoveryDelay(a=0.0),
    lambda: Fleet(slice_chips=0),
    lambda: Fleet(chip_mtbi_hours=0),
    lambda: Costs(detection_s=-1),
    lambda: DataParallel(name="x", elastic=False, checkpoint_interval_s=0),
    lambda: DecoupledDiLoCo(name="x", learners=2, quorum=3),
    lambda: DecoupledDiLoCo(name="x", learners=2, learner_speeds=(1.0,)),
    lambda: Scavenging(learners=0, chips_fraction=1, start_hours=0, duration_hours=1),
  ],
)
def test_invalid_configs_raise(make):
  with pytest.raises(ValueError):
    make()


def test_too_few_chips_for_the_learners_raises():
  with pytest.raises(ValueError, match="slice"):
    goodput.simulate(
      DecoupledDiLoCo(name="x", learners=16), chips=1024, fleet=Fleet(), costs=Costs()
    )
