"""A learner process's training thread: steps, and at each step boundary feeds what its background
threads received to the learner's kernel and calls the step boundary (docs/algorithm.md §3).

The training thread is the only one that touches the `Learner`. At each boundary it drains the
inbox (push answers, merged fragments, round requests) into the kernel, then calls
`step_boundary` (learner/boundary.py, the simulator's too): it applies what is ready and answers
what is due; this thread counts the digest checks and hands each answer, θ_p a device-side
snapshot, to the senders. A round requested while a step runs is answered at once, with θ of the
last step (`StepWaiter`). With `LearnerConfig.blocking` (the synchronous baselines) it waits while
the boundary says so, as the simulated cluster does. Periodic work (checkpoints, logging) runs as
hooks after each step (`add_hook`).
"""

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import jax
import numpy as np

from ddiloco.learner.boundary import Boundary, step_boundary
from ddiloco.learner.device import DigestCheck
from ddiloco.learner.learner import Learner
from ddiloco.learner_process.inbox import Inbox
from ddiloco.learner_process.senders import Senders
from ddiloco.learner_process.step_wait import StepWaiter
from ddiloco.protocol import Answer, FragmentState

log = logging.getLogger(__name__)

_WARMUP_STEPS = 2  # Steps left out of the step-time EMA (compilation).

# Periodic work after a step: fn(step, metrics); the metrics stay on device.
Hook = Callable[[int, Mapping[str, jax.Array]], None]


@dataclasses.dataclass(frozen=True)
class _Periodic:
  fn: Hook
  every: int
  at_last: bool

  def due(self, step: int, num_steps: int) -> bool:
    return step % self.every == 0 or (self.at_last and step == num_steps)


