"""Tests of ddiloco.syncer.core.SyncerCore on a hand-advanced fake clock (SPEC §3, §4)."""

import dataclasses

import gin
import ml_dtypes
import numpy as np
import optax
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.syncer import merge
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore

# Two fragments: p0 holds "a" (2x3) and "b" (4,), p1 holds "c" (2,).
KEYS = (("a", "b"), ("c",))


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


def make_core(clock=None, *, learners=(), fetch=True, **cfg):
  cfg.setdefault("use_grace", False)
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=init_values(),
    config=SyncerConfig(**cfg),
    clock=clock or FakeClock(),
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


def rep(learner, *, p=0, values=None, tokens=100, steps=10, anchor=0, step=10, step_time_s=0.0):
  return Report(
    learner_id=learner,
    fragment=p,
    values=theta(0.125, p) if values is None else values,
    tokens=tokens,
    steps=steps,
    anchor_version=anchor,
    step=step,
    step_time_s=step_time_s,
  )


def sgd1():
  """Outer SGD with lr 1 and no momentum: Θ_new = Θ − merged."""
  return {"outer_lr": 1.0, "outer_momentum": 0.0}


def test_register_returns_versions_and_alive():
  core = make_core(learners=(0, 3))
  assert core.register(5) == {0: 0, 1: 0}
  assert core.alive() == frozenset({0, 3, 5})
  core.leave(3)
  assert core.alive() == frozenset({0, 5})
  with pytest.raises(ValueError, match="never registered"):
    core.leave(9)


def test_k1_no_grace_merges_at_first_poll():
  clock = FakeClock(5.0)
  core = make_core(clock, learners=(0,), **sgd1())
  result = core.report(rep(0))
  assert (result.status, result.weight) == ("accepted", 1000.0)  # 100**2 / 10
  assert core.next_deadline() == 5.0
  (event,) = core.poll()
  assert (event.fragment, event.version, event.contributors, event.tokens) == (0, 1, (0,), 100)
  assert (event.open_time, event.quorum_time, event.grace_s, event.time) == (5.0, 5.0, 0.0, 5.0)
  assert core.version(0) == 1
  assert core.version(1) == 0
  assert event.digest == values_digest(core.state(0).values) == core.state(0).digest
  assert core.poll() == []
  assert core.next_deadline() is None
  assert core.stats()["quorum_size_counts"] == {1: 1}


def test_m1_sgd_lr1_overwrites_with_the_learner_values_exactly():
  # Θ and θ both in [1, 2): Θ − θ is exact in float32 (Sterbenz), RDA of one vector returns it to within
  # float64 rounding (which the float32 cast removes), so Θ − (Θ − θ) == θ bit for bit.
  rng = np.random.default_rng(0)
  values = {k: rng.uniform(1.0, 2.0, v.shape).astype(np.float32) for k, v in theta(0).items()}
  core = make_core(learners=(0,), **sgd1())
  core.report(rep(0, values=values))
  core.poll()
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
  new = np.array([1.25, 1.75, 1.0], bf16)
  core.report(
    Report(learner_id=0, fragment=0, values={"w": new}, tokens=4, steps=1, anchor_version=0, step=1)
  )
  core.poll()
  out = core.state(0).values["w"]
  assert out.dtype == bf16
  np.testing.assert_array_equal(out, new)


def test_k2_waits_for_the_second_report():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=2)
  core.report(rep(0))
  clock.t = 100.0
  assert core.poll() == []
  assert core.next_deadline() is None
  core.report(rep(1))
  # Learner 2 is alive and received p0 but has not reported; no grace, so the deadline is the quorum.
  assert core.next_deadline() == 100.0
  (event,) = core.poll()
  assert event.contributors == (0, 1)
  assert (event.open_time, event.quorum_time) == (0.0, 100.0)


