"""The learner's protocol kernel (learner/kernel.py) on its own: numpy only, no devices.

P = 2, H = 4, τ = 1 unless told otherwise; two leaves, "a" (fragment 0) and "b" (fragment 1), of
4 float32 values each. θ is whatever the test says it is: the kernel never reads it but through
the answers' θ and the blends' `own`. Every step trains 10 tokens.
"""

import numpy as np
import pytest

from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.held import HeldVersions
from ddiloco.learner.kernel import LearnerKernel
from ddiloco.protocol import FragmentState, HostTheta, ReportResult, RoundRequest, Uplink

TOK = 10


def _kernel(config=None, *, overlap=1) -> LearnerKernel:
  flat = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
  layout = layout_lib.make_layout(flat, num_fragments=2, strategy="tensor")
  kernel = LearnerKernel(
    learner_id=3,
    layout=layout,
    schedule=FragmentSchedule(num_fragments=2, period=4, overlap=overlap),
    config=config,
  )
  states = [_state(p, 0, 0.0) for p in range(2)]
  for state in states:
    kernel.held.keep(state)  # As the link keeps what it pulls.
  kernel.loaded(states)
  return kernel


def _key(p: int) -> str:
  return "ab"[p]


def _state(p: int, version: int, value: float) -> FragmentState:
  values = {_key(p): np.full(4, value, np.float32)}
  return FragmentState(fragment=p, version=version, values=values, digest=values_digest(values))


def _theta(p: int, value: float) -> HostTheta:
  return HostTheta({_key(p): np.full(4, value, np.float32)})


def _train(kernel: LearnerKernel, steps: int) -> None:
  for _ in range(steps):
    kernel.trained(TOK)


def _accepted(round_version=1) -> ReportResult:
  return ReportResult("accepted", "", 1.0, round_version=round_version)


def test_an_answer_carries_its_round_counters_and_the_anchor_it_is_a_delta_against():
  kernel = _kernel()
  _train(kernel, 2)
  kernel.ask(RoundRequest(1, 2, 0))
  assert kernel.due() == (1,)
  assert kernel.due(readable=lambda p: p != 1) == ()  # θ_1 unreadable while a step runs.
  answer = kernel.answer(1, _theta(1, 0.5), step_time_s=0.25)
  assert (answer.learner_id, answer.fragment, answer.round_step, answer.step) == (3, 1, 2, 2)
  assert (answer.anchor_version, answer.tokens, answer.steps, answer.new_tokens) == (
    0,
    2 * TOK,
    2,
    2 * TOK,
  )
  assert answer.step_time_s == 0.25 and answer.uplink is Uplink.DELTA
  np.testing.assert_array_equal(answer.anchor["b"], np.zeros(4, np.float32))
  np.testing.assert_array_equal(answer.theta()["b"], np.full(4, 0.5, np.float32))
  assert kernel.due() == ()  # Each round is answered once.
  assert kernel.ledger.fates()["awaiting"] == 2 * TOK
  # Fragment 0 was never received since a restart: no anchor held, so θ goes as fp32.
  kernel.held.clear()
  kernel.ask(RoundRequest(0, 4, 0))
  assert kernel.answer(0, _theta(0, 1.0)).uplink is Uplink.THETA