class TrainingLoop:
  """The training thread of one learner process (see module docstring).

  Args:
    learner: the learner; only this loop's thread touches it once training starts.
    data: training batches.
    inbox: what the background threads hand this thread.
    senders: where answers go; None on a process of a multi-process learner other than its
      leader, which snapshots every due fragment as the leader does (collectives) but sends nothing.
    stop: set when the worker stops (ends a `blocking` wait).
    event: writes one event to this learner's metrics (`kind`, then its fields).
    before_drain: called with (step, waits) before each drain; True stops training after the
      current step. A multi-process learner shares its inbox there (learner_process/multihost.py).
  """

  def __init__(
    self,
    *,
    learner: Learner,
    data: Iterator[dict[str, np.ndarray]],
    inbox: Inbox,
    senders: Senders | None,
    stop: threading.Event,
    event: Callable[..., None],
    before_drain: Callable[[int, int], bool] | None = None,
  ):
    self.learner = learner
    self.id = learner.learner_id
    self._data = data
    self._inbox = inbox
    self._senders = senders
    self._stop = stop
    self._event = event
    self._before_drain = before_drain
    self._hooks: list[_Periodic] = []
    self._asked_at: dict[tuple[int, int], float] = {}  # (p, round step) -> arrival, until answered.
    # Waits for each step in flight, woken by round requests (`_await_step`); made by `start`.
    self._step_waiter: StepWaiter | None = None
    self._newest_round_step = -1  # The newest round step asked for (`_standby`).
    self._waits = 0  # Iterations of `_wait_for_merges` (a multi-process learner shares at each).
    self.stop_requested = False
    self.step_time_s = 0.0
    self.push_status: collections.Counter[str] = collections.Counter()
    self.applies: list[tuple[int, int, str]] = []
    self.digest_mismatches = 0
    self.tokens_trained = 0  # From the start of the learner's shard (a restore sets it).
    self.train_start = self.train_end = 0.0
    self.rounds_asked = 0
    self.blocked_s = 0.0  # Time waiting for merges (`blocking` only).
    self.last_staleness_steps = 0
    # Accepted with weight 0 (docs/algorithm.md §3: not received since registering).
    self.zero_weight_pushes = 0

  def add_hook(self, fn: Hook, *, every: int = 1, at_last: bool = False) -> None:
    """Runs `fn(step, metrics)` after every `every`-th step, and after the last step of `train`
    if `at_last`. Hooks run in the order added, once the step is counted and timed.

    Raises:
      ValueError: if `every` < 1.
    """
    if every < 1:
      raise ValueError(f"every must be >= 1, got {every}.")
    self._hooks.append(_Periodic(fn, every, at_last))

  def pace(self) -> tuple[int, float]:
    """(schedule step, step time in seconds): what a heartbeat tells the syncer."""
    return self.learner.kernel.schedule_step, self.step_time_s

  def load_global(self, loaded: list[FragmentState], fleet_step: int, versions: list[int]) -> None:
    """The device half of `connect`: loads the global fragments and joins the fleet's cadence.

    Separate from `SyncerSession.fetch_global` so that a multi-process learner's other processes,
    which never talk to the syncer, load the same fragments (learner_process/multihost.py).
    """
    self.learner.load_global(loaded)
    # What the devices now hold must be the syncer's bits (docs/algorithm.md §4.7).
    for state in loaded:
      if self.learner.device.applied_digest.get(state.fragment) != state.digest:
        self.digest_mismatches += 1
        log.error("learner %d: global fragment %d digest mismatch", self.id, state.fragment)
    self.learner.kernel.align_phase(fleet_step)
    self.learner.join_schedule(fleet_step)  # A late joiner continues the fleet's LR schedule.
    self._event("connected", versions=versions, fleet_step=fleet_step)

  # -- the step boundary ----------------------------------------------------------------------

  def drain(self) -> None:
    """Feeds the kernel what the background threads received: answers, fragments, requests."""
    kernel = self.learner.kernel
    if self._before_drain is not None and self._before_drain(kernel.step, self._waits):
      self.stop_requested = True
    while True:
      try:
        p, step, result = self._inbox.results.get_nowait()
      except queue.Empty:
        break
      if isinstance(result, int):
        kernel.ledger.fold(p, step, result)
        continue
      self.push_status[result.status] += 1
      if result.status == "accepted" and result.weight == 0:
        self.zero_weight_pushes += 1
      kernel.on_result(p, result, step=step)
      if result.fleet_step >= 0:
        self._inbox.fleet_step = result.fleet_step
    while True:
      try:
        kernel.receive(self._inbox.received.get_nowait())
      except queue.Empty:
        break
    while True:  # After the fragments: a request whose round already merged is dropped.
      try:
        request, arrived = self._inbox.requests.get_nowait()
      except queue.Empty:
        break
      kernel.ask(request)
      self._newest_round_step = max(self._newest_round_step, request.round_step)
      self._asked_at[(request.fragment, request.round_step)] = arrived
      self.rounds_asked += 1
    settle = self._inbox.take_settle()
    if settle is not None:
      kernel.ledger.settle(*settle)

  def _boundary(self, *, at_boundary: bool = True) -> Boundary:
    """Drains the inbox, then the step boundary (learner/boundary.py): counts its digest checks
    and hands its answers to the senders."""
    self.drain()
    boundary = step_boundary(self.learner, at_boundary=at_boundary, step_time_s=self.step_time_s)
    self._count_checks(boundary.checked)
    for answer in boundary.answers:
      self._send(answer)
    return boundary

  def _send(self, answer: Answer) -> None:
    if self._senders is None:
      return  # A follower: the leader's snapshots (collectives), and nothing to send.
    p = answer.fragment
    # Inner steps θ_p trained away from the last global version applied (TensorBoard).
    self.last_staleness_steps = answer.steps
    now = time.monotonic()
    asked_at = self._asked_at.pop((p, answer.round_step), None)
    for key in [k for k in self._asked_at if k[0] == p and k[1] < answer.round_step]:
      del self._asked_at[key]  # Requests dropped unanswered (their rounds merged meanwhile).
    older = self._senders.enqueue(answer, asked_at=asked_at, answered_at=now)
    if older is not None:  # Never pushed: the new snapshot holds its progress and its tokens.
      self.learner.kernel.ledger.fold(p, older, answer.step)

  def _wait_for_merges(self) -> None:
    """`blocking` only, once a step boundary said so: waits while it does, at a due step for its
    round and at answer + τ until the round's merge has arrived (docs/algorithm.md §3)."""
    t0 = time.monotonic()
    blocked = True
    while blocked and not self.stop_requested and not self._stop.is_set():
      self._stop.wait(0.002)
      self._waits += 1
      blocked = self._boundary().blocked
    self.blocked_s += time.monotonic() - t0

  def _count_checks(self, checks: Iterable[DigestCheck]) -> None:
    """Counts the applies' digest checks that differ from the syncer's (docs/algorithm.md §4.7)."""
    for check in checks:
      if not check.ok:
        self.digest_mismatches += 1
        log.error(
          "learner %d: fragment %d v%d digest %s != %s",
          self.id,
          check.fragment,
          check.version,
          check.digest,
          check.expected,
        )
      self.applies.append((check.fragment, check.version, check.digest))

  # -- the loop -------------------------------------------------------------------------------

  def train(self, num_steps: int) -> float:
    """The training loop, until the step reaches `num_steps` or a stop is requested.

    Needs the background threads (`LearnerWorker.start`). Runs the hooks after each step. Returns
    the seconds spent.
    """
    t_first = time.monotonic()
    recent: collections.deque[float] = collections.deque(maxlen=17)
    previous = None
    done = 0  # Steps of this call: a restored learner compiles on its first steps too.
    self.train_start = time.time()
    while self.learner.kernel.step < num_steps and not self.stop_requested:
      self.drain()
      if previous is not None and (self.learner.config.blocking or self.learner.due()):
        # An answer snapshots θ of the step last dispatched: wait for that step here, before
        # dispatching the next, so the sender's host copy is ready at once. Snapshotting after
        # the next dispatch made every answer wait a whole step more in the sender (the main
        # job's answers then missed their rounds' grace windows).
        jax.block_until_ready(previous)
      if self._boundary().blocked:
        self._wait_for_merges()
      batch = next(self._data)
      if self.learner.config.step_in_flight:  # The boundary's work overlaps the next step.
        metrics = self.learner.train_step(batch)
      else:
        metrics = self.learner.start_step(batch, standby=self._standby())
      done += 1
      # At most one step in flight: wait for the previous step's loss (it releases the GIL for
      # the sender and comm threads). Without this, asynchronous dispatch let the step counter
      # run up to a logging interval ahead of the devices, and the schedule with it.
      if previous is not None:
        jax.block_until_ready(previous)
      previous = metrics["loss"]
      if not self.learner.config.step_in_flight:
        # The step is done before the protocol's work, and a round request that arrives during
        # it is answered at once with θ of the last step (with the next step in flight, it
        # waited for that step too: 1.5 steps on average, and the main job's answers missed
        # their windows).
        self._await_step(previous)
        self.learner.end_step()
      self.tokens_trained += int(np.prod(batch["targets"].shape))
      now = time.monotonic()
      # Step time over the last steps, not an EMA of loop times: with asynchronous dispatch one
      # loop can take microseconds and the next a whole step. The first steps compile: left out.
      if done > _WARMUP_STEPS:
        recent.append(now)
        if len(recent) >= 2:
          self.step_time_s = (recent[-1] - recent[0]) / (len(recent) - 1)
      for hook in self._hooks:
        if hook.due(self.learner.kernel.step, num_steps):
          hook.fn(self.learner.kernel.step, metrics)
    if previous is not None:  # The last step's boundary: answers and applies.
      jax.block_until_ready(previous)
      self._boundary()
    self._count_checks(self.learner.verified_applies(block=True))  # The last, deferred ones.
    self.train_end = time.time()
    return time.monotonic() - t_first

  # -- answering while a step runs ------------------------------------------------------------

  def start(self) -> None:
    """Starts the step waiter's thread where rounds are answered mid-step."""
    if self.learner.device.answers_mid_step and self._step_waiter is None:
      self._step_waiter = StepWaiter(name=f"learner{self.id}-step")

  def poke(self) -> None:
    """A round request was queued (the rounds thread): answer it now if a step is running."""
    waiter = self._step_waiter
    if waiter is not None:
      waiter.poke()

  def close(self) -> None:
    """Stops the step waiter's thread."""
    waiter, self._step_waiter = self._step_waiter, None
    if waiter is not None:
      waiter.close()

  def _await_step(self, loss: jax.Array) -> None:
    """Waits for the step in flight; rounds asked meanwhile are answered at once, with θ_p of the
    last step (`Learner.start_step`), where the devices can read it."""
    if not self.learner.device.answers_mid_step:  # Several processes: at boundaries only.
      jax.block_until_ready(loss)
      return
    if self._step_waiter is None:
      self._step_waiter = StepWaiter(name=f"learner{self.id}-step")
    self._step_waiter.wait(loss, self._answer_mid_step)

  def _answer_mid_step(self) -> None:
    self._boundary(at_boundary=False)

  def _standby(self) -> tuple[int, ...]:
    """The fragments the syncer will likely ask for during the next step: those due at the two
    round steps after the newest asked (copied on device where the step donates θ)."""
    if not self.learner.device.copies_standby or self._newest_round_step < 0:
      return ()  # On CPU θ stays readable without copies.
    t = max(self._newest_round_step, self._inbox.fleet_step)
    return tuple(p for s in (t + 1, t + 2) for p in self.learner.schedule.due(s))