def test_grace_deadline_is_exact_on_the_fake_clock():
  clock = FakeClock(10.0)
  core = make_core(
    clock, learners=(0, 1, 2), min_quorum=2, use_grace=True, grace_gamma=0.8, overlap=2
  )
  core.report(rep(0, step_time_s=1.0))  # opens the round at 10.0; ξ_step = 1.0
  clock.t = 10.5
  core.report(rep(1, step_time_s=1.0))  # quorum at 10.5: ξ_quorum = 0.5, ξ_sync unknown = 0
  # window = 0.8 * (2*1.0 - 0.5 - 0) = 1.2; learner 2 has not reported, so no early close.
  deadline = 10.5 + 0.8 * (2 * 1.0 - 0.5)
  assert core.next_deadline() == deadline
  clock.t = np.nextafter(deadline, 0.0)
  assert core.poll() == []
  clock.t = deadline
  (event,) = core.poll()
  assert event.grace_s == pytest.approx(1.2)
  assert (event.open_time, event.quorum_time, event.time) == (10.0, 10.5, deadline)


def test_grace_max_caps_the_window():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1), use_grace=True, grace_max_s=3.0)
  core.report(rep(0, step_time_s=100.0))  # 0.8 * 2 * 100 = 160 > 3
  assert core.next_deadline() == 3.0


def test_early_close_when_every_alive_receiver_has_reported():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1), use_grace=True)
  core.register(2)  # alive but never received p0: weighs 0, so nobody waits for it
  core.report(rep(0, step_time_s=5.0))  # window = min(0.8 * 2 * 5, 10) = 8
  assert core.next_deadline() == 8.0
  assert core.poll() == []
  clock.t = 1.0
  core.report(rep(1))
  assert core.next_deadline() == 1.0  # due now
  (event,) = core.poll()
  assert event.contributors == (0, 1)
  assert event.time == 1.0


def test_early_close_when_the_missing_learner_leaves():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1), use_grace=True)
  core.report(rep(0, step_time_s=5.0))
  assert core.poll() == []
  core.leave(1)
  (event,) = core.poll()
  assert event.contributors == (0,)


def test_k_equals_m_with_a_dead_learner_stalls():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=3)
  core.leave(2)
  core.report(rep(0))
  core.report(rep(1))
  clock.t = 1e6
  assert core.poll() == []
  assert core.next_deadline() is None
  assert core.version(0) == 0
  assert core.stats()["open_rounds"] == 1


def test_k1_keeps_advancing_with_a_dead_learner():
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=1)
  core.leave(2)
  for v in range(3):
    for i in (0, 1):
      assert core.fetch(i, 0).version == v
      assert core.report(rep(i, anchor=v, step=10 * (v + 1))).status == "accepted"
    clock.t += 1.0
    (event,) = core.poll()
    assert (event.version, event.contributors) == (v + 1, (0, 1))
  assert core.stats()["versions"] == [3, 0]
  assert core.stats()["quorum_size_counts"] == {2: 3}
  assert core.stats()["mean_quorum_size"] == 2.0


def test_report_before_death_stays_in_its_round():
  core = make_core(learners=(0, 1), min_quorum=2)
  core.report(rep(1))
  core.leave(1)
  core.report(rep(0))
  (event,) = core.poll()
  assert event.contributors == (0, 1)


def test_late_report_is_dropped_and_counted():
  core = make_core(learners=(0, 1), max_staleness=0)  # SPEC §4 literal.
  core.report(rep(0))
  core.poll()
  digest = core.state(0).digest
  result = core.report(rep(1, tokens=70))  # anchored at 0, current is 1: staleness 1 > 0
  assert result.status == "late"
  assert "staleness 1" in result.reason
  stats = core.stats()
  assert (stats["late"], stats["dropped_tokens"], stats["open_rounds"]) == (1, 70, 0)
  assert core.poll() == []
  assert core.state(0).digest == digest


def test_max_staleness_admits_a_stale_report():
  core = make_core(learners=(0, 1), max_staleness=1)
  core.report(rep(0))
  core.poll()
  assert core.report(rep(1)).status == "accepted"
  (event,) = core.poll()
  assert (event.version, event.contributors) == (2, (1,))


