"""Tests for the learner's side of the round protocol (docs/algorithm.md §3), with hand-built rounds and merges.

The syncer paces the rounds: a learner answers the rounds it was asked for (`ask`), never the
schedule on its own. `_learner()` is P = 2, H = 4: fragment 1 is due at schedule steps 2, 6, ... and
fragment 0 at 4, 8, ...; τ = 1 unless told otherwise.
"""

import jax
import numpy as np
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.device import DigestCheck
from ddiloco.learner.snapshot import FragmentSnapshot
from ddiloco.protocol import ReportResult, RoundRequest
from ddiloco.testing import learners
from ddiloco.testing.learners import batch as _batch
from ddiloco.testing.learners import fragment_state as _state

B, L = learners.BATCH, learners.SEQ_LEN


def _learner(**kwargs):
  learner = learners.tiny_learner(**kwargs)
  return learner, learner.layout


def _ok():
  return ReportResult(status="accepted", reason="", weight=1.0)


def test_due_lists_the_rounds_asked_for_not_the_schedule():
  learner, _ = _learner()
  due = {}
  for t in range(1, 7):
    learner.train_step(_batch(t))
    due[t] = learner.due()
  # Fragments 1 and 0 were due at steps 2, 4 and 6, but no round was opened: nothing to answer.
  assert due == {t: () for t in range(1, 7)}
  assert list(learner.kernel.tokens) == [6 * B * L, 6 * B * L]
  assert list(learner.kernel.step_counts) == [6, 6]
  learner.kernel.ask(RoundRequest(1, 6, 0))
  learner.kernel.ask(RoundRequest(0, 4, 0))
  # A non-blocking learner answers every round asked for at its next step boundary.
  assert learner.due() == (0, 1)
  assert learner.kernel.pending_rounds() == {0: RoundRequest(0, 4, 0), 1: RoundRequest(1, 6, 0)}
  answer = learner.answer(1, host_copy=True)
  assert (answer.fragment, answer.round_step, answer.step) == (1, 6, 6)
  assert learner.due() == (0,)  # Answered once.
  # A newer round of p replaces an unanswered older one, never the other way round.
  learner.kernel.ask(RoundRequest(0, 8, 0))
  learner.kernel.ask(RoundRequest(0, 4, 0))
  assert learner.kernel.pending_rounds() == {0: RoundRequest(0, 8, 0)}
  with pytest.raises(ValueError, match="Round request for unknown fragment 2"):
    learner.kernel.ask(RoundRequest(2, 8, 0))


def test_answer_carries_host_copy_counters_anchor_and_round():
  learner, layout = _learner()
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  answer = learner.answer(1, host_copy=True, step_time_s=0.5)
  assert (
    answer.fragment,
    answer.tokens,
    answer.steps,
    answer.anchor_version,
    answer.step,
    answer.round_step,
  ) == (1, 2 * B * L, 2, 0, 2, 2)
  assert set(answer.theta()) == set(layout.fragments[1])
  host = learner.device.read(1)
  for k, v in answer.theta().items():
    np.testing.assert_array_equal(v, host[k])


def _sent_and_merged(learner):
  """Two steps, round (1, 2) answered at step 2 (apply step 3) and accepted, version 1 received."""
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  answer = learner.answer(1, host_copy=True)
  assert answer.round_step == 2
  learner.kernel.on_result(1, _ok())
  merged = {k: np.full_like(v, 0.25) for k, v in answer.theta().items()}
  learner.kernel.receive(_state(merged, 1, 1))
  return merged


def test_apply_waits_for_overlap_then_resets_counters():
  learner, _ = _learner(overlap=1)
  merged = _sent_and_merged(learner)
  assert learner.apply_ready() == []  # Step 2 < apply step 3.
  learner.train_step(_batch(3))
  assert learner.apply_ready() == [(1, 1)]
  assert learner.kernel.anchor[1] == 1
  assert learner.device.digest(1) == values_digest(merged)  # Bit-identical to what was published.
  assert (learner.kernel.tokens[1], learner.kernel.step_counts[1]) == (0, 0)
  assert learner.kernel.step_counts[0] == 3  # The other fragment's counters keep running.


