"""The learners the syncer knows: registration, liveness, deliveries and their step samples
(docs/algorithm.md §3, §6)."""

import math
from collections.abc import Callable, ItemsView

from ddiloco.protocol import MAX_STEP
from ddiloco.syncer.types import LearnerRecord


class LearnerRegistry:
  """One `LearnerRecord` per learner that ever registered, on an injected clock."""

  def __init__(self, clock: Callable[[], float], max_step_rate: float):
    self._clock = clock
    self._max_step_rate = max_step_rate
    self._learners: dict[int, LearnerRecord] = {}

  def register(self, learner_id: int) -> None:
    """Marks a learner alive (docs/algorithm.md §6).

    Re-registering (after a crash) forgets what was delivered to it: until it fetches p again its
    reports of p weigh 0 (docs/algorithm.md §3). Its reports already in open rounds stay there.

    Raises:
      ValueError: if learner_id is negative.
    """
    if learner_id < 0:
      raise ValueError(f"learner_id must be >= 0, got {learner_id}.")
    learner = self._learners.get(learner_id)
    if learner is None:
      self._learners[learner_id] = LearnerRecord()
    else:
      learner.alive, learner.epoch, learner.delivered = True, learner.epoch + 1, {}
      learner.progress, learner.steps_seen, learner.rate = None, None, 0.0
      learner.position = -1

  def leave(self, learner_id: int) -> None:
    """Marks a learner not alive (crash detected or scale-down); idempotent.

    Its reports already in open rounds stay there; it no longer holds up an early close.

    Raises:
      ValueError: if the learner never registered.
    """
    self.require(learner_id).alive = False

  def get(self, learner_id: int) -> LearnerRecord | None:
    """The learner's record, or None if it never registered."""
    return self._learners.get(learner_id)

  def require(self, learner_id: int) -> LearnerRecord:
    """The learner's record.

    Raises:
      ValueError: if the learner never registered.
    """
    learner = self._learners.get(learner_id)
    if learner is None:
      raise ValueError(f"Learner {learner_id} never registered.")
    return learner

  def __contains__(self, learner_id: object) -> bool:
    return learner_id in self._learners

  def items(self) -> ItemsView[int, LearnerRecord]:
    """(id, record) of every learner that ever registered."""
    return self._learners.items()

  def records(self) -> list[LearnerRecord]:
    return list(self._learners.values())

  def alive(self) -> frozenset[int]:
    return frozenset(i for i, lr in self._learners.items() if lr.alive)

  def delivered(self, learner_id: int) -> frozenset[int]:
    learner = self._learners.get(learner_id)
    return frozenset(learner.delivered) if learner is not None else frozenset()

  def mark_delivered(self, learner_id: int, fragment: int, version: int, current: int) -> None:
    """Records that `version` of `fragment` (whose current version is `current`) reached a learner.

    Raises:
      ValueError: if the learner is not alive or the version never existed.
    """
    learner = self.require(learner_id)
    if not learner.alive:
      raise ValueError(f"Learner {learner_id} is not alive; it must register again.")
    if not 0 <= version <= current:
      raise ValueError(
        f"Version {version} of fragment {fragment} does not exist (current {current})."
      )
    learner.delivered[fragment] = max(version, learner.delivered.get(fragment, -1))

  def observe_progress(self, learner_id: int, step: int, step_time_s: float) -> None:
    """Records an alive learner's schedule step and step time now (from its reports)."""
    learner = self._learners.get(learner_id)
    if learner is None or not learner.alive or not 0 <= step <= MAX_STEP:
      return
    if not math.isfinite(step_time_s) or step_time_s < 0:
      step_time_s = 0.0
    if learner.progress is None or step >= learner.progress[0]:
      learner.progress = (int(step), self._clock(), float(step_time_s))

  def observe_steps(
    self,
    learner_id: int,
    inner_step: int,
    *,
    step_time_s: float = 0.0,
    min_interval_s: float = 1.0,
  ) -> None:
    """Samples an alive learner's schedule step (heartbeats) for its rate (cadence_step).

    `step_time_s`, the learner's own measure of its step time, sets its rate until two samples
    `min_interval_s` apart have measured it: the clock then starts with the first heartbeats
    instead of a second later.
    """
    learner = self._learners.get(learner_id)
    if learner is None or not learner.alive or not 0 <= inner_step <= MAX_STEP:
      return
    now = self._clock()
    learner.position, learner.heard = int(inner_step), now
    max_rate = self._max_step_rate
    if learner.rate == 0 and math.isfinite(step_time_s) and step_time_s > 0:
      learner.rate = min(1.0 / step_time_s, max_rate)
    if learner.steps_seen is None or inner_step < learner.steps_seen[0]:
      learner.steps_seen = (int(inner_step), now)
      return
    step0, t0 = learner.steps_seen
    if now - t0 < min_interval_s:
      return
    rate = min((inner_step - step0) / (now - t0), max_rate)
    # Half-weight samples: the first ones include compilation, and a slow EMA kept the cadence
    # behind a lone learner for dozens of steps (measured: 40 holds in 128 steps).
    learner.rate = rate if learner.rate == 0 else 0.5 * learner.rate + 0.5 * rate
    learner.steps_seen = (int(inner_step), now)

  def restore(self, learners: dict[int, LearnerRecord]) -> None:
    """Replaces every record (a checkpoint's)."""
    self._learners = learners