def test_a_received_version_waits_tau_after_the_answer_then_resets_counters_and_prunes():
  kernel = _kernel(overlap=1)
  _train(kernel, 2)
  kernel.ask(RoundRequest(1, 2, 0))
  kernel.answer(1, _theta(1, 0.5))
  kernel.on_result(1, _accepted())
  merged = _state(1, 1, 0.25)
  kernel.held.keep(merged)
  kernel.receive(merged)
  assert kernel.ready() == []  # Step 2 < answer + τ = 3.
  _train(kernel, 1)
  [apply] = kernel.ready()
  assert (apply.fragment, apply.version, apply.carried, apply.reads_own) == (1, 1, None, False)
  assert apply.blend(None) is None  # A plain overwrite.
  kernel.applied(apply)
  assert kernel.anchor.tolist() == [0, 1]
  assert (kernel.tokens.tolist(), kernel.step_counts.tolist()) == ([3 * TOK, 0], [3, 0])
  assert kernel.held.versions(1) == [1]  # Version 0 is never a base or an anchor again.
  assert kernel.ready() == []
  # The overlap's step was overwritten: dropped; the answer's 2 steps pending until settled.
  assert kernel.ledger.fates() == {
    "unsent": 3 * TOK,
    "awaiting": 0,
    "pending": 2 * TOK,
    "merged": 0,
    "dropped": TOK,
  }


def test_a_version_of_a_round_not_answered_applies_at_once_and_an_older_one_never():
  kernel = _kernel()
  _train(kernel, 1)
  kernel.receive(_state(0, 3, 1.0))
  [apply] = kernel.ready()
  kernel.applied(apply)
  assert kernel.anchor[0] == 3
  kernel.receive(_state(0, 2, 1.0))  # Older than the anchor: ignored.
  assert kernel.ready() == []


def test_a_round_based_on_a_received_version_applies_it_before_tau():
  kernel = _kernel(overlap=2)
  _train(kernel, 1)
  kernel.ask(RoundRequest(0, 4, 0))
  kernel.answer(0, _theta(0, 0.5))
  kernel.receive(_state(0, 1, 1.0))
  assert kernel.ready() == []  # τ = 2 steps after the answer at step 1.
  kernel.ask(RoundRequest(0, 8, 1))  # The next round waits on version 1: apply it now.
  assert kernel.due() == ()  # Its base is not applied yet.
  [apply] = kernel.ready()
  kernel.applied(apply)
  _train(kernel, 1)
  assert kernel.due() == (0,)


def test_a_newer_version_drops_an_unanswered_request_of_an_older_base():
  kernel = _kernel()
  _train(kernel, 1)
  kernel.ask(RoundRequest(0, 4, 0))
  kernel.receive(_state(0, 1, 1.0))
  assert kernel.pending_rounds() == {}
  kernel.ask(RoundRequest(0, 4, 0))  # Asked again (a new subscription): its round merged.
  assert kernel.pending_rounds() == {}
  with pytest.raises(ValueError, match="unknown fragment 2"):
    kernel.ask(RoundRequest(2, 4, 0))


@pytest.mark.parametrize("refused", [False, True], ids=["taken", "refused"])
def test_carry_keeps_the_progress_since_an_answer_a_round_took(refused):
  kernel = _kernel(LearnerConfig(apply_rule="carry"), overlap=2)
  _train(kernel, 2)
  kernel.ask(RoundRequest(1, 2, 0))
  kernel.answer(1, _theta(1, 0.5))  # θ_1^answered = 0.5.
  result = ReportResult("late", "", 0.0) if refused else _accepted()
  kernel.on_result(1, result)
  _train(kernel, 2)
  kernel.receive(_state(1, 1, 2.0))
  [apply] = kernel.ready()
  own = {"b": np.full(4, 0.75, np.float32)}  # θ_1 now: 0.25 of progress since the answer.
  if refused:  # No round took the answer: Θ_1 overwrites as before.
    assert apply.carried is None and apply.blend(own) is None
  else:
    assert apply.reads_own
    np.testing.assert_array_equal(apply.blend(own)["b"], np.full(4, 2.25, np.float32))
  kernel.applied(apply)
  kept = (0, 0) if refused else (2 * TOK, 2)
  assert (kernel.tokens[1], kernel.step_counts[1]) == kept
  assert kernel.answers.carried == (0 if refused else 1)
  assert kernel.ledger.totals()["balanced"]