@pytest.mark.parametrize("defer", [False, True], ids=["at_once", "deferred"])
def test_apply_digests_are_checked_in_order_at_once_or_when_ready(defer):
  learner, _ = _learner(overlap=1)
  learner.device.defer_digests = defer  # A learner process defers on CPU (LearnerWorker).
  merged = _sent_and_merged(learner)
  learner.train_step(_batch(3))
  assert learner.apply_ready() == [(1, 1)]
  if defer:  # Read back later, from the very arrays written: the next step must keep them.
    (_, _, _, written) = learner.device._unverified[0]
    learner.train_step(_batch(4))  # Would donate them without the deferred check.
    assert not any(a.is_deleted() for a in written)
    assert learner.kernel.step_counts[1] == 1  # Training went on after the apply.
  checked = learner.verified_applies(block=True)
  digest = values_digest(merged)  # What was written, not what trained since.
  assert checked == [DigestCheck(1, 1, digest, digest)] and checked[0].ok
  assert learner.verified_applies(block=True) == []  # Each check is handed out once.
  assert learner.device.applied_digest[1] == values_digest(merged)


def test_counters_reset_at_every_apply_even_after_a_late_answer():
  learner, _ = _learner(overlap=1)
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  answer = learner.answer(1, host_copy=True)
  learner.kernel.on_result(
    1, ReportResult(status="late", reason="round (1, 2) is closed", weight=0)
  )
  # The round merged without this learner's answer; its version still overwrites θ_1.
  merged = {k: v * 0 for k, v in answer.theta().items()}
  learner.kernel.receive(_state(merged, 1, 1))
  assert learner.apply_ready() == []  # Step 2 < answer + τ = 3, as for a merged answer.
  learner.train_step(_batch(3))
  assert learner.apply_ready() == [(1, 1)]
  assert learner.device.digest(1) == values_digest(merged)
  assert (learner.kernel.tokens[1], learner.kernel.step_counts[1]) == (0, 0)
  assert (learner.kernel.tokens[0], learner.kernel.step_counts[0]) == (3 * B * L, 3)
  # The ledger: the late answer's 2 steps and the step trained since, overwritten, are dropped.
  assert learner.kernel.ledger.fates() == {
    "unsent": 3 * B * L,
    "awaiting": 0,
    "pending": 0,
    "merged": 0,
    "dropped": 3 * B * L,
  }


def test_version_of_a_round_not_answered_is_applied_at_once():
  learner, layout = _learner()
  learner.train_step(_batch(0))
  values = {k: np.zeros(layout.shapes[k], layout.dtypes[k]) for k in layout.fragments[0]}
  learner.kernel.receive(_state(values, 0, 3))
  assert learner.apply_ready() == [(0, 3)]  # No answer of fragment 0 outstanding: no τ to wait.
  assert learner.kernel.anchor[0] == 3
  assert learner.device.digest(0) == values_digest(values)
  assert (learner.kernel.tokens[0], learner.kernel.step_counts[0]) == (0, 0)
  assert learner.kernel.step_counts[1] == 1
  learner.kernel.receive(_state(values, 0, 2))  # Older than what it holds: ignored.
  assert learner.apply_ready() == []


