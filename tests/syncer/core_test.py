"""Tests of ddiloco.syncer.core.SyncerCore on a hand-advanced fake clock (docs/algorithm.md §3, §4)."""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.syncer import merge
from ddiloco.syncer.core import Report, RoundRequest, SyncerConfig, SyncerCore
from ddiloco.syncer.merge_rules import RDA, WeightedMean
from ddiloco.testing import merges as reference

# Two fragments: p0 holds "a" (2x3) and "b" (4,), p1 holds "c" (2,).
KEYS = (("a", "b"), ("c",))
# The round most tests open (`core.open_round(p, ROUND)`) and answer; `rep` answers it by default.
ROUND = 10


class FakeClock:
  def __init__(self, t: float = 0.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


def init_values():
  return {
    "a": np.full((2, 3), 1.5, np.float32),
    "b": np.array([1.0, 1.25, 1.5, 1.75], np.float32),
    "c": np.array([1.0, 1.0], np.float32),
  }


def make_core(clock=None, *, learners=(), fetch=True, schedule=None, **cfg):
  cfg.setdefault("use_grace", False)
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=init_values(),
    config=SyncerConfig(**cfg),
    clock=clock or FakeClock(),
    schedule=schedule,
  )
  for i in learners:
    core.register(i)
    if fetch:
      core.fetch(i, 0)
      core.fetch(i, 1)
  return core


def theta(shift: float, p: int = 0):
  """A learner's params of p: the initial values plus `shift` (values stay in [1, 2) for small shifts)."""
  return {k: v + np.float32(shift) for k, v in init_values().items() if k in KEYS[p]}


def rep(
  learner,
  *,
  p=0,
  values=None,
  tokens=100,
  steps=10,
  anchor=0,
  step=10,
  step_time_s=0.0,
  round_step=ROUND,
):
  return Report(
    learner_id=learner,
    fragment=p,
    values=theta(0.125, p) if values is None else values,
    tokens=tokens,
    steps=steps,
    anchor_version=anchor,
    step=step,
    step_time_s=step_time_s,
    round_step=round_step,
  )


