"""What a learner process's background threads hand its training thread: round requests, merged
fragments, push answers and the syncer's word on which reports merged.

The rounds, puller, sender and comm threads `put` into the queues and post the settlement; only
the training thread takes from them (`TrainingLoop.drain`), so only it touches the `Learner`. A
multi-process learner gates the queues so that every process takes the same items at the same step
(learner_process/multihost.py).
"""

import queue
import threading
from typing import Any

from ddiloco.protocol import FragmentState, ReportResult, RoundRequest

# (newest version of each fragment, step of the newest report of each merged): `TokenLedger.settle`.
Settlement = tuple[list[int], list[int]]


class Inbox:
  """The queues and slots between a learner's background threads and its training thread.

  Args:
    requests: round requests from the Rounds stream, as (request, monotonic arrival time).
    received: merged fragments pulled from the syncer.
    results: (fragment, report step, answer), or (fragment, report step, step of the newer report
      it was folded into): a report whose push failed after a newer snapshot of p was queued.
    Each defaults to a `queue.Queue`; any object with `put` and `get_nowait` does.
  """

  def __init__(self, *, requests: Any = None, received: Any = None, results: Any = None):
    self.requests: queue.Queue[tuple[RoundRequest, float]] = _or_queue(requests)
    self.received: queue.Queue[FragmentState] = _or_queue(received)
    self.results: queue.Queue[tuple[int, int, ReportResult | int]] = _or_queue(results)
    self.fleet_step = -1  # The syncer's step clock, as last heard (heartbeats, push answers).
    self._lock = threading.Lock()
    self._settle: Settlement | None = None  # Newest (versions, merged_steps).

  def post_settle(self, settle: Settlement | None) -> None:
    """Replaces the settlement the training thread takes next (the newest wins)."""
    with self._lock:
      self._settle = settle

  def peek_settle(self) -> Settlement | None:
    """The settlement the training thread would take next, left in place."""
    with self._lock:
      return self._settle

  def take_settle(self) -> Settlement | None:
    """The newest settlement posted since the last take, or None."""
    with self._lock:
      settle, self._settle = self._settle, None
    return settle


def _or_queue(q: Any) -> Any:
  return queue.Queue() if q is None else q