def test_mixing_blends_and_keeps_the_unsent_progress_in_the_ledger():
  kernel = _kernel(LearnerConfig(mixing_alpha=0.5))
  _train(kernel, 1)
  kernel.receive(_state(0, 1, 2.0))
  [apply] = kernel.ready()
  assert apply.reads_own and apply.carried is None
  got = apply.blend({"a": np.full(4, 1.0, np.float32)})
  np.testing.assert_array_equal(got["a"], np.full(4, 1.5, np.float32))  # 0.5·2 + 0.5·1.
  kernel.applied(apply)
  assert kernel.ledger.fates()["dropped"] == 0  # α > 0: part of it is still in θ.


def test_a_blocking_learner_waits_for_its_round_and_then_for_the_merge():
  kernel = _kernel(LearnerConfig(blocking=True), overlap=1)
  _train(kernel, 1)
  kernel.ask(RoundRequest(1, 2, 0))
  assert (kernel.due(), kernel.blocked()) == ((), False)  # Its step 1 < the round's 2.
  _train(kernel, 1)
  assert (kernel.due(), kernel.blocked()) == ((1,), True)
  kernel.answer(1, _theta(1, 0.5))
  assert not kernel.blocked()
  _train(kernel, 1)
  assert kernel.blocked()  # Step 3 = answer + τ: waits for the merge.
  kernel.receive(_state(1, 1, 1.0))
  assert not kernel.blocked()


def test_a_blocking_learner_waits_no_more_for_a_round_that_merged_without_it():
  # Its round (1, 2) merges on the other learners' answers before it answers: the version that
  # round made arrives first (or the request comes after it). It must not wait for it forever.
  kernel = _kernel(LearnerConfig(blocking=True), overlap=1)
  _train(kernel, 1)
  kernel.ask(RoundRequest(1, 2, 0))
  _train(kernel, 1)
  assert (kernel.due(), kernel.blocked()) == ((1,), True)
  kernel.receive(_state(1, 1, 1.0))
  assert not kernel.blocked()
  late = _kernel(LearnerConfig(blocking=True), overlap=1)
  _train(late, 2)
  assert late.blocked()  # Due at step 2, no request yet.
  late.receive(_state(1, 1, 1.0))
  late.ask(RoundRequest(1, 2, 0))  # Its base is older than what arrived: that round is over.
  assert (late.due(), late.blocked()) == ((), False)


def test_a_load_overwrites_everything_and_forgets_the_rounds():
  kernel = _kernel(LearnerConfig(apply_rule="carry"))
  _train(kernel, 2)
  kernel.ask(RoundRequest(1, 2, 0))
  kernel.answer(1, _theta(1, 0.5))
  kernel.ask(RoundRequest(0, 4, 0))
  kernel.receive(_state(0, 1, 1.0))
  loaded = [_state(0, 2, 1.0), _state(1, 3, 1.0)]
  for state in loaded:
    kernel.held.keep(state)
  kernel.loaded(loaded)
  assert kernel.anchor.tolist() == [2, 3] and kernel.tokens.tolist() == [0, 0]
  assert kernel.ready() == [] and kernel.pending_rounds() == {} and len(kernel.answers) == 0
  assert [kernel.held.versions(p) for p in range(2)] == [[2], [3]]
  assert kernel.ledger.totals()["balanced"]


def test_held_versions_offer_the_newest_and_forget_only_older_ones():
  held = HeldVersions(2)
  for version in (1, 2, 3):
    held.keep(_state(0, version, float(version)))
  assert held.newest_held() == {0: (3, _state(0, 3, 3.0).digest)}
  assert held.get(0, -1) is None and held.get(1, 0) is None
  held.forget_before(0, 2)
  assert held.versions(0) == [2, 3]
  np.testing.assert_array_equal(held.values(0, 2)["a"], np.full(4, 2.0, np.float32))
  with pytest.raises(KeyError):
    held.values(0, 1)
  held.clear()
  assert held.newest_held() == {}