def nesterov_sgd():
  """DiLoCo's outer step: SGD, lr 0.7, Nesterov momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def sgd1():
  """Outer SGD with lr 1 and no momentum: Θ_new = Θ − merged."""
  return {"outer_optimizer": lambda: optax.sgd(1.0)}


def test_register_returns_versions_and_alive():
  core = make_core(learners=(0, 3))
  assert core.register(5) == {0: 0, 1: 0}
  assert core.alive() == frozenset({0, 3, 5})
  core.leave(3)
  assert core.alive() == frozenset({0, 5})
  with pytest.raises(ValueError, match="never registered"):
    core.leave(9)


def test_k1_no_grace_merges_at_first_poll():
  clock = FakeClock(4.0)
  core = make_core(clock, learners=(0,), **sgd1())
  assert core.open_round(0, ROUND) == RoundRequest(0, ROUND, 0)
  assert core.rounds.open_requests() == [RoundRequest(0, ROUND, 0)]
  clock.t = 5.0
  result = core.report(rep(0))
  assert (result.status, result.weight, result.round_version) == ("accepted", 1000.0, 1)  # 100²/10
  assert core.closer.next_deadline() == 5.0
  (event,) = core.closer.poll()
  assert (event.fragment, event.version, event.contributors, event.tokens) == (0, 1, (0,), 100)
  # Opened at 4.0 by open_round; its quorum is the answer at 5.0.
  assert (event.open_time, event.quorum_time, event.grace_s, event.time) == (4.0, 5.0, 0.0, 5.0)
  assert core.version(0) == 1
  assert core.version(1) == 0
  assert event.digest == values_digest(core.state(0).values) == core.state(0).digest
  assert core.closer.poll() == []
  assert core.closer.next_deadline() is None
  assert core.rounds.open_requests() == []
  stats = core.stats()
  assert (stats["quorum_size_counts"], stats["rounds_opened"], stats["open_rounds"]) == (
    {1: 1},
    1,
    0,
  )


def test_open_round_rules():
  core = make_core(learners=(0,))
  assert core.open_round(1, 5) == RoundRequest(1, 5, 0)
  # p1's round is still open: the due round is not opened, and counted as an overrun.
  assert core.open_round(1, 8) is None
  assert core.open_round(0, 3) == RoundRequest(0, 3, 0)  # Each fragment has its own rounds.
  assert core.rounds.open_requests() == [RoundRequest(0, 3, 0), RoundRequest(1, 5, 0)]
  with pytest.raises(
    ValueError, match=r"Round step 5 of fragment 1 is not after its newest round \(5\)"
  ):
    core.open_round(1, 5)
  with pytest.raises(ValueError, match="Unknown fragment 2"):
    core.open_round(2, 9)
  stats = core.stats()
  assert (stats["rounds_opened"], stats["overrun_rounds"], stats["open_rounds"]) == (2, 1, 2)
  # The overrun round 8 was never opened: p1's newest round is still 5, so 6 is not a valid answer.
  result = core.report(rep(0, p=1, round_step=6))
  assert (result.status, result.reason) == ("rejected", "round (1, 6) was never opened")


def test_m1_sgd_lr1_overwrites_with_the_learner_values_exactly():
  # Θ and θ both in [1, 2): Θ − θ is exact in float32 (Sterbenz), the merge of one vector returns it
  # to within float64 rounding (which the float32 cast removes), so Θ − (Θ − θ) == θ bit for bit.
  rng = np.random.default_rng(0)
  values = {k: rng.uniform(1.0, 2.0, v.shape).astype(np.float32) for k, v in theta(0).items()}
  core = make_core(learners=(0,), **sgd1())
  core.open_round(0, ROUND)
  core.report(rep(0, values=values))
  core.closer.poll()
  for k, v in values.items():
    np.testing.assert_array_equal(core.state(0).values[k], v)


def test_bfloat16_parameters_round_trip_exactly():
  bf16 = ml_dtypes.bfloat16
  init = {"w": np.full((3,), 1.5, bf16)}
  core = SyncerCore(
    fragment_keys=[["w"]],
    init_values=init,
    config=SyncerConfig(use_grace=False, **sgd1()),
    clock=FakeClock(),
  )
  core.register(0)
  core.fetch(0, 0)
  core.open_round(0, 1)
  new = np.array([1.25, 1.75, 1.0], bf16)
  core.report(
    Report(
      learner_id=0,
      fragment=0,
      values={"w": new},
      tokens=4,
      steps=1,
      anchor_version=0,
      step=1,
      round_step=1,
    )
  )
  core.closer.poll()
  out = core.state(0).values["w"]
  assert out.dtype == bf16
  np.testing.assert_array_equal(out, new)


def test_k2_waits_for_the_second_report():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=2)
  core.open_round(0, ROUND)
  core.report(rep(0))
  clock.t = 100.0
  assert core.closer.poll() == []
  assert core.closer.next_deadline() is None
  core.report(rep(1))
  # Learner 2 is alive and received p0 but has not reported; no grace, so the deadline is the quorum.
  assert core.closer.next_deadline() == 100.0
  (event,) = core.closer.poll()
  assert event.contributors == (0, 1)
  assert (event.open_time, event.quorum_time) == (0.0, 100.0)


@pytest.mark.parametrize("tau", [2, 1])
def test_grace_deadline_is_exact_on_the_fake_clock(tau):
  # τ is the run's schedule's: the window spends the slack of τ steps.
  clock = FakeClock(9.0)
  core = make_core(
    clock,
    learners=(0, 1, 2),
    min_quorum=2,
    use_grace=True,
    grace_gamma=0.8,
    schedule=FragmentSchedule(num_fragments=2, period=3, overlap=tau),
  )
  core.open_round(0, ROUND)  # Opened at 9.0.
  clock.t = 10.0
  core.report(rep(0, step_time_s=1.0))  # The round's first answer at 10.0; ξ_step = 1.0
  clock.t = 10.5
  core.report(rep(1, step_time_s=1.0))  # Quorum at 10.5; ξ_sync unknown = 0.
  # ξ_quorum is timed from the round's first answer (10.0), not its opening (9.0): 0.5, not 1.5
  # (docs/algorithm.md, "Quorum and grace window"). window = 0.8 * (τ*1.0 - 0.5 - 0), 1.2 at τ = 2;
  # learner 2 has not reported, so no early close.
  deadline = 10.5 + 0.8 * (tau * 1.0 - 0.5)
  assert core.closer.next_deadline() == deadline
  clock.t = np.nextafter(deadline, 0.0)
  assert core.closer.poll() == []
  clock.t = deadline
  (event,) = core.closer.poll()
  assert event.grace_s == pytest.approx(0.8 * (tau - 0.5))
  assert (event.open_time, event.quorum_time, event.time) == (9.0, 10.5, deadline)


def test_grace_max_caps_the_window():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1), use_grace=True, grace_max_s=3.0)
  core.open_round(0, ROUND)
  core.report(rep(0, step_time_s=100.0))  # 0.8 * 2 * 100 = 160 > 3
  assert core.closer.next_deadline() == 3.0


def test_early_close_when_every_alive_receiver_has_reported():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1), use_grace=True)
  core.register(2)  # alive but never received p0: weighs 0, so nobody waits for it
  core.open_round(0, ROUND)
  core.report(rep(0, step_time_s=5.0))  # window = min(0.8 * 2 * 5, 10) = 8
  assert core.closer.next_deadline() == 8.0
  assert core.closer.poll() == []
  clock.t = 1.0
  core.report(rep(1))
  assert core.closer.next_deadline() == 1.0  # due now
  (event,) = core.closer.poll()
  assert event.contributors == (0, 1)
  assert event.time == 1.0


def test_early_close_when_the_missing_learner_leaves():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1), use_grace=True)
  core.open_round(0, ROUND)
  core.report(rep(0, step_time_s=5.0))
  assert core.closer.poll() == []
  core.leave(1)
  (event,) = core.closer.poll()
  assert event.contributors == (0,)


def test_k_equals_m_with_a_dead_learner_stalls():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=3)
  core.leave(2)
  core.open_round(0, ROUND)
  core.report(rep(0))
  core.report(rep(1))
  clock.t = 1e6
  assert core.closer.poll() == []
  assert core.closer.next_deadline() is None
  assert core.version(0) == 0
  assert core.stats()["open_rounds"] == 1
  # p0's next due round cannot open while this one waits: an overrun, every period.
  assert core.open_round(0, 2 * ROUND) is None
  assert core.stats()["overrun_rounds"] == 1
  assert core.rounds.open_requests() == [RoundRequest(0, ROUND, 0)]


def test_k1_keeps_advancing_with_a_dead_learner():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=1)
  core.leave(2)
  for v in range(3):
    s = 10 * (v + 1)
    assert core.open_round(0, s) == RoundRequest(0, s, v)
    for i in (0, 1):
      assert core.fetch(i, 0).version == v
      assert core.report(rep(i, anchor=v, step=s, round_step=s)).status == "accepted"
    clock.t += 1.0
    (event,) = core.closer.poll()
    assert (event.version, event.contributors) == (v + 1, (0, 1))
  assert core.stats()["versions"] == [3, 0]
  assert core.stats()["quorum_size_counts"] == {2: 3}
  assert core.stats()["mean_quorum_size"] == 2.0


def test_report_before_death_stays_in_its_round():
  core = make_core(learners=(0, 1), min_quorum=2)
  core.open_round(0, ROUND)
  core.report(rep(1))
  core.leave(1)
  core.report(rep(0))
  (event,) = core.closer.poll()
  assert event.contributors == (0, 1)


def test_an_answer_to_a_closed_round_is_late_and_opens_nothing():
  core = make_core(learners=(0, 1), **sgd1())
  core.open_round(0, ROUND)
  core.report(rep(0))
  (event,) = core.closer.poll()
  assert event.version == 1
  core.fetch(1, 0)  # Learner 1 even holds the new version: its answer is still to a closed round.
  digest = core.state(0).digest
  late = dataclasses.replace(rep(1, tokens=70, anchor=1), new_tokens=30)
  result = core.report(late)
  assert (result.status, result.reason, result.weight) == ("late", "round (0, 10) is closed", 0.0)
  assert core.rounds.late_reason(0, ROUND) == "round (0, 10) is closed"
  stats = core.stats()
  assert (stats["late"], stats["dropped_tokens"], stats["open_rounds"], stats["rounds_opened"]) == (
    1,
    70,
    0,
    1,
  )
  assert (stats["accepted"], stats["merges"], stats["zero_weight_reports"]) == (1, 1, 0)
  # It opened no round: nothing to merge, ever.
  assert core.rounds.open_requests() == []
  assert core.closer.poll() == []
  assert core.closer.next_deadline() is None
  assert (core.version(0), core.state(0).digest) == (1, digest)
  assert core.ledger()["learners"][1] == {"received": 30, "merged": 0, "dropped": 30, "pending": 0}
  # An answer to an older round while a newer one is open is late too, and leaves the open one alone.
  assert core.open_round(0, 13) == RoundRequest(0, 13, 1)
  assert core.rounds.late_reason(0, 13) is None
  result = core.report(dataclasses.replace(late, new_tokens=5))
  assert (result.status, result.reason) == ("late", "round (0, 10) is closed")
  assert core.rounds.open_requests() == [RoundRequest(0, 13, 1)]
  book = core.ledger()
  assert (book["received"], book["dropped"], book["pending"]) == (35, 35, 0)
  assert (core.stats()["late"], core.stats()["dropped_tokens"]) == (2, 140)
  assert (core.version(0), core.state(0).digest) == (1, digest)


def test_an_answer_to_a_round_never_opened_is_rejected():
  core = make_core(learners=(0,), **sgd1())
  # No round of p0 was ever opened: no answer can be to one.
  for round_step in (-1, 0, ROUND):
    result = core.report(rep(0, round_step=round_step))
    assert (result.status, result.weight) == ("rejected", 0.0)
    assert result.reason == f"round (0, {round_step}) was never opened"
  assert core.rounds.open_requests() == []
  core.open_round(0, ROUND)
  before = core.state_dict()
  # Past p0's newest round: the answer is to a round that does not exist (yet).
  result = core.report(dataclasses.replace(rep(0, round_step=ROUND + 1), new_tokens=50))
  assert (result.status, result.reason) == ("rejected", "round (0, 11) was never opened")
  after = core.state_dict()
  assert after["stats/rejected"] == before["stats/rejected"] + 1 == 4
  after["stats/rejected"] = before["stats/rejected"]
  _assert_state_dicts_equal(after, before)  # Untouched: no round, no ledger, no EMA moved.
  assert core.rounds.open_requests() == [RoundRequest(0, ROUND, 0)]
  stats = core.stats()
  assert (stats["accepted"], stats["late"], stats["rounds_opened"], stats["versions"]) == (
    0,
    0,
    1,
    [0, 0],
  )
  assert core.ledger()["received"] == 0


def test_an_answer_anchored_off_the_round_base_weighs_zero():
  """v_m = Θ^(base) − θ_m: an answer holding another version would move Θ by the wrong difference.

  Outer SGD lr 1, mean. Round 10: learner 0 sends init + 0.125 -> Θ1 = init + 0.125. Round 13 is
  opened on version 1. Learner 1 still holds version 0 and sends init + 0.25: weight 0, so it
  neither counts toward K = 1 nor touches the merge. Learner 0 (anchor 1) sends init + 0.375:
  Θ2 = Θ1 − (Θ1 − θ0) = init + 0.375 exactly.
  """
  core = make_core(learners=(0, 1), merge_rule=WeightedMean(), **sgd1())
  core.open_round(0, ROUND)
  core.report(rep(0, values=theta(0.125)))
  core.closer.poll()
  core.fetch(0, 0)
  assert core.open_round(0, 13) == RoundRequest(0, 13, 1)
  stale = rep(1, values=theta(0.25), anchor=0, tokens=70, round_step=13)
  result = core.report(dataclasses.replace(stale, new_tokens=70))
  assert (result.status, result.weight, result.round_version) == ("accepted", 0.0, -1)
  assert (
    result.reason == "weight 0: answered against version 0; round (0, 13) is based on version 1"
  )
  assert core.closer.poll() == []
  assert core.closer.next_deadline() is None
  stats = core.stats()
  assert (stats["zero_weight_reports"], stats["zero_weight_tokens"]) == (1, 70)
  book = core.ledger()
  assert (book["dropped"], book["pending"]) == (70, 0)
  # The same learner answering again, now at the base, is not a duplicate: weight 0 filed nothing.
  core.fetch(1, 0)
  assert core.report(rep(1, values=theta(0.375), anchor=1, round_step=13)).weight == 1000.0
  core.report(rep(0, values=theta(0.375), anchor=1, round_step=13))
  (event,) = core.closer.poll()
  assert (event.version, event.contributors, event.weights) == (2, (0, 1), (1000.0, 1000.0))
  for k, v in core.state(0).values.items():
    np.testing.assert_array_equal(v, init_values()[k] + np.float32(0.375))


def test_duplicate_and_superseded():
  core = make_core(learners=(0, 1), min_quorum=2, **sgd1(), merge_rule=WeightedMean())
  core.open_round(0, ROUND)
  first = core.report(rep(0, step=10, values=theta(0.125)))
  assert first.status == "accepted"
  # The same answer again (same counters: a retry after a lost reply) gets the first one's result
  # and is filed once.
  again = core.report(rep(0, step=10))
  assert (again.status, again.weight, again.round_version) == ("accepted", first.weight, 1)
  dup = core.report(rep(0, step=11))
  assert (dup.status, dup.reason, dup.weight) == (
    "duplicate",
    "learner 0 already answered round (0, 10)",
    0.0,
  )
  # One answer per learner and round: a later step of the same registration is a duplicate too.
  assert core.report(rep(0, step=12, tokens=200, values=theta(0.25))).status == "duplicate"
  # A restarted learner (new registration) supersedes its lost process's answer, whatever its step.
  core.register(0)
  core.fetch(0, 0)
  newer = core.report(rep(0, step=3, tokens=100, values=theta(0.5)))
  assert (newer.status, newer.weight) == ("superseded", 1000.0)
  assert core.report(rep(0, step=4)).status == "duplicate"  # Its second answer in that epoch.
  core.report(rep(1, tokens=100, values=theta(0.5)))
  (event,) = core.closer.poll()
  assert event.weights == (1000.0, 1000.0)
  assert event.tokens == 200
  # Both survivors are theta(0.5): mean = theta(0.5); lr 1 gives it back exactly.
  np.testing.assert_array_equal(core.state(0).values["a"], theta(0.5)["a"])
  stats = core.stats()
  assert (stats["accepted"], stats["superseded"], stats["duplicate"], stats["replayed"]) == (
    2,
    1,
    3,
    1,
  )


def test_weight_zero_learner_never_changes_the_global_state():
  clock = FakeClock()
  core = make_core(clock, learners=(0,), fetch=False, **sgd1())
  core.open_round(0, ROUND)
  digest = core.state(0).digest
  # Never received p0: weight 0 whatever its anchor and counters say (docs/algorithm.md §3).
  for anchor in (-1, 0):
    result = core.report(rep(0, anchor=anchor, values=theta(0.5), tokens=10**6))
    assert (result.status, result.weight) == ("accepted", 0.0)
  core.fetch(0, 0)
  # Received, but claims it never applied p0: still weight 0.
  assert core.report(rep(0, anchor=-1, values=theta(0.5))).weight == 0.0
  clock.t = 1e6
  assert core.closer.poll() == []
  assert core.closer.next_deadline() is None
  assert (core.version(0), core.state(0).digest) == (0, digest)
  assert core.stats()["zero_weight_reports"] == 3
  assert core.stats()["zero_weight_tokens"] == 2 * 10**6 + 100
  # Re-registering forgets the delivery: weight 0 again until it fetches.
  core.register(0)
  assert core.report(rep(0)).weight == 0.0
  core.fetch(0, 0)
  assert core.report(rep(0)).weight == 1000.0


def test_zero_counters_give_weight_zero():
  core = make_core(learners=(0,))
  core.open_round(0, ROUND)
  assert core.report(rep(0, tokens=0, steps=0)).weight == 0.0
  assert core.closer.poll() == []


def test_mark_delivered_counts_as_received():
  core = make_core(learners=(0,), fetch=False)
  core.mark_delivered(0, 0, 0)
  core.open_round(0, ROUND)
  assert core.report(rep(0)).weight == 1000.0
  with pytest.raises(ValueError, match="does not exist"):
    core.mark_delivered(0, 0, 1)


def _bad(field, value):
  return lambda: dataclasses.replace(rep(0), **{field: value})


def _bad_values(mutate):
  def make():
    values = theta(0.125)
    mutate(values)
    return rep(0, values=values)

  return make


BAD_REPORTS = {
  "unknown fragment": (_bad("fragment", 2), "unknown fragment 2"),
  "unregistered": (_bad("learner_id", 7), "learner 7 is not registered"),
  "dead": (_bad("learner_id", 1), "learner 1 is not alive"),
  "missing key": (_bad_values(lambda v: v.pop("b")), "missing ['b']"),
  "extra key": (_bad_values(lambda v: v.update(c=np.zeros(2, np.float32))), "extra ['c']"),
  "shape": (_bad_values(lambda v: v.update(b=np.zeros(5, np.float32))), "'b' is float32[5]"),
  "dtype": (_bad_values(lambda v: v.update(b=np.zeros(4))), "'b' is float64[4]"),
  "nan": (_bad_values(lambda v: v["a"].__setitem__((0, 0), np.nan)), "'a' has non-finite"),
  "inf": (_bad_values(lambda v: v["b"].__setitem__(1, np.inf)), "'b' has non-finite"),
  "negative tokens": (_bad("tokens", -1), "negative counter"),
  "negative steps": (_bad("steps", -1), "negative counter"),
  "non-int step": (_bad("step", 1.5), "step must be an integer"),
  "bad step time": (_bad("step_time_s", float("nan")), "step_time_s"),
  "anchor ahead": (_bad("anchor_version", 1), "anchor_version 1 outside [-1, 0]"),
  "anchor below -1": (_bad("anchor_version", -2), "anchor_version -2"),
  "non-int round": (_bad("round_step", 10.0), "round_step must be an integer"),
  "round never opened": (_bad("round_step", ROUND + 1), "round (0, 11) was never opened"),
  "no round": (_bad("round_step", -1), "round (0, -1) was never opened"),
}


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_rejections_leave_the_state_untouched(case):
  make, reason = BAD_REPORTS[case]
  core = make_core(learners=(0, 1))
  core.leave(1)
  core.open_round(0, ROUND)
  before = [core.state(p).digest for p in range(2)]
  result = core.report(make())
  assert (result.status, result.weight) == ("rejected", 0.0)
  assert reason in result.reason
  assert core.closer.poll() == []
  assert [core.state(p).digest for p in range(2)] == before
  assert core.rounds.open_requests() == [RoundRequest(0, ROUND, 0)]
  stats = core.stats()
  assert (stats["rejected"], stats["accepted"], stats["open_rounds"], stats["versions"]) == (
    1,
    0,
    1,
    [0, 0],
  )
  assert core.ledger()["received"] == 0


def test_outer_step_matches_optax_sgd_nesterov_over_two_rounds():
  core = make_core(learners=(0, 1), min_quorum=2, outer_optimizer=nesterov_sgd)
  opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  params = {k: v for k, v in init_values().items() if k in KEYS[0]}
  opt_state = opt.init(params)
  trace = {k: np.zeros(v.shape) for k, v in params.items()}  # float64 hand version of the momentum
  hand = {k: v.astype(np.float64) for k, v in params.items()}
  rng = np.random.default_rng(1)
  for v in range(2):
    s = 10 * (v + 1)
    core.open_round(0, s)
    thetas = [
      {
        k: (x + rng.normal(0, 0.1, x.shape)).astype(np.float32)
        for k, x in core.state(0).values.items()
      }
      for _ in range(2)
    ]
    for i in (0, 1):
      core.fetch(i, 0)
      core.report(rep(i, values=thetas[i], anchor=v, step=s, round_step=s, tokens=100 * (i + 1)))
    glob = core.state(0).values
    grads = [{k: glob[k] - t[k] for k in glob} for t in thetas]
    merged = reference.merge_outer_gradients(grads, [1000.0, 4000.0])  # 100²/10, 200²/10
    updates, opt_state = opt.update(merged, opt_state, params)
    params = optax.apply_updates(params, updates)
    # Nesterov by hand: trace ← g + 0.9 trace; Θ ← Θ − 0.7 (g + 0.9 trace).
    for k, h in list(hand.items()):
      g = merged[k].astype(np.float64)
      trace[k] = g + 0.9 * trace[k]
      hand[k] = h - 0.7 * (g + 0.9 * trace[k])
    (event,) = core.closer.poll()
    assert event.weights == (1000.0, 4000.0)
    for k, h in hand.items():
      np.testing.assert_allclose(core.state(0).values[k], params[k], rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(core.state(0).values[k], h, rtol=1e-5, atol=1e-6)
  # Momentum matters: round 2 differs from a momentum-free step from the same point.
  assert not np.allclose(trace["a"], merged["a"])


def test_token_weights_shape_the_mean():
  core = make_core(learners=(0, 1), min_quorum=2, merge_rule=WeightedMean(), **sgd1())
  core.open_round(0, ROUND)
  theta1 = theta(0.0)
  theta1["a"][0, 0] += (
    0.25  # not collinear with learner 0's shift, so RDA would differ from the mean
  )
  # Same steps, 2x tokens: weight 200²/10 = 4000 vs 100²/10 = 1000, i.e. 4x.
  r0 = core.report(rep(0, tokens=200, values=theta(0.5)))
  r1 = core.report(rep(1, tokens=100, values=theta1))
  assert (r0.weight, r1.weight) == (4000.0, 1000.0)
  core.closer.poll()
  # Θ − (0.8 (Θ − θ0) + 0.2 (Θ − θ1)) = 0.8 θ0 + 0.2 θ1 = Θ + 0.8*0.5 (+ 0.2*0.25 at [0, 0]).
  expected = np.full((2, 3), 1.9)
  expected[0, 0] = 1.95
  np.testing.assert_allclose(core.state(0).values["a"], expected, rtol=1e-6)
  assert core.stats()["merged_tokens"] == 300


@pytest.mark.parametrize(
  ("embedding_keys", "expected"), [({"c"}, 1.25), ((), 1 + 0.5 / np.sqrt(2))]
)
def test_embedding_keys_use_the_mean(embedding_keys, expected):
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=init_values(),
    config=SyncerConfig(min_quorum=2, use_grace=False, merge_rule=RDA(), **sgd1()),
    clock=FakeClock(),
    embedding_keys=embedding_keys,
  )
  core.open_round(1, ROUND)
  for i, c in enumerate(([1.5, 1.0], [1.0, 1.5])):
    core.register(i)
    core.fetch(i, 1)
    core.report(rep(i, p=1, values={"c": np.array(c, np.float32)}))
  core.closer.poll()
  # Outer gradients [-0.5, 0] and [0, -0.5], equal weights. Mean: [-0.25, -0.25] -> Θ = 1.25.
  # RDA: radius 0.5, direction -[1, 1]/√2 -> Θ = 1 + 0.5/√2 ≈ 1.3536.
  np.testing.assert_allclose(core.state(1).values["c"], [expected, expected], rtol=1e-6)


def test_keep_versions():
  core = make_core(learners=(0,), keep_versions=2)
  for v in range(3):
    core.fetch(0, 0)
    core.open_round(0, v + 1)
    core.report(rep(0, anchor=v, step=v + 1, round_step=v + 1))
    core.closer.poll()
  assert core.state_at(0, 3).digest == core.state(0).digest
  assert core.state_at(0, 2).version == 2
  with pytest.raises(KeyError, match="not kept"):
    core.state_at(0, 1)


def _scenario(clock):
  """A core with history, momentum, two open rounds, a dead learner and EMAs set."""
  core = make_core(clock, learners=(0, 1, 2), min_quorum=2, use_grace=True, keep_versions=2)
  for v in range(3):
    s = 10 * (v + 1)
    clock.t += 1.0
    core.open_round(0, s)
    for i in (0, 1):
      core.fetch(i, 0)
      values = theta(0.1 * (i + 1) + 0.01 * v)
      core.report(rep(i, values=values, anchor=v, step=s + 1, round_step=s, step_time_s=0.5))
    clock.t += 5.0
    assert len(core.closer.poll()) == 1
  core.fetch(0, 0)
  core.open_round(0, 40)  # Open on version 3, below quorum.
  core.report(rep(0, values=theta(0.3), anchor=3, step=41, round_step=40, tokens=50))
  core.leave(2)
  core.grace.observe_sync_time(0.25)
  # p1: quorum met, grace window running (learner 3 received p1 and has not reported).
  core.register(3)
  core.fetch(3, 1)
  core.open_round(1, 20)
  for i in (0, 1):
    core.report(
      rep(i, p=1, values=theta(0.05 * (i + 1), 1), step=21, round_step=20, step_time_s=0.5)
    )
  return core


def _assert_state_dicts_equal(a, b):
  assert sorted(a) == sorted(b)
  for k in a:
    x, y = np.asarray(a[k]), np.asarray(b[k])
    assert x.dtype == y.dtype, k
    np.testing.assert_array_equal(x, y, err_msg=k)


def test_state_dict_round_trip_is_exact_and_continues_identically():
  clock_a, clock_b = FakeClock(), FakeClock()
  core_a = _scenario(clock_a)
  sd = core_a.state_dict()
  assert sd["fragment/0/version"] == 3
  assert (sd["fragment/0/round/step"], sd["fragment/0/round/base_version"]) == (40, 3)
  assert (sd["fragment/1/round/step"], sd["fragment/1/round/base_version"]) == (20, 0)
  core_b = make_core(clock_b, use_grace=True, min_quorum=2, keep_versions=2)
  core_b.load_state_dict(sd)
  _assert_state_dicts_equal(core_b.state_dict(), sd)
  assert core_b.alive() == frozenset({0, 1, 3})
  assert (
    core_b.rounds.open_requests()
    == core_a.rounds.open_requests()
    == [
      RoundRequest(0, 40, 3),
      RoundRequest(1, 20, 0),
    ]
  )
  assert core_b.state(0).digest == core_a.state(0).digest
  assert core_b.grace_window() == core_a.grace_window()
  clock_b.t = clock_a.t
  assert (
    core_b.closer.next_deadline() == core_a.closer.next_deadline() > clock_a.t
  )  # p1's grace window
  for core, clock in ((core_a, clock_a), (core_b, clock_b)):
    core.fetch(1, 0)
    result = core.report(rep(1, values=theta(0.2), anchor=3, step=41, round_step=40))
    assert result.status == "accepted"
    # The restored rounds' steps hold: round 30 of p0 is closed.
    assert core.report(rep(0, anchor=3, round_step=30)).status == "late"
    clock.t += 10.0
  events_a, events_b = core_a.closer.poll(), core_b.closer.poll()
  assert events_a == events_b
  assert [(e.fragment, e.version) for e in events_a] == [(0, 4), (1, 1)]
  assert events_a[1].grace_s > 0
  _assert_state_dicts_equal(core_a.state_dict(), core_b.state_dict())
  # Round 41 was never opened. The restored core cannot tell that from a round its lost
  # incarnation opened after the checkpoint, until its clock runs (`tick`): an answer to it is
  # late there (dropped and counted), not refused as invalid.
  assert core_a.report(rep(0, anchor=3, round_step=41)).status == "rejected"
  assert core_b.report(rep(0, anchor=3, round_step=41)).status == "late"


def test_a_restored_core_closes_the_rounds_its_lost_incarnation_may_have_opened():
  """A syncer killed after its checkpoint may have opened rounds the restored one never saw, and
  the learners answer them. Before its first tick they are late; the first tick closes every step
  before its own, and only rounds past the clock are refused as never opened."""
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0, 1), **sgd1())
  core.open_round(0, 10)
  saved = core.state_dict()
  restored = make_core(clock, **sgd1())
  restored.load_state_dict(saved)
  for i in (0, 1):
    restored.register(i)
    restored.fetch(i, 0)
    restored.observe_steps(i, 40, step_time_s=1.0)  # The learners' heartbeats: at step 40.
  # Round (1, 13), opened by the lost incarnation after the checkpoint: late, not invalid.
  answer = rep(1, p=1, values=theta(0.1, 1), step=41, round_step=13)
  assert restored.report(answer).status == "late"
  assert restored.stats()["rejected"] == 0
  restored.pacer.tick()  # The clock starts at step 40: every step before it is closed.
  answer = rep(1, p=1, values=theta(0.1, 1), step=41, round_step=17)
  assert restored.report(answer).status == "late"
  answer = rep(1, p=1, values=theta(0.1, 1), step=41, round_step=500)
  assert restored.report(answer).status == "rejected"
  with pytest.raises(ValueError, match="not after its newest round"):
    restored.open_round(1, 39)
  assert restored.open_round(1, 41) == RoundRequest(1, 41, 0)


def test_load_state_dict_rejects_another_layout():
  core = make_core()
  other = SyncerCore(
    fragment_keys=[["a"], ["b", "c"]],
    init_values=init_values(),
    config=SyncerConfig(),
    clock=FakeClock(),
  )
  with pytest.raises(ValueError, match="different fragment layout"):
    other.load_state_dict(core.state_dict())


def test_constructor_validation():
  with pytest.raises(ValueError, match="more than one fragment"):
    SyncerCore(
      fragment_keys=[["a", "b"], ["b", "c"]],
      init_values=init_values(),
      config=SyncerConfig(),
      clock=FakeClock(),
    )
  with pytest.raises(ValueError, match="disagree"):
    SyncerCore(
      fragment_keys=[["a", "b"]],
      init_values=init_values(),
      config=SyncerConfig(),
      clock=FakeClock(),
    )
  with pytest.raises(ValueError, match="floating"):
    SyncerCore(
      fragment_keys=[["i"]],
      init_values={"i": np.zeros(2, np.int32)},
      config=SyncerConfig(),
      clock=FakeClock(),
    )
  with pytest.raises(
    ValueError, match=r"schedule has 3 fragments \(P=3 x 1 slices\), this syncer 2"
  ):
    make_core(schedule=FragmentSchedule(num_fragments=3, period=4, overlap=2))
  # τ is the schedule's alone: the grace window spends the slack of the schedule's overlap.
  core = make_core(schedule=FragmentSchedule(num_fragments=2, period=4, overlap=1))
  assert core.schedule.overlap == 1
  assert make_core().schedule == FragmentSchedule(num_fragments=2, period=3, overlap=2)


def test_config_validation_and_gin():
  with pytest.raises(ValueError, match="min_quorum"):
    SyncerConfig(min_quorum=0)
  with pytest.raises(ValueError, match="merge_rule must be a MergeRule"):
    SyncerConfig(merge_rule="median")
  # A learner answering a round may still hold the previous version: two versions at least.
  with pytest.raises(ValueError, match="keep_versions must be >= 2"):
    SyncerConfig(keep_versions=1)
  from ddiloco.launch import configurables

  configurables.parse([], ["ddiloco.SyncerConfig.min_quorum = 3"])
  try:
    assert configurables.configured(SyncerConfig)().min_quorum == 3
    assert SyncerConfig().min_quorum == 1  # A direct call ignores gin.
  finally:
    configurables.clear()
  assert configurables.configured(SyncerConfig)().min_quorum == 1


def test_fleet_step_is_the_step_clock():
  """fleet_step is the step clock once it runs; before, the largest step of a weight>0 answer.

  Learner 0 answers round 12 at step 12 (t = 12): the clock starts there. Step times do not move it,
  measured rates do: both learners at 2 steps/s from t = 13 give step 14 at t = 14. A lower step
  never moves it back. A restored core has no clock until a learner is seen again, and then
  restarts it past every round it had opened.
  """
  clock = FakeClock(12.0)
  core = make_core(clock, learners=(0, 1))
  assert (core.pacer.cadence_step(), core.fleet_step()) == (-1, 0)
  core.open_round(0, 12)
  core.report(rep(0, step=12, round_step=12, step_time_s=1.0))
  assert core.fleet_step() == 12
  clock.t = 13.0
  assert core.fleet_step() == 12  # No rate measured yet: the clock holds.
  for i in (0, 1):
    core.observe_steps(i, 50)
  clock.t = 14.0
  for i in (0, 1):
    core.observe_steps(i, 52)
  assert core.fleet_step() == 14
  assert core.report(rep(1, step=7, round_step=12, step_time_s=1.0)).status == "accepted"
  assert core.fleet_step() == 14
  other = make_core(FakeClock(14.0))
  other.load_state_dict(core.state_dict())
  assert (other.pacer.cadence_step(), other.fleet_step()) == (-1, 12)
  other.observe_steps(1, 3)  # A learner restarted from its own older checkpoint.
  assert other.pacer.cadence_step() == 12  # Not 3: past p0's round 12.


def test_cadence_is_a_clock_at_the_median_learner_rate():
  """cadence_step starts at the first answer's schedule step and advances at the median rate of
  the alive learners' own step counts, whatever their schedules do (no feedback)."""
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0, 1, 2))
  assert core.pacer.cadence_step() == -1  # No report yet.
  core.open_round(0, ROUND)
  assert core.pacer.cadence_step() == -1  # Opening a round observes no learner.
  core.report(rep(0, step=10))
  assert core.pacer.cadence_step() == 10
  # Own step counts: learner 0 at 2 steps/s, learner 1 at 4 steps/s, learner 2 at 10 steps/s.
  for i in range(3):
    core.observe_steps(i, 100)
  clock.t = 2.0
  for i, rate in enumerate((2, 4, 10)):
    core.observe_steps(i, 100 + 2 * rate)
  assert core.pacer.cadence_step() == 10 + 2 * 4  # Median rate 4 steps/s over the 2 s since t = 0.
  clock.t = 3.0
  core.leave(1)  # Median of {2, 10} = 6 steps/s from now on.
  assert core.pacer.cadence_step() == 18 + 6
  # A learner's schedule jumping ahead does not move the cadence.
  assert core.report(rep(2, step=500)).status == "accepted"
  assert core.pacer.cadence_step() == 24


