"""Tests for the `carry` apply rule (learner/carry.py, docs/algorithm.md §3).

`_learner()` is P = 2, H = 4, τ = 2: fragment 1 is due at schedule steps 2, 6, ...; a round of
fragment 1 answered at step 2 applies from step 4. Its merge Θ_1 is a fixed, made-up value.
"""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.learner import carry
from ddiloco.learner.config import LearnerConfig
from ddiloco.protocol import ReportResult, RoundRequest
from ddiloco.testing import learners
from ddiloco.testing.learners import batch as _batch
from ddiloco.testing.learners import fragment_state as _state

STEP = learners.BATCH * learners.SEQ_LEN  # Tokens per step.
CARRY = LearnerConfig(apply_rule="carry")


def _learner(config=CARRY, *, num_fragments=2, period=4, split_large=False):
  return learners.tiny_learner(
    num_fragments=num_fragments, period=period, overlap=2, config=config, split_large=split_large
  )


def _result(status="accepted", weight=1.0):
  return ReportResult(status=status, reason="", weight=weight, round_version=1)


def _merge_of(answered):
  """A merged Θ unlike anything the learner holds."""
  rng = np.random.default_rng(7)
  return {k: (v + rng.normal(0, 0.1, v.shape)).astype(v.dtype) for k, v in answered.items()}


def _answer_then_train(learner, p=1, *, snapshot=False, result=None):
  """Trains 2 steps, answers (p, 2), books `result`, trains 2 more (the overlap): returns θ_p as
  answered, θ_p just before the apply, and the merge Θ_p (received)."""
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(p, 2, 0))
  answer = learner.answer(p, host_copy=not snapshot)
  learner.kernel.on_result(p, result or _result())
  for t in range(2, 4):
    learner.train_step(_batch(t))
  answered = answer.theta()
  merged = _merge_of(answered)
  learner.kernel.receive(_state(merged, p, 1))
  return answered, learner.device.read(p), merged


def _expected_carry(merged, mine, answered):
  return {k: merged[k] + (mine[k] - answered[k]) for k in merged}  # float32, as the learner does.


@pytest.mark.parametrize("defer", [False, True], ids=["digest_at_once", "digest_deferred"])
@pytest.mark.parametrize(
  "snapshot,by_reference",
  [(False, True), (True, True), (True, False)],
  ids=["host_copy", "snapshot_by_reference", "snapshot_device_copy"],
)
def test_carry_keeps_the_progress_since_the_answer_exactly(snapshot, by_reference, defer):
  learner = _learner()
  learner.device.snapshot_by_reference = by_reference
  learner.device.defer_digests = defer
  answered, mine, merged = _answer_then_train(learner, snapshot=snapshot)
  assert any(not np.array_equal(mine[k], answered[k]) for k in mine)  # It trained since.
  assert learner.apply_ready() == [(1, 1)]
  assert learner.kernel.answers.carried == 1
  got = learner.device.read(1)
  want = _expected_carry(merged, mine, answered)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # The digest check read Θ_1 back from the devices before the carry: the syncer's bits.
  digest = values_digest(merged)
  assert learner.verified_applies(block=True) == [(1, 1, digest, digest)]
  assert learner.device.applied_digest[1] == values_digest(merged)
  assert learner.device.digest(1) != values_digest(merged)
  # Counters keep the 2 steps since the answer; fragment 0 (never applied) all 4.
  assert (learner.kernel.tokens[1], learner.kernel.step_counts[1]) == (2 * STEP, 2)
  assert (learner.kernel.tokens[0], learner.kernel.step_counts[0]) == (4 * STEP, 4)
  # Nothing dropped: the answer's 2 steps are pending, the 2 carried ones unsent, and it balances.
  fates = learner.kernel.ledger.fates()
  assert fates == {
    "unsent": 4 * STEP + 2 * STEP,
    "awaiting": 0,
    "pending": 2 * STEP,
    "merged": 0,
    "dropped": 0,
  }
  assert learner.kernel.ledger.totals()["balanced"]


def test_overwrite_is_still_the_default():
  learner = _learner(LearnerConfig())
  _, _, merged = _answer_then_train(learner)
  assert learner.apply_ready() == [(1, 1)]
  assert learner.device.digest(1) == values_digest(merged)
  assert (learner.kernel.tokens[1], learner.kernel.step_counts[1]) == (0, 0)
  assert learner.kernel.ledger.fates()["dropped"] == 2 * STEP  # The overlap's 2 steps, overwritten.