def test_stale_report_is_re_anchored_at_its_own_version():
  """v_m = Θ^(anchor) − θ_m: a stale report adds its progress on top of the merge it missed.

  Outer SGD lr 1, mean. Θ0 = init. Learner 0 (anchor 0) sends init + 0.125 -> Θ1 = init + 0.125.
  Learner 1 (anchor 0, one merge behind) sends init + 0.25: its outer gradient is Θ0 − θ1 = −0.25,
  so Θ2 = Θ1 + 0.25 = init + 0.375. (Anchoring at Θ1 instead would give Θ2 = init + 0.25, undoing
  learner 0's merge.)
  """
  core = make_core(learners=(0, 1), max_staleness=1, merge_method="mean", **sgd1())
  core.report(rep(0, values=theta(0.125)))
  core.poll()
  assert core.report(rep(1, values=theta(0.25))).status == "accepted"
  core.poll()
  for k, v in core.state(0).values.items():
    np.testing.assert_array_equal(v, init_values()[k] + np.float32(0.375))


def test_staleness_beyond_kept_versions_is_a_config_error():
  with pytest.raises(ValueError, match="keep_versions"):
    SyncerConfig(max_staleness=3, keep_versions=3)


def test_duplicate_and_superseded():
  core = make_core(learners=(0, 1), min_quorum=2, **sgd1(), merge_method="mean")
  assert core.report(rep(0, step=10, values=theta(0.125))).status == "accepted"
  assert core.report(rep(0, step=10)).status == "duplicate"
  assert core.report(rep(0, step=9)).status == "duplicate"
  newer = core.report(rep(0, step=12, tokens=200, values=theta(0.25)))
  assert (newer.status, newer.weight) == ("superseded", 4000.0)  # 200**2 / 10
  # A restarted learner (new registration) supersedes even with a lower step.
  core.register(0)
  core.fetch(0, 0)
  assert core.report(rep(0, step=3, tokens=100, values=theta(0.5))).status == "superseded"
  core.report(rep(1, tokens=100, values=theta(0.5)))
  (event,) = core.poll()
  assert event.weights == (1000.0, 1000.0)
  assert event.tokens == 200
  # Both rounds' survivors are theta(0.5): mean = theta(0.5); lr 1 gives it back exactly.
  np.testing.assert_array_equal(core.state(0).values["a"], theta(0.5)["a"])
  stats = core.stats()
  assert (stats["accepted"], stats["superseded"], stats["duplicate"]) == (2, 2, 2)


def test_weight_zero_learner_never_changes_the_global_state():
  clock = FakeClock()
  core = make_core(clock, learners=(0,), fetch=False, **sgd1())
  digest = core.state(0).digest
  # Never received p0: weight 0 whatever its anchor and counters say (SPEC §3).
  for anchor in (-1, 0):
    result = core.report(rep(0, anchor=anchor, values=theta(0.5), tokens=10**6))
    assert (result.status, result.weight) == ("accepted", 0.0)
  core.fetch(0, 0)
  # Received, but claims it never applied p0: still weight 0.
  assert core.report(rep(0, anchor=-1, values=theta(0.5))).weight == 0.0
  clock.t = 1e6
  assert core.poll() == []
  assert core.next_deadline() is None
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
  assert core.report(rep(0, tokens=0, steps=0)).weight == 0.0
  assert core.poll() == []


def test_mark_delivered_counts_as_received():
  core = make_core(learners=(0,), fetch=False)
  core.mark_delivered(0, 0, 0)
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
}


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_rejections_leave_the_state_untouched(case):
  make, reason = BAD_REPORTS[case]
  core = make_core(learners=(0, 1))
  core.leave(1)
  before = [core.state(p).digest for p in range(2)]
  result = core.report(make())
  assert (result.status, result.weight) == ("rejected", 0.0)
  assert reason in result.reason
  assert core.poll() == []
  assert [core.state(p).digest for p in range(2)] == before
  stats = core.stats()
  assert (stats["rejected"], stats["accepted"], stats["open_rounds"], stats["versions"]) == (
    1,
    0,
    0,
    [0, 0],
  )