def test_observe_steps_ignores_unknown_dead_and_too_frequent_samples():
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0, 1))
  core.leave(1)
  core.observe_steps(7, 10)  # Unknown learner: ignored.
  core.observe_steps(1, 5000)  # Dead learner: ignored.
  assert core.pacer.cadence_step() == -1
  core.observe_steps(0, 10)
  clock.t = 0.5
  core.observe_steps(0, 1000)  # Within min_interval_s: no rate sample.
  clock.t = 1.0
  core.observe_steps(0, 20)
  assert core.pacer.cadence_step() == 20  # The largest step seen; 1000 never was a sample.
  clock.t = 2.0
  assert core.pacer.cadence_step() == 20 + 10  # 10 steps/s from the one valid sample.


def _tick_core(clock):
  """P = 2, H = 4, τ = 2 (p1 due at steps 2, 6, 10, ..., p0 at 4, 8, ...), K = 1, learners 0-2."""
  schedule = FragmentSchedule(num_fragments=2, period=4, overlap=2)
  return make_core(
    clock, learners=(0, 1, 2), schedule=schedule, merge_rule=WeightedMean(), **sgd1()
  )


def _answer(core, request):
  """Learner 0 answers `request` at its base and the round merges at once (K = 1)."""
  p = request.fragment
  result = core.report(
    rep(0, p=p, values=theta(0.125, p), anchor=request.base_version, round_step=request.round_step)
  )
  assert (result.status, result.weight) == ("accepted", 1000.0)
  (event,) = core.closer.poll()
  assert (event.fragment, event.version) == (p, request.base_version + 1)
  core.fetch(0, p)


