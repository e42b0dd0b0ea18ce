"""One learner: its protocol kernel, its parameters on its devices and its inner optimizer.

`Learner` composes the pure protocol state (`kernel`, learner/kernel.py), the device-facing
collaborator that reads and writes θ (`device`, learner/device.py) and the compiled inner step
(learner/train_step.py). The simulated cluster and the learner process drive it the same way:

  learner.kernel.ask(request)           # the syncer opened round (p, t)
  learner.kernel.receive(state)         # a merged fragment arrived
  learner.train_step(batch)             # inner AdamW step; counters[p] += tokens, steps  ∀p
  boundary = step_boundary(learner)     # applies what is ready, answers what is due (boundary.py)
  learner.kernel.on_result(p, result)   # the syncer's word on an answer

A learner process splits the step: `start_step` dispatches it and `end_step` makes it the
learner's, so that while it runs θ, the step and the counters stay those of the last boundary and
a round asked for meanwhile is answered at once (docs/algorithm.md §3).
"""

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from ddiloco.fragments.layout import FragmentLayout
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step as train_step_lib
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.device import DeviceParams, DigestCheck
from ddiloco.learner.kernel import LearnerKernel
from ddiloco.learner.train_step import CompiledSteps
from ddiloco.protocol import Answer, FragmentState, HostTheta
from ddiloco.types import PyTree


