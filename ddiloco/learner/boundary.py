"""The step boundary: what a learner does between two inner steps, once, for both runtimes.

The simulated cluster (simulation/cluster.py) and the learner process (learner_process/training.py)
both call `step_boundary` whenever the protocol may move: after each step, when a round request
or a merged fragment reaches a learner that waits, and (without applying) when a request reaches
one whose step is running. It

  1. applies every received version whose apply step has come and collects the digest checks
     read back so far (at a step boundary only: a step in flight would write over an apply);
  2. answers every round due now with θ_p of the last boundary;
  3. says whether the learner must wait before its next step (the blocking baselines).

What arrived since the last call was fed to the kernel as it was taken (`LearnerKernel.ask`,
`receive`, `on_result`). The runtimes keep only what differs: their clock (virtual, or the wall
clock and a wait), their transport (the simulated network's events, or the sender threads) and
their threads.
"""

import dataclasses

from ddiloco.learner.device import DigestCheck
from ddiloco.learner.learner import Learner
from ddiloco.protocol import Answer


@dataclasses.dataclass(frozen=True)
class Boundary:
  """What one step boundary did and left to the runtime.

  Attributes:
    applied: (fragment, version) of each version applied, in order.
    checked: the applies' digest checks read back since the last boundary (`DigestCheck.ok`).
    answers: the answers to send, one per round answered, in fragment order.
    blocked: whether the learner must wait before its next step (`LearnerKernel.blocked`).
  """

  applied: tuple[tuple[int, int], ...]
  checked: tuple[DigestCheck, ...]
  answers: tuple[Answer, ...]
  blocked: bool


def step_boundary(
  learner: Learner,
  *,
  at_boundary: bool = True,
  host_copies: bool = False,
  step_time_s: float = 0.0,
) -> Boundary:
  """Applies what is ready, answers what is due, and says whether to wait (module docstring).

  Args:
    learner: the learner.
    at_boundary: False while a step runs (or, in the simulator, would): answer only, apply later.
    host_copies: answer with host copies of θ_p made now (the simulator, whose answers travel for
      a while); otherwise with device snapshots that a sender copies at once.
    step_time_s: this learner's step time, carried by its answers (the syncer's ξ_step).

  Returns:
    The boundary's applies, digest checks and answers, and whether the learner is blocked.
  """
  applied = tuple(learner.apply_ready()) if at_boundary else ()
  checked = tuple(learner.verified_applies()) if at_boundary else ()
  answers = tuple(
    learner.answer(p, step_time_s=step_time_s, host_copy=host_copies) for p in learner.due()
  )
  return Boundary(applied, checked, answers, learner.kernel.blocked())