def test_tick_opens_exactly_the_rounds_due_on_the_step_clock():
  """Learners 0, 1, 2 step at 1, 2 and 4 steps/s from step 1 at t = 0: the clock runs at the median,
  2 steps/s, and reaches step s at t = (s − 1) / 2 (every time here is exact in binary).

  Learner 0 answers every round at once except round (1, 6), which it answers only at step 11: p1's
  round is still open when p1 is due at step 10, so round (1, 10) is not opened (an overrun).
  """
  clock = FakeClock(0.0)
  core = _tick_core(clock)
  assert (core.pacer.cadence_step(), core.pacer.tick(), core.pacer.next_tick_time()) == (
    -1,
    [],
    None,
  )
  for i in range(3):
    core.observe_steps(i, 1)
  assert core.pacer.tick() == []  # Step 1: nothing due.
  assert core.pacer.cadence_step() == 1
  assert core.pacer.next_tick_time() is None  # No rate measured yet: the clock holds.
  clock.t = 1.0
  for i, rate in enumerate((1, 2, 4)):
    core.observe_steps(i, 1 + rate)
  # The first rates cover the second since t = 0: the clock is at step 3, and step 2 is due now.
  assert core.pacer.cadence_step() == 3
  assert core.pacer.next_tick_time() == 1.0
  assert core.pacer.tick() == [RoundRequest(1, 2, 0)]
  _answer(core, RoundRequest(1, 2, 0))
  # By hand: (fragment, step, base version) opened at each step; p1's round 6 overruns step 10.
  expected = {
    4: [RoundRequest(0, 4, 0)],
    5: [],
    6: [RoundRequest(1, 6, 1)],
    7: [],
    8: [RoundRequest(0, 8, 1)],
    9: [],
    10: [],
    11: [],
    12: [RoundRequest(0, 12, 2)],
    13: [],
    14: [RoundRequest(1, 14, 2)],
    15: [],
    16: [RoundRequest(0, 16, 3)],
  }
  overrun = {10: 1}
  held = None  # Round (1, 6) until step 11.
  for step, requests in expected.items():
    t = (step - 1) / 2
    assert core.pacer.next_tick_time() == t
    clock.t = t - 0.25
    assert core.pacer.tick() == []
    clock.t = t
    # Heartbeats: each learner's step at its rate. Learner 1's are exact, so the median stays 2.
    for i, rate in enumerate((1, 2, 4)):
      core.observe_steps(i, int(1 + rate * t))
    opened = core.pacer.tick()
    assert opened == requests
    # Every fragment due at this step got its round, or overran an open one.
    assert {r.fragment for r in opened} | ({1} if step in overrun else set()) == set(
      core.schedule.due(step)
    )
    assert core.stats()["overrun_rounds"] == sum(n for s, n in overrun.items() if s <= step)
    for r in opened:
      if r == RoundRequest(1, 6, 1):
        held = r
      else:
        assert core.rounds.open_requests().count(r) == 1
        _answer(core, r)
    # At most one open round per fragment: only the held one.
    assert core.rounds.open_requests() == ([held] if held else [])
    if step == 11:
      _answer(core, held)
      held = None
  stats = core.stats()
  assert (stats["rounds_opened"], stats["overrun_rounds"], stats["versions"]) == (7, 1, [4, 3])
  # A clock that jumped (a slow tick) opens every round due since, in due order.
  clock.t = (20 - 1) / 2
  assert core.pacer.tick() == [RoundRequest(1, 18, 3), RoundRequest(0, 20, 4)]
  assert core.pacer.next_tick_time() == 10.0