def test_the_next_answer_sends_the_carried_progress():
  learner = _learner()
  answered, mine, merged = _answer_then_train(learner)
  learner.apply_ready()
  learner.kernel.ask(RoundRequest(1, 6, 1))
  assert learner.due() == (1,)  # Carried steps are trained since the apply: it can answer at once.
  answer = learner.answer(1, host_copy=True)
  assert (answer.tokens, answer.steps, answer.new_tokens, answer.anchor_version) == (
    2 * STEP,
    2,
    2 * STEP,
    1,
  )
  # Its outer gradient against Θ_1 is exactly the carried progress.
  for k in merged:
    np.testing.assert_allclose(
      answer.theta()[k] - merged[k], mine[k] - answered[k], rtol=0, atol=1e-6, err_msg=k
    )
  assert learner.kernel.ledger.totals()["balanced"]


@pytest.mark.parametrize(
  "status,weight", [("late", 0.0), ("duplicate", 0.0), ("accepted", 0.0)], ids=str
)
def test_a_refused_answer_is_overwritten(status, weight):
  learner = _learner()
  _, _, merged = _answer_then_train(learner, result=_result(status, weight))
  assert learner.apply_ready() == [(1, 1)]
  assert learner.kernel.answers.carried == 0
  assert learner.device.digest(1) == values_digest(merged)
  assert (learner.kernel.tokens[1], learner.kernel.step_counts[1]) == (0, 0)
  # The refused answer's 2 steps and the 2 overwritten since: all dropped, and it balances.
  assert learner.kernel.ledger.fates()["dropped"] == 4 * STEP
  assert learner.kernel.ledger.totals()["balanced"]


def test_a_round_not_answered_is_overwritten():
  learner = _learner()
  for t in range(3):
    learner.train_step(_batch(t))
  values = _merge_of(learner.device.read(0))
  learner.kernel.receive(_state(values, 0, 1))  # Its round merged without this learner.
  assert learner.apply_ready() == [(0, 1)]
  assert learner.device.digest(0) == values_digest(values)
  assert (learner.kernel.tokens[0], learner.kernel.step_counts[0]) == (0, 0)


def test_a_load_forgets_the_answers():
  learner = _learner()
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(1, 2, 0))
  answer = learner.answer(1, host_copy=True)
  learner.kernel.on_result(1, _result())
  loaded = _merge_of(answer.theta())
  learner.load_global([_state(loaded, 1, 1)])  # A rejoin: nothing outstanding any more.
  learner.train_step(_batch(2))
  merged = _merge_of(loaded)
  learner.kernel.receive(_state(merged, 1, 2))
  assert learner.apply_ready() == [(1, 2)]
  assert learner.device.digest(1) == values_digest(merged)


def test_carry_with_split_tensors_touches_only_the_fragments_rows():
  learner = _learner(num_fragments=24, period=24, split_large=True)
  layout = learner.layout
  p = layout.fragment_of(next(k for frag in layout.fragments for k in frag if "@" in k))
  for t in range(2):
    learner.train_step(_batch(t))
  learner.kernel.ask(RoundRequest(p, 2, 0))
  answered = learner.answer(p, host_copy=True).theta()
  learner.kernel.on_result(p, _result())
  for t in range(2, 4):
    learner.train_step(_batch(t))
  before = {q: learner.device.read(q) for q in range(layout.num_fragments)}
  merged = _merge_of(answered)
  learner.kernel.receive(_state(merged, p, 1))
  assert learner.apply_ready() == [(p, 1)]
  want = _expected_carry(merged, before[p], answered)
  for q in range(layout.num_fragments):
    got = learner.device.read(q)
    for k, v in (want if q == p else before[q]).items():
      np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_bad_configs_are_refused():
  with pytest.raises(ValueError, match="apply_rule must be one of"):
    LearnerConfig(apply_rule="keep")
  with pytest.raises(ValueError, match="needs mixing_alpha = 0"):
    LearnerConfig(apply_rule="carry", mixing_alpha=0.5)


def test_carried_arithmetic_and_its_errors():
  mine = {"w": np.array([1.0, 2.0], ml_dtypes.bfloat16)}
  answered = {"w": np.array([0.5, 2.0], ml_dtypes.bfloat16)}
  merged = {"w": np.array([3.0, -1.0], np.float32)}
  got = carry.carried(merged, mine, answered)
  assert got["w"].dtype == ml_dtypes.bfloat16  # θ_p's dtype, computed wider.
  np.testing.assert_array_equal(got["w"].astype(np.float32), [3.5, -1.0])
  with pytest.raises(ValueError, match="same keys"):
    carry.carried(merged, {"v": mine["w"]}, answered)