def test_outer_step_matches_optax_sgd_nesterov_over_two_rounds():
  core = make_core(learners=(0, 1), min_quorum=2, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
  opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  params = {k: v for k, v in init_values().items() if k in KEYS[0]}
  opt_state = opt.init(params)
  trace = {k: np.zeros(v.shape) for k, v in params.items()}  # float64 hand version of the momentum
  hand = {k: v.astype(np.float64) for k, v in params.items()}
  rng = np.random.default_rng(1)
  for v in range(2):
    thetas = [
      {
        k: (x + rng.normal(0, 0.1, x.shape)).astype(np.float32)
        for k, x in core.state(0).values.items()
      }
      for _ in range(2)
    ]
    for i in (0, 1):
      core.fetch(i, 0)
      core.report(rep(i, values=thetas[i], anchor=v, step=10 * (v + 1), tokens=100 * (i + 1)))
    glob = core.state(0).values
    grads = [{k: glob[k] - t[k] for k in glob} for t in thetas]
    merged = merge.merge_outer_gradients(grads, [1000.0, 4000.0])  # 100²/10, 200²/10
    updates, opt_state = opt.update(merged, opt_state, params)
    params = optax.apply_updates(params, updates)
    # Nesterov by hand: trace ← g + 0.9 trace; Θ ← Θ − 0.7 (g + 0.9 trace).
    for k, h in list(hand.items()):
      g = merged[k].astype(np.float64)
      trace[k] = g + 0.9 * trace[k]
      hand[k] = h - 0.7 * (g + 0.9 * trace[k])
    (event,) = core.poll()
    assert event.weights == (1000.0, 4000.0)
    for k, h in hand.items():
      np.testing.assert_allclose(core.state(0).values[k], params[k], rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(core.state(0).values[k], h, rtol=1e-5, atol=1e-6)
  # Momentum matters: round 2 differs from a momentum-free step from the same point.
  assert not np.allclose(trace["a"], merged["a"])


def test_token_weights_shape_the_mean():
  core = make_core(learners=(0, 1), min_quorum=2, merge_method="mean", **sgd1())
  theta1 = theta(0.0)
  theta1["a"][0, 0] += (
    0.25  # not collinear with learner 0's shift, so RDA would differ from the mean
  )
  # Same steps, 2x tokens: weight 200²/10 = 4000 vs 100²/10 = 1000, i.e. 4x.
  r0 = core.report(rep(0, tokens=200, values=theta(0.5)))
  r1 = core.report(rep(1, tokens=100, values=theta1))
  assert (r0.weight, r1.weight) == (4000.0, 1000.0)
  core.poll()
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
    config=SyncerConfig(min_quorum=2, use_grace=False, **sgd1()),
    clock=FakeClock(),
    embedding_keys=embedding_keys,
  )
  for i, c in enumerate(([1.5, 1.0], [1.0, 1.5])):
    core.register(i)
    core.fetch(i, 1)
    core.report(rep(i, p=1, values={"c": np.array(c, np.float32)}))
  core.poll()
  # Outer gradients [-0.5, 0] and [0, -0.5], equal weights. Mean: [-0.25, -0.25] -> Θ = 1.25.
  # RDA: radius 0.5, direction -[1, 1]/√2 -> Θ = 1 + 0.5/√2 ≈ 1.3536.
  np.testing.assert_allclose(core.state(1).values["c"], [expected, expected], rtol=1e-6)


def test_keep_versions():
  core = make_core(learners=(0,), keep_versions=2, max_staleness=1)
  for v in range(3):
    core.fetch(0, 0)
    core.report(rep(0, anchor=v, step=v + 1))
    core.poll()
  assert core.state_at(0, 3).digest == core.state(0).digest
  assert core.state_at(0, 2).version == 2
  with pytest.raises(KeyError, match="not kept"):
    core.state_at(0, 1)


def _scenario(clock):
  """A core with history, momentum, an open round, a dead learner and EMAs set."""
  core = make_core(
    clock, learners=(0, 1, 2), min_quorum=2, use_grace=True, keep_versions=2, max_staleness=1
  )
  for v in range(3):
    clock.t += 1.0
    for i in (0, 1):
      core.fetch(i, 0)
      core.report(
        rep(i, values=theta(0.1 * (i + 1) + 0.01 * v), anchor=v, step=v + 1, step_time_s=0.5)
      )
    clock.t += 5.0
    assert len(core.poll()) == 1
  core.fetch(0, 0)
  core.report(rep(0, values=theta(0.3), anchor=3, step=9, tokens=50))  # open round, below quorum
  core.leave(2)
  core.observe_sync_time(0.25)
  # p1: quorum met, grace window running (learner 3 received p1 and has not reported).
  core.register(3)
  core.fetch(3, 1)
  for i in (0, 1):
    core.report(rep(i, p=1, values=theta(0.05 * (i + 1), 1), step=20, step_time_s=0.5))
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
  core_b = make_core(clock_b, use_grace=True, min_quorum=2, keep_versions=2, max_staleness=1)
  core_b.load_state_dict(sd)
  _assert_state_dicts_equal(core_b.state_dict(), sd)
  assert core_b.alive() == frozenset({0, 1, 3})
  assert core_b.state(0).digest == core_a.state(0).digest
  assert core_b.grace_window() == core_a.grace_window()
  clock_b.t = clock_a.t
  assert core_b.next_deadline() == core_a.next_deadline() > clock_a.t  # p1's grace window
  for core, clock in ((core_a, clock_a), (core_b, clock_b)):
    core.fetch(1, 0)
    assert core.report(rep(1, values=theta(0.2), anchor=3, step=9)).status == "accepted"
    clock.t += 10.0
  events_a, events_b = core_a.poll(), core_b.poll()
  assert events_a == events_b
  assert [(e.fragment, e.version) for e in events_a] == [(0, 4), (1, 1)]
  assert events_a[1].grace_s > 0
  _assert_state_dicts_equal(core_a.state_dict(), core_b.state_dict())


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


def test_config_validation_and_gin():
  with pytest.raises(ValueError, match="min_quorum"):
    SyncerConfig(min_quorum=0)
  with pytest.raises(ValueError, match="merge_method"):
    SyncerConfig(merge_method="median")
  with gin.unlock_config():
    gin.parse_config("ddiloco.SyncerConfig.min_quorum = 3")
  try:
    assert SyncerConfig().min_quorum == 3
  finally:
    gin.clear_config()
  assert SyncerConfig().min_quorum == 1


def test_fleet_step_extrapolates_from_the_latest_report():
  """Latest accepted report: step 12, arrived at t = 12.05, step time 1.0 s.

  At t = 13.0 the fleet has done round(0.95 / 1.0) = 1 more step: 13. A stale report with a lower
  step never moves it back; a checkpoint round trip keeps it.
  """
  clock = FakeClock(12.05)
  core = make_core(clock, learners=(0, 1), max_staleness=1)
  core.report(rep(0, step=12, step_time_s=1.0))
  assert core.fleet_step() == 12
  clock.t = 13.0
  assert core.fleet_step() == 13
  core.report(rep(1, step=7, step_time_s=1.0))
  assert core.fleet_step() == 13
  other = make_core(FakeClock(13.0))
  other.load_state_dict(core.state_dict())
  assert other.fleet_step() == 13


def test_cadence_is_a_clock_at_the_median_learner_rate():
  """cadence_step starts at the first report's schedule step and advances at the median rate of
  the alive learners' own step counts, whatever their schedules do (no feedback)."""
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0, 1, 2), max_staleness=1)
  assert core.cadence_step() == -1  # No report yet.
  core.report(rep(0, step=10))
  assert core.cadence_step() == 10
  # Own step counts: learner 0 at 2 steps/s, learner 1 at 4 steps/s, learner 2 at 10 steps/s.
  for i in range(3):
    core.observe_steps(i, 100)
  clock.t = 2.0
  for i, rate in enumerate((2, 4, 10)):
    core.observe_steps(i, 100 + 2 * rate)
  assert core.cadence_step() == 10 + 2 * 4  # Median rate 4 steps/s over the 2 s since t = 0.
  clock.t = 3.0
  core.leave(1)  # Median of {2, 10} = 6 steps/s from now on.
  assert core.cadence_step() == 18 + 6
  # A learner's schedule jumping ahead does not move the cadence.
  core.report(rep(2, step=500))
  assert core.cadence_step() == 24