def _run_fleet(*, use_grace, until):
  """Learners 0-2 step every 1.0 s, learner 3 every 1.18 s, from t = 0 (P = 2, H = 4, K = 1).

  Each learner sends a heartbeat (`observe_steps`) at every step boundary and answers there every
  round opened since its previous boundary, at the version it holds (every merge is delivered to
  all at once). Returns the core, the rounds opened as (time, request), the merges, and each
  learner's answer times as {(fragment, round step): {learner: time}}.
  """
  clock = FakeClock(0.0)
  schedule = FragmentSchedule(num_fragments=2, period=4, overlap=2)
  core = make_core(
    clock,
    learners=range(4),
    schedule=schedule,
    use_grace=use_grace,
    merge_rule=WeightedMean(),
    **sgd1(),
  )
  step_s = (1.0, 1.0, 1.0, 1.18)
  inner = [0, 0, 0, 0]
  since = [[0, 0] for _ in range(4)]  # Per learner and fragment: inner step at its last answer.
  held = [[0, 0] for _ in range(4)]  # Per learner and fragment: the version it holds.
  pending = [[] for _ in range(4)]
  for i in range(4):
    core.observe_steps(i, 0)
  opened, merges, answers = [], [], {}
  while clock.t < until:
    boundary = [(inner[i] + 1) * step_s[i] for i in range(4)]
    due = [t for t in (core.pacer.next_tick_time(), core.closer.next_deadline()) if t is not None]
    clock.t = max(min(boundary + due), clock.t)
    for i in range(4):
      if boundary[i] > clock.t:
        continue
      inner[i] += 1
      core.observe_steps(i, inner[i])
      for r in pending[i]:
        p, steps = r.fragment, inner[i] - since[i][r.fragment]
        since[i][p] = inner[i]
        result = core.report(
          rep(
            i,
            p=p,
            values=theta(0.001 * (i + 1), p),
            tokens=100 * steps,
            steps=steps,
            anchor=held[i][p],
            step=inner[i],
            step_time_s=step_s[i],
            round_step=r.round_step,
          )
        )
        answers.setdefault((p, r.round_step), {})[i] = (clock.t, result.status)
      pending[i] = []
    for r in core.pacer.tick():
      opened.append((clock.t, r))
      for i in range(4):
        pending[i].append(r)
    for e in core.closer.poll():
      merges.append(e)
      for i in range(4):
        held[i][e.fragment] = core.fetch(i, e.fragment).version
  return core, opened, merges, answers


