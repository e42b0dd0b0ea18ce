"""The threads through which a learner process hears from the syncer: heartbeats, the Rounds
stream and the puller (docs/algorithm.md §3).

- the comm thread sends heartbeats (the learner's step, from which the syncer's step clock takes the
  fleet's pace), announces any version it sees that the stream missed, and re-registers when the
  syncer forgot this learner;
- the rounds thread holds the syncer's `Rounds` stream: it queues every round request for the
  training thread and hands every announced version to the puller, so that a pull never delays a
  request;
- the puller pulls each announced version at once (a delta against the version held).

All three retry with exponential backoff while the syncer is unreachable; what they hear goes to
the training thread through the inbox (learner_process/inbox.py).
"""

import logging
import threading
import time
from collections.abc import Callable

import grpc

from ddiloco.fragments import shards as shards_lib
from ddiloco.learner_process.inbox import Inbox
from ddiloco.learner_process.link import SyncerLink
from ddiloco.learner_process.retry import UNREGISTERED, Backoff
from ddiloco.learner_process.session import SyncerSession
from ddiloco.protocol import RoundRequest
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.errors import WireError

log = logging.getLogger(__name__)


class SyncerListener:
  """The comm, rounds and puller loops of one learner (see module docstring); each runs in a
  thread of its own (`LearnerWorker.start`) until `stop` is set.

  Args:
    learner_id: this learner's id.
    client: the syncer client (heartbeats, the Rounds stream).
    link: the learner's link to the syncer (versions held, pulls).
    session: the learner's registration.
    inbox: where round requests, pulled fragments and settlements go.
    stop: set when the threads must stop.
    event: writes one event to this learner's metrics (`kind`, then its fields).
    pace: (schedule step, step time in seconds) for each heartbeat.
    on_request: called after each round request is queued (wakes the training thread).
  """

  def __init__(
    self,
    *,
    learner_id: int,
    client: SyncerClient,
    link: SyncerLink,
    session: SyncerSession,
    inbox: Inbox,
    stop: threading.Event,
    event: Callable[..., None],
    pace: Callable[[], tuple[int, float]],
    on_request: Callable[[], None],
  ):
    self.id = learner_id
    self._client = client
    self._link = link
    self._session = session
    self._inbox = inbox
    self._stop = stop
    self._event = event
    self._pace = pace
    self._on_request = on_request
    self._announced: dict[int, int] = {}  # Fragment -> newest version announced, not yet pulled.
    self._announce_cv = threading.Condition()
    self._stream = None  # The current Rounds subscription (cancelled at the end).
    self.unreachable_s = 0.0

  def wake(self) -> None:
    """Wakes the puller (after `stop` was set)."""
    with self._announce_cv:
      self._announce_cv.notify_all()

  def cancel_stream(self) -> None:
    stream = self._stream
    if stream is not None:
      stream.cancel()

  def _announce(self, p: int, version: int) -> None:
    """Asks the puller for version `version` of p (or newer), unless it is held already."""
    if not 0 <= p < self._link.num_fragments:
      return
    with self._announce_cv:
      if version > self._link.newest(p) and version > self._announced.get(p, -1):
        self._announced[p] = version
        self._announce_cv.notify_all()

  def comm_loop(self) -> None:
    """Heartbeats (and registers again when the syncer forgot this learner)."""
    backoff = Backoff(seed=self.id)
    down_since = None
    while not self._stop.is_set():
      try:
        if self._session.need_register.is_set():
          self._session.register()
        step, step_time_s = self._pace()
        hb = self._client.heartbeat(self.id, step=step, step_time_s=step_time_s)
        if not hb.registered:
          self._session.need_register.set()
          continue
        self._inbox.fleet_step = int(hb.fleet_step)
        # The training thread settles the ledger with it (`TrainingLoop.drain`).
        self._inbox.post_settle((list(hb.versions), list(hb.merged_steps)))
        # Versions the Rounds stream missed (e.g. reconnecting), or whose pull failed: only
        # those newer than held (one read of the link, not a lock per fragment per heartbeat).
        newest = self._link.newest_all()
        for p, version in enumerate(hb.versions):
          if p < len(newest) and version > newest[p]:
            self._announce(p, int(version))
        if down_since is not None:
          self.unreachable_s += time.monotonic() - down_since
          self._event("reconnected", after_s=round(time.monotonic() - down_since, 3))
          down_since = None
        backoff.reset()
        self._stop.wait(self._session.heartbeat_interval_s)
      except grpc.RpcError as e:
        if e.code() in UNREGISTERED:
          self._session.need_register.set()
          self._stop.wait(backoff.next_delay())
          continue
        if down_since is None:
          down_since = time.monotonic()
          self._event("unreachable", code=e.code().name, details=e.details())
        self._stop.wait(backoff.next_delay())

  def round_loop(self) -> None:
    """Holds the Rounds stream: queues round requests, pulls announced versions (docs/algorithm.md §3)."""
    backoff = Backoff(seed=2000 + self.id)
    while not self._stop.is_set():
      if self._session.need_register.is_set():
        self._stop.wait(0.05)  # The comm thread registers; a stream before that is refused.
        continue
      epoch = self._session.registrations
      stream = self._client.rounds(self.id)
      self._stream = stream
      try:
        for event in stream:
          if self._stop.is_set():
            break
          if isinstance(event, RoundRequest):
            self._inbox.requests.put((event, time.monotonic()))
            self._on_request()  # Answered at once, with θ of the last step (`_await_step`).
          else:
            self._announce(*event)
          backoff.reset()
      except grpc.RpcError as e:
        if self._stop.is_set():
          break
        if self._session.unregistered(e, epoch):
          self._session.need_register.set()
        elif e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # A subscription's end: renew it.
          self._stop.wait(backoff.next_delay())
      finally:
        stream.cancel()

  def pull_loop(self, shard: int = 0, shards: int = 1) -> None:
    """Pulls every announced version of shard `shard`'s fragments (of `shards`; fragment p's is
    p mod S), newest first per fragment, in announcement order: each shard has a puller of its
    own, so a shard that is down, or slow to send, never holds up another's versions.

    A pull that fails backs off (its fragment is announced again, and pulled after the delay);
    the heartbeat announces what a failed pull left behind too.
    """
    backoff = Backoff(seed=3000 + 100 * shard + self.id)
    retry_at = 0.0
    while not self._stop.is_set():
      with self._announce_cv:
        while not self._stop.is_set():
          now = time.monotonic()
          if now >= retry_at and any(self._owns(p, shard, shards) for p in self._announced):
            break
          self._announce_cv.wait(min(0.5, retry_at - now) if retry_at > now else 0.5)
        announced = {p: v for p, v in self._announced.items() if self._owns(p, shard, shards)}
        for p in announced:
          del self._announced[p]
        known = {p: self._link.newest(p) for p in announced}
      epoch = self._session.registrations
      for p, version in announced.items():
        if self._stop.is_set() or version <= known[p]:
          continue
        if time.monotonic() < retry_at:  # A pull of this shard failed just now.
          self._announce(p, version)
          continue
        try:
          state = self._link.pull(p, known[p])
        except grpc.RpcError as e:
          if self._session.unregistered(e, epoch):
            self._session.need_register.set()
          retry_at = time.monotonic() + backoff.next_delay()
          self._announce(p, version)
          continue
        except WireError as e:  # A corrupt or mismatching fragment: fetch it in full next time.
          log.error("learner %d: bad fragment from the syncer: %s", self.id, e)
          self._event("bad_fragment", error=str(e))
          self._link.forget_deliveries()
          retry_at = time.monotonic() + backoff.next_delay()
          continue
        backoff.reset()
        if state is not None:
          self._inbox.received.put(state)

  @staticmethod
  def _owns(p: int, shard: int, shards: int) -> bool:
    return shards_lib.shard_of(p, shards) == shard
