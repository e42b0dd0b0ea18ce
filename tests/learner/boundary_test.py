"""The step boundary both runtimes call (learner/boundary.py), on the tiny learner: P = 2, H = 4,
τ = 1; fragment 1 is due at schedule steps 2, 6, ... and fragment 0 at 4, 8, ..."""

import numpy as np

from ddiloco.learner.boundary import step_boundary
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.device import DigestCheck
from ddiloco.learner.snapshot import FragmentSnapshot
from ddiloco.protocol import HostTheta, ReportResult, RoundRequest, Uplink
from ddiloco.testing.learners import batch, fragment_state, tiny_learner


def _merge_of(values, shift=0.25):
  return {k: (v + shift).astype(v.dtype) for k, v in values.items()}


def test_a_boundary_applies_what_is_ready_checks_its_digest_then_answers():
  learner = tiny_learner()
  kernel = learner.kernel
  for t in range(2):
    learner.train_step(batch(t))
  kernel.ask(RoundRequest(1, 2, 0))
  first = step_boundary(learner, step_time_s=0.5)
  assert (first.applied, first.checked, first.blocked) == ((), (), False)
  [answer] = first.answers
  assert (answer.fragment, answer.round_step, answer.step, answer.steps) == (1, 2, 2, 2)
  assert answer.step_time_s == 0.5 and isinstance(answer.theta, FragmentSnapshot)
  assert answer.uplink is Uplink.DELTA and answer.anchor_version == 0  # Version 0 is held.
  kernel.on_result(1, ReportResult("accepted", "", 1.0, round_version=1))
  merged = fragment_state(_merge_of(answer.theta()), 1, 1)
  kernel.held.keep(merged)  # As the link keeps a pull, before the kernel receives it.
  kernel.receive(merged)
  assert step_boundary(learner).applied == ()  # Step 2 < answer + τ = 3.
  learner.train_step(batch(2))
  kernel.ask(RoundRequest(0, 4, 0))
  second = step_boundary(learner)
  assert second.applied == ((1, 1),)
  assert second.checked == (DigestCheck(1, 1, merged.digest, merged.digest),)
  assert [a.fragment for a in second.answers] == [0]  # Applied first, then answered.
  assert kernel.anchor.tolist() == [0, 1] and kernel.held.versions(1) == [1]
  assert learner.device.digest(1) == merged.digest
  assert step_boundary(learner).checked == ()  # Each check is handed out once.


def test_between_boundaries_it_answers_but_never_applies():
  """A round asked while a step runs (or, in the simulator, would) is answered at once; what
  arrived waits for the next boundary."""
  learner = tiny_learner()
  kernel = learner.kernel
  learner.train_step(batch(0))
  zeros = {k: np.zeros_like(v) for k, v in learner.device.read(0).items()}
  kernel.receive(fragment_state(zeros, 0, 1))  # A round it did not answer: applies at once.
  kernel.ask(RoundRequest(1, 2, 0))
  mid = step_boundary(learner, at_boundary=False, host_copies=True)
  assert mid.applied == () and [a.fragment for a in mid.answers] == [1]
  [answer] = mid.answers
  assert isinstance(answer.theta, HostTheta)
  host = learner.device.read(1)
  assert all(np.array_equal(answer.theta()[k], host[k]) for k in host)
  assert kernel.anchor[0] == 0
  assert step_boundary(learner).applied == ((0, 1),)
  assert all(not v.any() for v in learner.device.read(0).values())


def test_a_blocking_boundary_waits_for_its_round_and_then_for_the_merge():
  learner = tiny_learner(config=LearnerConfig(blocking=True))
  kernel = learner.kernel
  learner.train_step(batch(0))
  kernel.ask(RoundRequest(1, 2, 0))
  early = step_boundary(learner)
  assert (early.answers, early.blocked) == ((), False)  # Its step 1 < the round's step 2.
  learner.train_step(batch(1))
  due = step_boundary(learner, host_copies=True)
  assert [a.round_step for a in due.answers] == [2] and not due.blocked  # Answered: goes on.
  learner.train_step(batch(2))
  assert step_boundary(learner).blocked  # Step 3 = answer + τ: waits for the merge.
  merged = fragment_state(_merge_of(due.answers[0].theta()), 1, 1)
  kernel.receive(merged)
  after = step_boundary(learner)
  assert after.applied == ((1, 1),) and not after.blocked