def test_a_straggler_joins_every_round_within_the_grace_window():
  """Learner 3 is 18 % slower. The clock runs at the median rate (1 step/s): each fragment is due
  every 4 s. A round opened at t gets the fast learners' answers at t + 1 and learner 3's at its
  next boundary, within t + 1.18. With K = 1 the first answer makes the quorum and fixes the window
  at 0.8 · (2 · ξ_step − 0 − 0) >= 1.6 s (ξ_step >= 1 s, ξ_quorum = 0 for K = 1, ξ_sync = 0 on a
  fake clock): every learner answers in it, and the round closes early at the last answer.
  """
  core, opened, merges, answers = _run_fleet(use_grace=True, until=42.0)
  # Rounds at steps 2, 4, ..., 42 (the last still open); the clock ticks on the whole seconds.
  assert [(t, r.round_step) for t, r in opened] == [(float(s), s) for s in range(2, 43, 2)]
  assert core.rounds.open_requests() == [RoundRequest(1, 42, 10)]
  by_round = {(e.fragment, e.version): e for e in merges}
  assert len(by_round) == len(merges) == 20  # Every closed round merged exactly once.
  for p in (0, 1):
    steps = [r.round_step for _, r in opened if r.fragment == p]
    # Every period the fragment's round: none skipped (no overrun), none twice.
    assert steps == list(range(core.schedule.next_due(p, 0), 43, 4))
    assert [r.base_version for _, r in opened if r.fragment == p] == list(range(len(steps)))
  warm_up = 8.0  # Two periods: rates measured, every EMA set.
  rounds = [(t, r) for t, r in opened if warm_up <= t < 42.0]
  assert len(rounds) == 17
  for t, r in rounds:
    event = by_round[(r.fragment, r.base_version + 1)]  # Merged from its base.
    assert event.contributors == (0, 1, 2, 3)
    times = answers[(r.fragment, r.round_step)]
    assert {i: status for i, (_, status) in times.items()} == dict.fromkeys(range(4), "accepted")
    first, last = min(a for a, _ in times.values()), max(a for a, _ in times.values())
    assert times[0][0] == t + 1.0 and t < times[3][0] <= t + 1.18
    # Quorum at the first answer; early close at the last, inside the window.
    assert (event.open_time, event.quorum_time, event.time) == (t, first, last)
    assert event.time - event.quorum_time < event.grace_s
  stats = core.stats()
  assert (stats["late"], stats["overrun_rounds"], stats["duplicate"], stats["rejected"]) == (
    0,
    0,
    0,
    0,
  )
  assert (stats["rounds_opened"], stats["merges"], stats["zero_weight_reports"]) == (21, 20, 0)


def _rounds_with_a_late_answerer(delays, *, grace_spread=True, rounds=16):
  """Learners 0 and 1 (step time 1 s, τ = 2, K = 1: slack 2 s, γ · slack 1.6 s) answer each round of
  fragment 0; learner 1's answer comes `delays[k % len(delays)]` seconds after learner 0's. Returns
  learner 1's statuses and the merges."""
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0, 1), use_grace=True, grace_spread=grace_spread, **sgd1())
  statuses, merges = [], []
  for k in range(rounds):
    step = 10 * (k + 1)
    clock.t = 10.0 * k
    request = core.open_round(0, step)
    for i in (0, 1):
      core.fetch(i, 0)
    core.report(
      rep(0, anchor=request.base_version, step=step + 1, round_step=step, step_time_s=1.0)
    )
    clock.t += delays[k % len(delays)]
    merges += core.closer.poll()  # Closed by now if the window was shorter than the delay.
    result = core.report(
      rep(1, anchor=request.base_version, step=step + 1, round_step=step, step_time_s=1.0)
    )
    statuses.append(result.status)
    clock.t += 5.0
    merges += core.closer.poll()
  return statuses, merges


def test_the_window_grows_to_cover_the_answers_spread_up_to_the_slack():
  """Learner 1 answers 1.7 s after learner 0, one round in ten 1.9 s: past γ · slack (1.6 s),
  within the slack (2 s). Its first answers are late; once 8 delays are known (late ones too) the
  window covers them."""
  delays = (1.7,) * 9 + (1.9,)
  statuses, merges = _rounds_with_a_late_answerer(delays, rounds=30)
  assert statuses[:8] == ["late"] * 8
  for e in merges[:8]:
    assert e.contributors == (0,) and e.grace_s == pytest.approx(1.6)
  # From the first 1.9 s delay on (round 9), the window reaches past 1.7 s (before, eight delays
  # of 1.7 s put it at exactly 1.7 s, where the merge and the answer tie).
  assert merges[8].grace_s == pytest.approx(1.7)
  for k in range(10, 30):
    if delays[k % 10] == 1.7:
      assert statuses[k] == "accepted"
      assert merges[k].contributors == (0, 1) and 1.7 < merges[k].grace_s <= 2.0
  # Without it, γ · slack alone: every answer of learner 1 is late.
  statuses, merges = _rounds_with_a_late_answerer(delays, grace_spread=False)
  assert statuses == ["late"] * 16
  assert [e.grace_s for e in merges] == [pytest.approx(1.6)] * 16


def test_a_late_answer_refused_from_its_header_feeds_the_spread():
  """The service refuses a closed round's answer from its header (`drop_late`); its delay counts
  all the same, else the spread would only ever see the answers that made it."""
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0, 1), use_grace=True, **sgd1())
  core.open_round(0, ROUND)
  clock.t = 1.0
  core.report(rep(0, step_time_s=1.0))
  clock.t = 10.0
  assert len(core.closer.poll()) == 1
  delays = core._grace.delays
  clock.t = 12.5
  core.intake.drop_late(
    100, "closed", learner_id=1, fragment=0, round_step=ROUND + 1
  )  # Not that round.
  core.intake.drop_late(100, "closed", learner_id=1)  # No round named.
  assert list(delays) == []
  core.intake.drop_late(100, "closed", learner_id=1, fragment=0, round_step=ROUND)
  assert list(delays) == [11.5]  # 12.5 s, after the first answer at 1.0 s.


def test_the_window_never_spends_more_than_the_slack():
  """Learner 1 answers 3 s after learner 0: the window grows to the whole slack (2 s), no further."""
  statuses, merges = _rounds_with_a_late_answerer((3.0,))
  assert statuses == ["late"] * 16
  assert merges[-1].grace_s == pytest.approx(2.0)
  assert max(e.grace_s for e in merges) == pytest.approx(2.0)


def test_without_grace_the_straggler_splits_every_round():
  """The same fleet without the grace window: K = 1 merges at the first answer. Learner 3's next
  boundary usually comes before the fast learners' (t + 1), so it merges alone and they are late;
  otherwise they merge and it is late. No round ever has all four."""
  core, opened, merges, answers = _run_fleet(use_grace=False, until=42.0)
  by_round = {(e.fragment, e.version): e for e in merges}
  for t, r in opened[:-1]:
    times = answers[(r.fragment, r.round_step)]
    straggler_first = times[3][0] < t + 1.0
    on_time = (3,) if straggler_first else (0, 1, 2)
    assert by_round[(r.fragment, r.base_version + 1)].contributors == on_time
    assert {i for i, (_, status) in times.items() if status == "late"} == set(range(4)) - set(
      on_time
    )
  stats = core.stats()
  assert (stats["quorum_size_counts"], stats["late"], stats["overrun_rounds"]) == (
    {1: 17, 3: 3},
    17 * 3 + 3 * 1,
    0,
  )


def test_token_ledger_books_every_report_once():
  """received = merged + dropped + pending after each kind of answer; merged_steps per learner."""
  core = make_core(learners=(0, 1), min_quorum=2, **sgd1())
  core.open_round(0, ROUND)
  core.open_round(1, ROUND)
  ledger_rep = lambda i, n, **kw: dataclasses.replace(rep(i, **kw), new_tokens=n)  # noqa: E731
  assert core.report(ledger_rep(0, 30, step=10)).round_version == 1
  assert core.report(ledger_rep(0, 7, step=11)).status == "duplicate"  # Dropped: 7.
  core.register(0)  # Restarted: its answer supersedes the lost process's and carries its 30 along.
  core.fetch(0, 0)
  assert core.report(ledger_rep(0, 5, step=12)).status == "superseded"
  assert core.report(ledger_rep(1, 40, p=1, step=10)).status == "accepted"  # p1 needs K = 2.
  book = core.ledger()
  assert (book["received"], book["merged"], book["dropped"], book["pending"]) == (82, 0, 7, 75)
  core.report(ledger_rep(1, 20, step=10))  # The second answer of round (0, 10): quorum, merge.
  assert [e.version for e in core.closer.poll()] == [1]
  book = core.ledger()
  assert (book["received"], book["merged"], book["dropped"], book["pending"]) == (102, 55, 7, 40)
  assert book["learners"][0] == {"received": 42, "merged": 35, "dropped": 7, "pending": 0}
  assert book["learners"][1] == {"received": 60, "merged": 20, "dropped": 0, "pending": 40}
  assert core.merged_steps(0) == [12, -1] and core.merged_steps(1) == [10, -1]
  # Late (round (0, 10) is closed) and weight 0 (never received p): dropped.
  assert core.report(ledger_rep(0, 9, step=20)).status == "late"
  core.register(2)
  core.open_round(0, 13)
  assert core.report(ledger_rep(2, 11, step=20, anchor=1, round_step=13)).weight == 0.0
  core.intake.drop_late(
    100, "stale header", learner_id=1, new_tokens=3
  )  # The service's early refusal.
  book = core.ledger()
  assert (book["received"], book["merged"], book["dropped"], book["pending"]) == (125, 55, 30, 40)
  assert book["received"] == book["merged"] + book["dropped"] + book["pending"]
  # The ledger survives a checkpoint round trip, per learner too.
  other = make_core(min_quorum=2, **sgd1())
  other.load_state_dict(core.state_dict())
  assert other.ledger() == core.ledger() and other.merged_steps(0) == [12, -1]