def test_observe_steps_ignores_unknown_dead_and_too_frequent_samples():
  clock = FakeClock(0.0)
  core = make_core(clock, learners=(0,))
  core.observe_steps(7, 10)  # Unknown learner: ignored.
  core.observe_steps(0, 10)
  clock.t = 0.5
  core.observe_steps(0, 1000)  # Within min_interval_s: no rate sample.
  clock.t = 1.0
  core.observe_steps(0, 20)
  core.report(rep(0, step=3))
  assert core.cadence_step() == 3
  clock.t = 2.0
  assert core.cadence_step() == 3 + 10  # 10 steps/s from the one valid sample.


def test_token_ledger_books_every_report_once():
  """received = merged + dropped + pending after each kind of answer; merged_steps per learner."""
  core = make_core(learners=(0, 1), max_staleness=0, min_quorum=2, **sgd1())
  ledger_rep = lambda i, n, **kw: dataclasses.replace(rep(i, **kw), new_tokens=n)  # noqa: E731
  assert core.report(ledger_rep(0, 30, step=10)).round_version == 1
  assert core.report(ledger_rep(0, 5, step=12)).status == "superseded"  # Carries the 30 along.
  assert core.report(ledger_rep(0, 7, step=11)).status == "duplicate"  # Dropped: 7.
  assert core.report(ledger_rep(1, 40, p=1, step=10)).status == "accepted"  # p1 needs K = 2.
  book = core.ledger()
  assert (book["received"], book["merged"], book["dropped"], book["pending"]) == (82, 0, 7, 75)
  core.report(ledger_rep(1, 20, step=10))  # The second report of p0: quorum, merge.
  assert [e.version for e in core.poll()] == [1]
  book = core.ledger()
  assert (book["received"], book["merged"], book["dropped"], book["pending"]) == (102, 55, 7, 40)
  assert book["learners"][0] == {"received": 42, "merged": 35, "dropped": 7, "pending": 0}
  assert book["learners"][1] == {"received": 60, "merged": 20, "dropped": 0, "pending": 40}
  assert core.merged_steps(0) == [12, -1] and core.merged_steps(1) == [10, -1]
  # Late (anchor 0 < version 1 with max_staleness 0) and weight 0 (never received p): dropped.
  assert core.report(ledger_rep(0, 9, step=20)).status == "late"
  core.register(2)
  assert core.report(ledger_rep(2, 11, step=20)).weight == 0.0
  core.drop_late(100, "stale header", learner_id=1, new_tokens=3)  # The service's early refusal.
  book = core.ledger()
  assert (book["received"], book["merged"], book["dropped"], book["pending"]) == (125, 55, 30, 40)
  assert book["received"] == book["merged"] + book["dropped"] + book["pending"]
  # The ledger survives a checkpoint round trip, per learner too.
  other = make_core(max_staleness=0, min_quorum=2, **sgd1())
  other.load_state_dict(core.state_dict())
  assert other.ledger() == core.ledger() and other.merged_steps(0) == [12, -1]