def test_unanswered_request_is_dropped_when_a_newer_version_arrives():
  learner, layout = _learner()
  learner.train_step(_batch(0))
  learner.kernel.ask(RoundRequest(0, 4, 0))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  assert learner.due() == (0, 1)
  values = {k: np.zeros(layout.shapes[k], layout.dtypes[k]) for k in layout.fragments[0]}
  learner.kernel.receive(_state(values, 0, 1))
  # Round (0, 4) merged without this learner: answering it now would be late.
  assert learner.due() == (1,)
  assert learner.kernel.pending_rounds() == {1: RoundRequest(1, 2, 0)}
  assert learner.apply_ready() == [(0, 1)]
  learner.kernel.ask(RoundRequest(0, 4, 0))  # Asked again (a new subscription): its base is behind.
  assert learner.due() == (1,)
  learner.kernel.ask(RoundRequest(0, 8, 1))  # The next round, based on the version it holds...
  assert learner.due() == (1,)  # ...answered once it has trained p0 since applying it.
  learner.train_step(_batch(1))
  assert learner.due() == (0, 1)
  learner.kernel.receive(_state(values, 0, 1))  # The same version again drops nothing.
  assert learner.kernel.pending_rounds()[0] == RoundRequest(0, 8, 1)
  learner.kernel.receive(_state(values, 0, 2))
  assert learner.due() == (1,)


def test_blocking_learner_answers_at_the_round_step_and_waits_for_the_merge():
  learner, _ = _learner(overlap=1, config=LearnerConfig(blocking=True))
  learner.train_step(_batch(0))
  learner.kernel.ask(RoundRequest(1, 2, 0))  # Opened by a syncer clock ahead of this learner.
  assert (learner.kernel.schedule_step, learner.due(), learner.kernel.blocked()) == (1, (), False)
  learner.train_step(_batch(1))
  # Step 2: fragment 1 is due, so the learner answers (and waits until it has).
  assert (learner.kernel.schedule_step, learner.due(), learner.kernel.blocked()) == (2, (1,), True)
  answer = learner.answer(1, host_copy=True)
  learner.kernel.on_result(1, _ok())
  assert answer.round_step == 2 and not learner.kernel.blocked()
  learner.train_step(_batch(2))
  # Step 3 = answer + τ: blocked until the round's merge has arrived.
  assert (learner.kernel.schedule_step, learner.kernel.blocked()) == (3, True)
  learner.kernel.receive(_state(dict(answer.theta()), 1, 1))
  assert not learner.kernel.blocked()
  assert learner.apply_ready() == [(1, 1)]
  assert not learner.kernel.blocked()
  learner.train_step(_batch(3))
  # Step 4: fragment 0 is due, and its round was not opened yet: the learner waits for it.
  assert (learner.kernel.schedule_step, learner.due(), learner.kernel.blocked()) == (4, (), True)
  learner.kernel.ask(RoundRequest(0, 4, 0))
  assert (learner.due(), learner.kernel.blocked()) == ((0,), True)
  assert learner.answer(0, host_copy=True).round_step == 4
  assert not learner.kernel.blocked()


def test_mixing_alpha():
  learner, _ = _learner(overlap=1, config=LearnerConfig(mixing_alpha=0.5))
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  answer = learner.answer(1, host_copy=True)
  learner.kernel.on_result(1, _ok())
  mine = learner.device.read(1)
  zeros = {k: np.zeros_like(v) for k, v in answer.theta().items()}
  learner.kernel.receive(_state(zeros, 1, 1))
  learner.train_step(_batch(2))
  after_step = learner.device.read(1)
  learner.apply_ready()
  got = learner.device.read(1)
  for k in got:  # θ ← 0.5·0 + 0.5·θ
    np.testing.assert_allclose(got[k], 0.5 * after_step[k], rtol=1e-6)
  assert mine  # The fragment is not empty.
  # The digest check read Θ_p's bits back before the mix was written over them.
  [(p, version, digest, expected)] = learner.verified_applies(block=True)
  assert expected == digest
  assert (p, version) == (1, 1)
  assert digest == learner.device.applied_digest[1] == values_digest(zeros)
  assert learner.device.digest(1) != digest  # It holds its own blend.