def test_token_ledger_rejects_negative_new_tokens():
  core = make_core(learners=(0,))
  core.open_round(0, ROUND)
  bad = dataclasses.replace(rep(0), new_tokens=-1)
  result = core.report(bad)
  assert result.status == "rejected" and "new_tokens" in result.reason
  assert core.ledger()["received"] == 0


def _norms_of(core, p=0):
  return {i: e.sq_norms for i, e in core._rounds[p].entries.items()}


def test_filing_sums_rda_norms_and_the_merge_keeps_its_bits():
  """Norms summed at the door give the merge the bits it gets when it sums them itself."""
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=3, merge_rule=RDA())
  core.open_round(0, 1)
  core.report(rep(0, values=theta(0.25), step=1, round_step=1))
  core.report(rep(1, values=theta(0.5), step=1, round_step=1))
  core.report(rep(2, values=theta(0.75), step=1, round_step=1))
  (event,) = core.closer.poll()
  assert event.version == 1
  v1 = core.state(0).values
  # Round 2, opened on version 1: the norms are taken against the round's base, Θ1.
  core.open_round(0, 2)
  for i in range(3):
    core.fetch(i, 0)
  fresh = {k: v - np.float32(0.125) for k, v in v1.items()}
  other = {k: v + np.float32(0.25) for k, v in v1.items()}
  core.report(rep(0, values=fresh, anchor=1, step=2, round_step=2))
  core.report(rep(1, values=other, anchor=1, step=2, round_step=2))
  norms = _norms_of(core)
  # a: 6 values of (Θ − θ) = 0.125 → 6/64; b: 4 values → 4/64.
  assert norms[0] == merge.outer_sq_norms(v1, fresh) == {"a": 6 / 64, "b": 4 / 64}
  assert norms[1] == merge.outer_sq_norms(v1, other)
  # A twin core restored from a checkpoint holds the same round without norms (not saved).
  twin = make_core(FakeClock(clock.t), min_quorum=3, merge_rule=RDA())
  twin.load_state_dict(core.state_dict())
  assert _norms_of(twin) == {0: None, 1: None}
  core.report(rep(2, values=theta(0.0625), anchor=1, step=2, round_step=2))
  twin.report(rep(2, values=theta(0.0625), anchor=1, step=2, round_step=2))
  (a,), (b,) = core.closer.poll(), twin.closer.poll()
  assert a.digest == b.digest
  for k, v in core.state(0).values.items():
    assert v.tobytes() == twin.state(0).values[k].tobytes()


@pytest.mark.parametrize(
  "cfg, report, expected",
  [
    ({"merge_rule": WeightedMean()}, rep(0), None),  # The mean needs no norms: finiteness only.
    ({"embedding_keys": ("a",), "merge_rule": RDA()}, rep(0), {"b": 4 * 0.125**2}),  # "a": mean.
    ({"merge_rule": RDA()}, rep(0, tokens=0), "no entry"),  # Weight 0: never merged.
    ({"merge_rule": RDA()}, rep(3), "no entry"),  # Never received p (§3): weight 0.
  ],
)
def test_norms_are_summed_only_for_reports_that_join_an_rda_round(cfg, report, expected):
  cfg = dict(cfg)
  embedding = cfg.pop("embedding_keys", ())
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=init_values(),
    config=SyncerConfig(use_grace=False, min_quorum=2, **cfg),
    clock=FakeClock(),
    embedding_keys=embedding,
  )
  core.register(0)
  core.fetch(0, 0)
  core.register(3)
  core.open_round(0, ROUND)
  assert core.report(report).status == "accepted"
  norms = _norms_of(core)
  assert (norms[0] if norms else "no entry") == expected


@pytest.mark.parametrize("rule", [RDA(), WeightedMean()], ids=["rda", "mean"])
@pytest.mark.parametrize("anchor_ok", [True, False])
def test_non_finite_values_are_rejected_with_or_without_norms(rule, anchor_ok):
  core = make_core(learners=(0,), merge_rule=rule)
  core.open_round(0, ROUND)
  values = theta(0.125)
  values["b"][3] = np.nan
  r = rep(0, values=values, anchor=0 if anchor_ok else -1)
  result = core.report(r)
  n = values["b"].size
  assert (result.status, result.reason) == (
    "rejected",
    f"'b' has non-finite values (1 NaN/Inf of {n})",
  )


def test_reused_merge_memory_never_reaches_published_versions():
  """The core merges into one reused buffer: versions published before stay as they were."""
  core = make_core(learners=(0,), **sgd1())
  core.open_round(0, 1)
  core.report(rep(0, values=theta(0.25), step=1, round_step=1))
  (e1,) = core.closer.flush()
  v1 = {k: v.copy() for k, v in core.state(0).values.items()}
  np.testing.assert_array_equal(v1["b"], init_values()["b"] + np.float32(0.25))  # Θ − (Θ − θ).
  core.fetch(0, 0)
  core.open_round(0, 2)
  values = {k: v + np.float32(0.5) for k, v in v1.items()}
  core.report(rep(0, values=values, anchor=1, step=2, round_step=2))
  (e2,) = core.closer.flush()
  assert (e1.version, e2.version) == (1, 2)
  old = core.state_at(0, 1)
  assert old.digest == e1.digest
  for k, v in v1.items():
    assert old.values[k].tobytes() == v.tobytes()
    np.testing.assert_array_equal(core.state(0).values[k], v + np.float32(0.5))


def test_tick_skips_a_round_opened_directly_and_keeps_merging():
  """A round opened by hand at a step the clock has not reached yet is not opened again (it used to
  raise in `tick` at every call, which stopped a service's merge loop)."""
  clock = FakeClock(0.0)
  core = _tick_core(clock)
  for i in range(3):
    core.observe_steps(i, 1)
  assert core.pacer.tick() == []  # The clock starts at step 1; no rate yet.
  assert core.open_round(0, 4) == RoundRequest(0, 4, 0)
  clock.t = 2.0
  for i in range(3):
    core.observe_steps(i, 5)  # 2 steps/s: the clock is at step 5 (p1 due at 2, p0 at 4).
  assert core.pacer.tick() == [RoundRequest(1, 2, 0)]
  assert core.stats()["rounds_opened"] == 2


def test_the_step_time_a_learner_reports_starts_the_clock_and_a_silent_one_stops_pacing_it():
  clock = FakeClock(0.0)
  core = _tick_core(clock)
  core.observe_steps(0, 3, step_time_s=0.5)  # 2 steps/s, before two samples could measure it.
  core.observe_steps(1, 3, step_time_s=0.125)  # 8 steps/s.
  assert core.pacer.cadence_step() == 3
  clock.t = 0.5
  assert core.pacer.cadence_step() == 5  # 3 + 0.5 s at the median, 5 steps/s: 5.5.
  # Learner 1 is silent (paused, crashed) for more than max(2 s, 4 of its steps): from then on
  # only learner 0 paces the clock, at its measured rate 0.5 x 2 + 0.5 x (8 − 3) / 3 = 1.8333.
  clock.t = 3.0
  core.observe_steps(0, 8)
  assert core.pacer.cadence_step() == 10  # 5.5 + 2.5 s x 1.8333 = 10.08 (with learner 1: 17.8).


# -- hostile values and counters: refused whole, the global model untouched ----------------------


def _snapshot(core):
  """Every fragment's version and digest, and the outer optimizer states' arrays."""
  state = core.state_dict()
  opt = [np.asarray(v).copy() for k, v in sorted(state.items()) if "/opt/" in k]
  return [(core.state(p).version, core.state(p).digest) for p in range(2)], opt


def _assert_same(before, after):
  assert before[0] == after[0]
  assert len(before[1]) == len(after[1])
  for a, b in zip(before[1], after[1]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "shift",
  [3e38, -3e38, 1e38, 1e20, 1e4],
  ids=["+3e38", "-3e38", "1e38", "1e20", "1e4"],
)
def test_huge_finite_answer_is_refused_as_implausible(shift):
  """A finite but far-off θ (an overflowing outer gradient, or one out of scale) is refused."""
  core = make_core(learners=(0, 1), **sgd1())
  core.open_round(0, ROUND)
  before = _snapshot(core)
  huge = {k: np.full_like(v, shift) for k, v in theta(0.0).items()}
  result = core.report(rep(0, values=huge))
  assert (result.status, result.weight) == ("rejected", 0.0)
  assert "outer gradient" in result.reason
  assert core.closer.flush() == []
  _assert_same(before, _snapshot(core))
  assert (core.stats()["implausible"], core.stats()["rejected"]) == (1, 1)
  # The fleet goes on: an honest answer to the same round merges.
  assert core.report(rep(1)).status == "accepted"
  (event,) = core.closer.flush()
  assert event.contributors == (1,)
  assert all(np.isfinite(v).all() for v in core.state(0).values.values())


def test_plausibility_bound_follows_recent_merged_answers():
  """Once answers are merged, the bound is relative to their norms too, and can be disabled."""
  core = make_core(learners=(0,), **sgd1(), max_update_ratio=2.0)
  # ‖Θ_0‖ ≈ 4.6; an outer gradient of norm ≈ 0.4 is merged, then one ≈ 20 (> 2 × 4.6) is refused.
  core.open_round(0, ROUND)
  assert core.report(rep(0, values=theta(0.125))).weight > 0
  assert [e.version for e in core.closer.flush()] == [1]
  core.open_round(0, ROUND + 2)
  far = rep(0, values=theta(6.0), anchor=1, round_step=ROUND + 2)
  assert "implausible outer gradient" in core.report(far).reason
  loose = make_core(learners=(0,), **sgd1(), max_update_ratio=0.0)
  loose.open_round(0, ROUND)
  assert loose.report(rep(0, values=theta(6.0))).status == "accepted"


