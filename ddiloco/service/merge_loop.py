"""The service's merge thread: the core's step clock driven at the service's clock.

At each wake-up it does what is due (`advance`): the end of a recovery window, the rounds that came
due (announced on every Rounds stream), the merges whose time has come (published once durable,
service/publication.py), and liveness (service/members.py). A service on a virtual clock
does not start the thread and calls `advance` at `next_wakeup` itself (service/virtual.py).
"""

import logging
import threading
from collections.abc import Callable

from ddiloco.service.members import Members
from ddiloco.service.publication import Publisher
from ddiloco.service.recovery import Recovery
from ddiloco.service.subscriptions import Subscribers
from ddiloco.syncer.core import SyncerCore
from ddiloco.transport.events import round_event

log = logging.getLogger(__name__)


class MergeLoop:
  """Drives the core's rounds and merges (see module docstring).

  `advance`, `next_wakeup` and `flush` are called with the service's lock held; `start` and `stop`
  without it.

  Args:
    core: the syncer core.
    lock: the service's lock, which the thread holds except while it waits.
    clock: the service's clock.
    max_wait_s: the longest the thread sleeps between wake-ups.
    publisher, recovery, members, subscribers: the service's collaborators.
  """

  def __init__(
    self,
    core: SyncerCore,
    lock: threading.Condition,
    clock: Callable[[], float],
    max_wait_s: float,
    *,
    publisher: Publisher,
    recovery: Recovery,
    members: Members,
    subscribers: Subscribers,
  ):
    self._core = core
    self._cond = lock
    self._clock = clock
    self._max_wait_s = max_wait_s
    self._publisher = publisher
    self._recovery = recovery
    self._members = members
    self._subscribers = subscribers
    self._stopping = False
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    """Starts the merge thread (idempotent)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="syncer-merge", daemon=True)
      self._thread.start()

  def stop(self) -> None:
    """Stops the merge thread and waits for it."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=60)
      self._thread = None

  def _run(self) -> None:
    with self._cond:
      while not self._stopping:
        try:
          self.advance()
        except Exception:  # A bug must not kill the thread silently (a failed merge is atomic).
          log.exception("merge loop error")
          # Never spin on a failing step with the lock held: RPCs and a signal's stop() need it.
          self._cond.wait(0.05)
        wait = self._max_wait_s
        for deadline in (self._core.closer.next_deadline(), self._core.pacer.next_tick_time()):
          if (
            deadline is not None and self._publisher.halted is None
          ):  # Halted: overdue rounds stay so.
            wait = min(wait, max(deadline - self._clock(), 0.0))
        if wait > 0:
          self._cond.wait(wait)

  def advance(self, open_rounds: bool = True) -> None:
    """What is due at the clock now: recovery's end, the rounds that came due (announced) unless
    not `open_rounds`, the merges whose time has come (published), and liveness."""
    self._recovery.end_if_due()
    if self._publisher.halted is None:  # Halted: rounds stay as they are, nothing merges.
      for request in self._core.pacer.tick() if open_rounds else ():
        self._subscribers.broadcast(round_event(request))
      for event in self._core.closer.poll():
        self._publisher.publish(event)
    # Declares silent learners dead and forgets those gone long ago (service/members.py).
    for learner_id in self._members.sweep():
      self._subscribers.unsubscribe(learner_id)

  def next_wakeup(self) -> float | None:
    """The earliest clock time at which `advance` has something to do: a round coming due, a
    merge, the end of a recovery window, a learner's liveness deadline; None if none."""
    times = []
    if self._publisher.halted is None:
      times += [self._core.closer.next_deadline(), self._core.pacer.next_tick_time()]
    times.append(self._recovery.deadline())
    times.append(self._members.next_deadline())
    times = [t for t in times if t is not None]
    return min(times) if times else None

  def flush(self) -> None:
    """Merges every round that has its quorum, ignoring grace deadlines (shutdown)."""
    if self._publisher.halted is not None:
      return
    for event in self._core.closer.flush():
      self._publisher.publish(event)