class Learner:
  """One learner's kernel, device parameters and inner optimizer (see module docstring).

  Args:
    learner_id: this learner's id at the syncer.
    steps: the compiled train/eval steps for this learner's mesh.
    params: initial parameters, placed with `steps.param_shardings`.
    layout: the fragment layout (identical on every learner and the syncer).
    schedule: when each fragment is due and τ.
    config: protocol knobs.
  """

  def __init__(
    self,
    *,
    learner_id: int,
    steps: CompiledSteps,
    params: PyTree,
    layout: FragmentLayout,
    schedule: FragmentSchedule,
    config: LearnerConfig | None = None,
  ):
    self.kernel = LearnerKernel(
      learner_id=learner_id, layout=layout, schedule=schedule, config=config
    )
    self.device = DeviceParams(
      params, steps.param_shardings, layout, device_encode=self.kernel.config.device_encode
    )
    self.steps = steps
    self.opt_state = steps.init_opt_state(params)
    self._in_flight_tokens = 0  # Tokens of the step dispatched by `start_step`.

  @property
  def learner_id(self) -> int:
    return self.kernel.learner_id

  @property
  def layout(self) -> FragmentLayout:
    return self.kernel.layout

  @property
  def schedule(self) -> FragmentSchedule:
    return self.kernel.schedule

  @property
  def config(self) -> LearnerConfig:
    return self.kernel.config

  @property
  def params(self) -> PyTree:
    """The parameters of the last step boundary, on the devices."""
    return self.device.params

  # -- training -------------------------------------------------------------------------------

  def train_step(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """One inner step on `batch`; metrics stay on device (read them lazily)."""
    metrics = self._dispatch(batch, (), mid_step=False)
    self.end_step()
    return metrics

  def start_step(
    self, batch: dict[str, Any], *, standby: Iterable[int] = ()
  ) -> dict[str, jax.Array]:
    """Dispatches one inner step on `batch`; `end_step` makes it this learner's.

    Until `end_step`, θ, the step and the counters stay those of the last step boundary, so a
    round asked for while the step runs can be answered at once with θ_p of the last step
    (docs/algorithm.md §3, "answers"). θ_p must still be readable then: on CPU the step keeps its
    input parameters; elsewhere it donates them, and the fragments in `standby` (those the syncer
    is expected to ask for meanwhile) are copied on device first (learner/device.py).

    Raises:
      RuntimeError: if a step is already in flight.
    """
    return self._dispatch(batch, standby, mid_step=True)

  def _dispatch(
    self, batch: dict[str, Any], standby: Iterable[int], *, mid_step: bool
  ) -> dict[str, jax.Array]:
    if self.device.step_in_flight:
      raise RuntimeError("A step is in flight: call end_step first.")
    keep = self.device.before_step(standby, mid_step=mid_step)
    params, self.opt_state, metrics = self.steps.train(
      self.device.params, self.opt_state, self.steps.put_batch(batch), keep_params=keep
    )
    self.device.dispatched(params, kept=keep)
    self._in_flight_tokens = int(np.prod(batch["targets"].shape))
    return metrics

  def end_step(self) -> None:
    """Makes the step `start_step` dispatched this learner's: its θ, step and counters."""
    if not self.device.step_in_flight:
      raise RuntimeError("No step in flight: call start_step first.")
    self.device.land()
    self.kernel.trained(self._in_flight_tokens)

  def join_schedule(self, fleet_step: int) -> None:
    """Continues the fleet's inner learning-rate schedule from `fleet_step` (a (re)join).

    A learner that joins a running fleet would otherwise start its warm-up again; one whose own
    schedule is further along keeps it.
    """
    self.opt_state = train_step_lib.schedule_at_least(self.opt_state, max(int(fleet_step), 0))

  # -- the protocol's work on the devices -----------------------------------------------------

  def due(self) -> tuple[int, ...]:
    """The fragments whose round this learner answers now (`LearnerKernel.due`), of those whose
    θ_p of the last boundary the devices can read."""
    return self.kernel.due(self.device.readable)

  def answer(self, p: int, *, step_time_s: float = 0.0, host_copy: bool = False) -> Answer:
    """Answers p's round with θ_p of the last step boundary (`LearnerKernel.answer`).

    Args:
      p: the fragment.
      step_time_s: this learner's step time (the syncer's ξ_step).
      host_copy: θ_p copied to host memory now; otherwise a snapshot on the devices that the
        answer's sender copies (or has the devices encode): the training loop never waits for it.

    Raises:
      RuntimeError: if θ_p cannot be read while this step runs (`DeviceParams.readable`).
    """
    theta = HostTheta(self.device.read(p)) if host_copy else self.device.snapshot(p)
    return self.kernel.answer(p, theta, step_time_s=step_time_s)

  def apply_ready(self) -> list[tuple[int, int]]:
    """Applies every received version the kernel says is ready (`LearnerKernel.ready`); returns
    (fragment, version) of each. At step boundaries only: a step in flight would write over it.

    Each apply writes Θ_p and queues its digest check (`verified_applies`) before a carry or a
    mix is written over it: the check proves Θ_p's bits reached the devices.
    """
    if self.device.step_in_flight:
      return []
    applied = []
    for apply in self.kernel.ready():
      p, state = apply.fragment, apply.state
      own = self.device.read(p) if apply.reads_own else None
      self.device.write(p, state.values)
      self.device.check(p, state.version, state.digest)
      blend = apply.blend(own)
      if blend is not None:
        self.device.write(p, blend)
      self.kernel.applied(apply)
      applied.append((p, state.version))
    return applied

  def verified_applies(self, *, block: bool = False) -> list[DigestCheck]:
    """The applies' digest checks read back since the last call, in apply order
    (`DeviceParams.verified`)."""
    return self.device.verified(self.kernel.anchor, block=block)

  def load_global(self, states: Iterable[FragmentState]) -> None:
    """Overwrites fragments with the syncer's global values (start, rejoin): docs/algorithm.md §6.

    Each is read back and digested at once (`DeviceParams.applied_digest`); counters restart,
    nothing is outstanding, and each fragment's anchor becomes the given version.

    Raises:
      RuntimeError: while a step is in flight (`start_step`), which would write over it.
    """
    if self.device.step_in_flight:
      raise RuntimeError("load_global while a step is in flight: call end_step first.")
    states = list(states)
    for state in states:
      self.device.write(state.fragment, state.values)
      self.device.record_digest(state.fragment)
    self.kernel.loaded(states)