def test_a_restored_core_bounds_answers_by_the_restored_fragment():
  """After a restart the plausibility bound scales with the restored Θ_p, not the initial one."""
  a = make_core(learners=(0,), **sgd1(), max_update_ratio=0.0)
  a.open_round(0, ROUND)
  assert a.report(rep(0, values=theta(10.0))).status == "accepted"
  a.closer.flush()  # Θ_0 = init + 10: its norm is many times the initial one.
  b = make_core(**sgd1(), max_update_ratio=2.0)
  b.load_state_dict(a.state_dict())
  initial = np.sqrt(sum(float(np.sum(v**2)) for v in theta(0.0).values()))
  restored = b.state(0).values
  assert np.sqrt(sum(float(np.sum(v**2)) for v in restored.values())) > 5 * initial
  # An outer gradient of 4x the initial norm: implausible for the initial Θ_0, not for this one.
  size = sum(v.size for v in restored.values())
  shift = np.float32(4 * initial / np.sqrt(size))
  b.open_round(0, ROUND + 2)
  answer = rep(
    0, values={k: v - shift for k, v in restored.items()}, anchor=1, round_step=ROUND + 2
  )
  assert b.report(answer).status == "accepted"


def test_merge_that_overflows_changes_nothing():
  """A plausible answer whose outer step overflows: the merge is atomic, its answers dropped."""
  clock = FakeClock()
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=init_values(),
    config=SyncerConfig(
      use_grace=False, outer_optimizer=lambda: optax.sgd(1e38, momentum=0.9, nesterov=True)
    ),
    clock=clock,
  )
  for i in (0, 1):
    core.register(i)
    core.fetch(i, 0)
  core.open_round(0, ROUND)
  before = _snapshot(core)
  assert core.report(rep(0, values=theta(1.0))).weight > 0  # Plausible: ‖δ‖ ≈ 3.2, ‖Θ‖ ≈ 4.6.
  assert core.closer.poll() == []  # Failed: nothing published.
  _assert_same(before, _snapshot(core))
  stats, book = core.stats(), core.ledger()
  assert (stats["failed_merges"], stats["merges"], stats["open_rounds"]) == (1, 0, 0)
  assert book["pending"] == 0 and book["received"] == book["dropped"] + book["merged"]
  # The round is closed: its answers are late now; the next round opens and merges normally
  # once the outer step is sane again (here: it never is, and the state stays intact).
  assert core.report(rep(1)).status == "late"
  core.open_round(0, ROUND + 2)
  assert core.report(rep(1, values=theta(1.0), round_step=ROUND + 2)).weight > 0
  assert core.closer.poll() == []
  _assert_same(before, _snapshot(core))


def test_merge_that_raises_changes_nothing(monkeypatch):
  core = make_core(learners=(0,), **sgd1())
  core.open_round(0, ROUND)
  core.report(rep(0))
  before = _snapshot(core)

  def boom(*args, **kwargs):
    raise RuntimeError("merge bug")

  monkeypatch.setattr(merge, "merge_reports", boom)
  assert core.closer.poll() == []
  _assert_same(before, _snapshot(core))
  assert core.stats()["failed_merges"] == 1


@pytest.mark.parametrize(
  ("field", "value"),
  [
    ("tokens", 2**63 - 1),
    ("steps", 2**63 - 1),
    ("step", 2**63 - 1),
    ("tokens", 2**51),
    ("step", 2**41),
    ("steps", True),
  ],
)
def test_overflowing_counters_are_refused(field, value):
  core = make_core(learners=(0,), **sgd1())
  core.open_round(0, ROUND)
  before = _snapshot(core)
  result = core.report(dataclasses.replace(rep(0), **{field: value}))
  assert result.status == "rejected"
  _assert_same(before, _snapshot(core))
  core.state_dict()  # Saving still works.


def test_tokens_per_step_bound():
  core = make_core(learners=(0,), **sgd1(), max_tokens_per_step=8)
  core.open_round(0, ROUND)
  assert "tokens per step" in core.report(rep(0, tokens=100, steps=10)).reason
  assert core.report(rep(0, tokens=80, steps=10)).weight > 0


def test_step_clock_resists_a_learner_claiming_a_far_step():
  """Heartbeats claiming a huge step or rate can neither overflow nor race the step clock."""
  clock = FakeClock(100.0)
  core = make_core(clock, learners=(0, 1, 2), max_step_rate=100.0)
  core.observe_steps(0, 2**63 - 1, step_time_s=1e-300)  # Out of range: ignored.
  core.observe_steps(1, 2**40, step_time_s=1e-9)  # Within range, but one of three.
  core.observe_steps(0, 50, step_time_s=0.5)
  core.observe_steps(2, 50, step_time_s=0.5)
  assert core.pacer.cadence_step() == 50  # The median learner's step, not the liar's.
  clock.t += 2.0
  core.observe_steps(1, 2**40, step_time_s=1e-9)
  # The fleet's median rate (2/s; the liar's rate is clamped to 100/s): ~4 steps in 2 s.
  assert 50 <= core.pacer.cadence_step() <= 60
  for i in (0, 1, 2):
    core.observe_steps(i, 2**40)
  clock.t += 1e12  # Even at the clamped rate for ages the clock stays a valid step.
  assert core.pacer.cadence_step() <= 2**40
  core.state_dict()


def test_retry_after_merge_is_not_filed_or_booked_twice():
  core = make_core(learners=(0,), **sgd1())
  core.open_round(0, ROUND)
  first = core.report(dataclasses.replace(rep(0), new_tokens=100))
  (event,) = core.closer.flush()
  book = core.ledger()
  again = core.report(dataclasses.replace(rep(0), new_tokens=100))
  assert (again.status, again.weight, again.round_version) == (
    first.status,
    first.weight,
    event.version,
  )
  assert core.ledger() == book
  assert (core.stats()["replayed"], core.stats()["late"], core.stats()["merges"]) == (1, 0, 1)


def test_warm_up_compiles_every_outer_step_and_changes_nothing(caplog):
  warm, cold = make_core(learners=(0,)), make_core(learners=(0,))
  for p in range(warm.num_fragments):
    warm.warm_up(p)
  assert [warm.state(p).digest for p in (0, 1)] == [cold.state(p).digest for p in (0, 1)]
  with pytest.raises(ValueError, match="Unknown fragment"):
    warm.warm_up(2)
  events = {}
  for name, core in (("warm", warm), ("cold", cold)):
    caplog.clear()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
      for p in (0, 1):
        core.open_round(p, ROUND)
        assert core.report(rep(0, p=p)).status == "accepted"
      events[name] = core.closer.poll()
    compiles = [r for r in caplog.records if "Compiling" in r.getMessage()]
    # The cold core compiles its outer step at each fragment's first merge; the warm one never.
    assert bool(compiles) == (name == "cold"), [r.getMessage() for r in compiles]
  assert [e.digest for e in events["warm"]] == [e.digest for e in events["cold"]]
  assert len(events["warm"]) == 2


def _as_outer_gradient(core, r):
  """The report as a learner sends it: δ = Θ^(anchor) − θ (exact in float32)."""
  anchor = core.values_at(r.fragment, r.anchor_version)
  delta = {k: np.subtract(anchor[k], v, dtype=np.float32) for k, v in r.values.items()}
  return dataclasses.replace(r, values=delta, outer_gradient=True)


@pytest.mark.parametrize("rule", [RDA(), WeightedMean()], ids=["rda", "mean"])
def test_outer_gradient_answers_merge_as_their_thetas(rule):
  # Two learners answer one round, as θ, as δ, or one of each: the merge is bit for bit the same,
  # and RDA's norms are taken from δ itself.
  thetas = [theta(0.125), theta(-0.0625)]
  digests = set()
  for as_delta in [(False, False), (True, True), (True, False)]:
    core = make_core(learners=(0, 1), merge_rule=rule)
    core.open_round(0, ROUND)
    for i, (t, d) in enumerate(zip(thetas, as_delta)):
      r = rep(i, values=t, tokens=100 + 50 * i)
      r = _as_outer_gradient(core, r) if d else r
      assert core.report(r).status == "accepted"
    (event,) = core.closer.poll()
    digests.add(event.digest)
  assert len(digests) == 1


def test_outer_gradient_answers_are_checked_like_thetas():
  core = make_core(learners=(0,), max_update_ratio=10.0)
  core.open_round(0, ROUND)
  before = core.state(0).digest
  huge = _as_outer_gradient(core, rep(0))
  huge = dataclasses.replace(huge, values={k: v * np.float32(1e6) for k, v in huge.values.items()})
  result = core.report(huge)
  assert result.status == "rejected" and "implausible outer gradient" in result.reason
  nan = _as_outer_gradient(core, rep(0))
  nan.values["b"][1] = np.nan
  assert "non-finite" in core.report(nan).reason
  no_anchor = dataclasses.replace(_as_outer_gradient(core, rep(0)), anchor_version=-1)
  assert "needs the anchor version" in core.report(no_anchor).reason
  assert core.stats()["rejected"] == 3 and core.state(0).digest == before
