"""Learners' `Rounds` streams: who is subscribed, the events they are sent, and a stream's reader.

A learner has at most one subscription; a new one replaces the old. The service queues every round
it opens and every version it publishes on all of them (docs/algorithm.md §3-4).
"""

import queue
from collections.abc import Iterator

from ddiloco.transport.proto import syncer_pb2


class Subscription:
  """One learner's `Rounds` stream: the events waiting to be sent; None closes it.

  Any object with `put(event)` and `close()` can subscribe instead (`SyncerService.subscribe`):
  the simulated cluster's does, on its virtual clock (service/virtual.py).
  """

  def __init__(self):
    self.events: queue.SimpleQueue[syncer_pb2.SyncerEvent | None] = queue.SimpleQueue()

  def put(self, event: syncer_pb2.SyncerEvent) -> None:
    self.events.put(event)

  def close(self) -> None:
    self.events.put(None)


def stream_events(initial, sub: Subscription, context) -> Iterator[syncer_pb2.SyncerEvent]:
  """A Rounds stream's events: `initial`, then the subscription's until it closes."""
  yield from initial
  while context.is_active():
    try:
      event = sub.events.get(timeout=0.5)
    except queue.Empty:
      continue
    if event is None:
      return
    yield event


class Subscribers:
  """Each learner's subscription (a `Subscription`, or any sink with `put` and `close`).

  Not thread-safe: the service calls it under its lock.
  """

  def __init__(self):
    self._subs: dict[int, Subscription] = {}

  def __len__(self) -> int:
    return len(self._subs)

  def __contains__(self, learner_id: int) -> bool:
    return learner_id in self._subs

  def broadcast(self, event: syncer_pb2.SyncerEvent) -> None:
    """Queues an event on every learner's Rounds stream."""
    for sub in self._subs.values():
      sub.put(event)

  def replace(self, learner_id: int, sink: Subscription) -> None:
    """Subscribes `sink` for a learner, ending its previous subscription."""
    self.unsubscribe(learner_id)  # A new subscription replaces the old one.
    self._subs[learner_id] = sink

  def unsubscribe(self, learner_id: int) -> None:
    """Ends a learner's Rounds stream."""
    sub = self._subs.pop(learner_id, None)
    if sub is not None:
      sub.close()

  def discard(self, learner_id: int, sink: Subscription) -> None:
    """Forgets `sink` if it is still the learner's subscription (its stream ended)."""
    if self._subs.get(learner_id) is sink:
      del self._subs[learner_id]

  def close_all(self) -> None:
    """Ends every Rounds stream (the service stops)."""
    for sub in self._subs.values():
      sub.close()
    self._subs.clear()