def test_align_phase_moves_the_schedule_not_the_step():
  learner, _ = _learner(config=LearnerConfig(blocking=True))
  learner.train_step(_batch(0))
  # The fleet is at step 6, where fragment 1 is due: that round was the fleet's before this
  # learner (re)joined, so it does not wait for it.
  learner.kernel.align_phase(6)
  assert (learner.kernel.step, learner.kernel.schedule_step, learner.kernel.blocked()) == (
    1,
    6,
    False,
  )
  learner.kernel.ask(RoundRequest(0, 8, 0))
  learner.train_step(_batch(1))
  assert (
    learner.kernel.step,
    learner.kernel.schedule_step,
    learner.due(),
    learner.kernel.blocked(),
  ) == (
    2,
    7,
    (),
    False,
  )
  learner.train_step(_batch(2))
  assert (
    learner.kernel.step,
    learner.kernel.schedule_step,
    learner.due(),
    learner.kernel.blocked(),
  ) == (
    3,
    8,
    (0,),
    True,
  )
  answer = learner.answer(0, host_copy=True)
  assert (answer.step, answer.round_step, answer.steps) == (8, 8, 3)
  assert not learner.kernel.blocked()


def test_split_tensors_round_trip_through_the_learner():
  """With split_large, a fragment holds row ranges of big tensors: reading and writing them back
  must touch exactly those rows (docs/algorithm.md §2 decision)."""
  learner, layout = _learner(num_fragments=24, period=24, split_large=True)
  pieces = [k for frag in layout.fragments for k in frag if "@" in k]
  assert pieces  # The MLP kernels (128 x 512) are larger than total / 24.
  p = layout.fragment_of(pieces[0])
  before = {q: learner.device.read(q) for q in range(layout.num_fragments)}
  new = {k: np.full_like(v, 0.5) for k, v in before[p].items()}
  learner.load_global([_state(new, p, 1)])
  for q in range(layout.num_fragments):
    got = learner.device.read(q)
    want = new if q == p else before[q]
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert learner.device.digest(p) == values_digest(new)


@pytest.mark.parametrize("by_reference", [True, False], ids=["by_reference", "device_copy"])
def test_a_snapshot_answer_survives_donation_and_matches_a_host_copy(by_reference):
  learner, _ = _learner()
  assert learner.device.snapshot_by_reference  # The default on CPU devices.
  learner.device.snapshot_by_reference = by_reference  # False: the GPU/TPU path, an on-device copy.
  learner.train_step(_batch(1))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  answer = learner.answer(1, step_time_s=0.5)
  assert isinstance(answer.theta, FragmentSnapshot) and answer.theta.device_encode is False
  assert answer.step_time_s == 0.5 and answer.anchor_version == 0
  assert answer.round_step == 2 and learner.due() == ()
  expected = learner.device.read(1)
  before = jax.tree_util.tree_leaves(learner.params)
  learner.train_step(_batch(2))  # Would donate the parameters the snapshot was taken from.
  # By reference, that step kept its input parameters (the second compiled variant); the next
  # one donates again.
  # (XLA aliases, so JAX deletes, only the donated buffers an output can reuse: not all of them.)
  assert any(x.is_deleted() for x in before) == (not by_reference)
  assert learner.steps.train_cache_size() == (2 if by_reference else 1)
  kept = jax.tree_util.tree_leaves(learner.params)
  learner.train_step(_batch(3))
  assert any(x.is_deleted() for x in kept)
  values = answer.theta()
  assert set(values) == set(expected)
  assert all(np.array_equal(values[k], expected[k]) for k in expected)
  assert not all(np.array_equal(values[k], v) for k, v in learner.device.read(1).items())