def test_token_ledger_rejects_negative_new_tokens():
  core = make_core(learners=(0,))
  bad = dataclasses.replace(rep(0), new_tokens=-1)
  result = core.report(bad)
  assert result.status == "rejected" and "new_tokens" in result.reason
  assert core.ledger()["received"] == 0


def _norms_of(core, p=0):
  return {i: e.sq_norms for i, e in core._rounds[p].entries.items()}


def test_filing_sums_rda_norms_and_the_merge_keeps_its_bits():
  """Norms summed at the door (issue 3) give the merge the bits it gets when it sums them itself."""
  clock = FakeClock()
  core = make_core(clock, learners=(0, 1, 2), min_quorum=3, max_staleness=1)
  core.report(rep(0, values=theta(0.25), step=1))
  core.report(rep(1, values=theta(0.5), step=1))
  core.report(rep(2, values=theta(0.75), step=1))
  (event,) = core.poll()
  assert event.version == 1
  v1 = core.state(0).values
  # Round 2: learner 0 on time, learner 1 one version stale (re-anchored at v0, SPEC §4.3).
  fresh = {k: v - np.float32(0.125) for k, v in v1.items()}
  core.report(rep(0, values=fresh, anchor=1, step=2))
  core.report(rep(1, values=theta(0.375), anchor=0, step=2))
  norms = _norms_of(core)
  # a: 6 values of (Θ − θ) = −0.125 → 6/64; b: 4 values → 4/64. Learner 1: (−0.375)² × 6 and × 4.
  assert norms[0] == merge.outer_sq_norms(v1, fresh) == {"a": 6 / 64, "b": 4 / 64}
  assert norms[1] == {"a": 6 * 0.375**2, "b": 4 * 0.375**2}
  # A twin core restored from a checkpoint holds the same round without norms (not saved).
  twin = make_core(FakeClock(clock.t), min_quorum=3, max_staleness=1)
  twin.load_state_dict(core.state_dict())
  assert _norms_of(twin) == {0: None, 1: None}
  core.report(rep(2, values=theta(0.0625), anchor=1, step=2))
  twin.report(rep(2, values=theta(0.0625), anchor=1, step=2))
  (a,), (b,) = core.poll(), twin.poll()
  assert a.digest == b.digest
  for k, v in core.state(0).values.items():
    assert v.tobytes() == twin.state(0).values[k].tobytes()


@pytest.mark.parametrize(
  "cfg, report, expected",
  [
    ({"merge_method": "mean"}, rep(0), None),  # The mean needs no norms: finiteness only.
    ({"embedding_keys": ("a",)}, rep(0), {"b": 4 * 0.125**2}),  # "a" uses the mean.
    ({}, rep(0, tokens=0), "no entry"),  # Weight 0: never merged.
    ({}, rep(3), "no entry"),  # Never received p (SPEC §3): weight 0.
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
  assert core.report(report).status == "accepted"
  norms = _norms_of(core)
  assert (norms[0] if norms else "no entry") == expected


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("anchor_ok", [True, False])
def test_non_finite_values_are_rejected_with_or_without_norms(method, anchor_ok):
  core = make_core(learners=(0,), merge_method=method)
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
  """The core merges into one reused buffer (issue 3): versions published before stay as they were."""
  core = make_core(learners=(0,), **sgd1())
  core.report(rep(0, values=theta(0.25), step=1))
  (e1,) = core.flush()
  v1 = {k: v.copy() for k, v in core.state(0).values.items()}
  np.testing.assert_array_equal(v1["b"], init_values()["b"] + np.float32(0.25))  # Θ − (Θ − θ).
  core.fetch(0, 0)
  core.report(rep(0, values={k: v + np.float32(0.5) for k, v in v1.items()}, anchor=1, step=2))
  (e2,) = core.flush()
  assert (e1.version, e2.version) == (1, 2)
  old = core.state_at(0, 1)
  assert old.digest == e1.digest
  for k, v in v1.items():
    assert old.values[k].tobytes() == v.tobytes()
    np.testing.assert_array_equal(core.state(0).values[k], v + np.float32(0.5))