def test_a_round_waits_for_its_base_and_for_training_since_the_last_apply():
  """An answer anchored off the round's base, or with nothing trained since the learner (re)loaded,
  would weigh 0: the learner answers once it holds the base and has trained p."""
  learner, layout = _learner()
  learner.kernel.ask(RoundRequest(0, 4, 0))
  assert learner.due() == ()  # Just loaded: nothing trained to contribute.
  learner.train_step(_batch(0))
  assert learner.due() == (0,)
  answer = learner.answer(0, host_copy=True)
  assert (answer.round_step, answer.anchor_version, answer.steps) == (4, 0, 1)
  # The next round of p0 is based on version 1, which is still being pulled: wait for it.
  learner.kernel.ask(RoundRequest(0, 8, 1))
  assert learner.due() == ()
  values = {k: np.zeros(layout.shapes[k], layout.dtypes[k]) for k in layout.fragments[0]}
  learner.kernel.receive(_state(values, 0, 1))
  # τ = 1 step has not passed since the answer, but a round based on version 1 waits: apply now.
  assert learner.apply_ready() == [(0, 1)]
  learner.train_step(_batch(1))
  assert learner.due() == (0,)
  answer = learner.answer(0, host_copy=True)
  assert (answer.round_step, answer.anchor_version, answer.steps) == (8, 1, 1)


@pytest.mark.parametrize("by_reference", [True, False], ids=["by_reference", "standby_copy"])
def test_a_round_asked_mid_step_is_answered_with_the_last_steps_theta(by_reference):
  """docs/algorithm.md §3: while `start_step`'s step runs, θ, step and counters stay the last
  boundary's, and an answer carries them; the step becomes the learner's at `end_step`."""
  learner, _ = _learner()
  learner.device.snapshot_by_reference = by_reference  # False: the GPU/TPU path, a standby copy.
  learner.train_step(_batch(0))
  theta = learner.device.read(1)
  tokens, steps = int(learner.kernel.tokens[1]), int(learner.kernel.step_counts[1])
  learner.start_step(_batch(1), standby=[1])
  assert learner.device.step_in_flight and learner.kernel.step == 1
  learner.kernel.ask(RoundRequest(1, 2, 0))
  assert learner.due() == (1,)
  answer = learner.answer(1)
  assert (answer.step, answer.tokens, answer.steps) == (1, tokens, steps)
  learner.end_step()
  assert learner.kernel.step == 2 and learner.kernel.step_counts[1] == steps + 1
  learner.train_step(_batch(2))  # Donates what it can: the answer's θ_p must survive.
  values = answer.theta()
  assert all(np.array_equal(values[k], theta[k]) for k in theta)
  assert not all(np.array_equal(values[k], v) for k, v in learner.device.read(1).items())
  # The apply is τ = 1 step after the answer's step (1), at a boundary.
  assert learner.schedule.apply_step(answer.step) == 2


def test_mid_step_a_donated_fragment_without_standby_waits_for_the_boundary():
  learner, _ = _learner()
  learner.device.snapshot_by_reference = False
  learner.train_step(_batch(0))
  learner.start_step(_batch(1), standby=[1])
  learner.kernel.ask(RoundRequest(0, 4, 0))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  assert learner.due() == (1,)  # θ_0 was donated to the step in flight.
  with pytest.raises(RuntimeError, match="not readable"):
    learner.answer(0)
  learner.end_step()
  assert learner.due() == (0, 1)


def test_applies_and_loads_wait_for_the_step_in_flight():
  """The step in flight would write over an apply: applies happen at boundaries only."""
  learner, layout = _learner()
  learner.train_step(_batch(0))
  values = {k: np.zeros(layout.shapes[k], layout.dtypes[k]) for k in layout.fragments[0]}
  learner.kernel.receive(_state(values, 0, 1))
  learner.start_step(_batch(1))
  assert learner.apply_ready() == []
  with pytest.raises(RuntimeError, match="in flight"):
    learner.load_global([_state(values, 0, 1)])
  with pytest.raises(RuntimeError, match="in flight"):
    learner.start_step(_batch(2))
  learner.end_step()
  with pytest.raises(RuntimeError, match="No step in flight"):
    learner.end_step()
  assert learner.apply_ready() == [(0, 1)]
  assert all(np.array_equal(v, values[k]) for k, v in learner.device.read(0).items())
