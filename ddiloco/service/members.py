"""The syncer service's member table: sessions, liveness and eviction of the learners it knows.

What the service knows of a learner beyond the core (`SyncerCore` keeps the protocol's records:
delivery, counters, the token ledger):

- **Sessions.** Register issues a random session credential bound to the learner id and that
  registration; every later call for the id must carry it, or is refused PERMISSION_DENIED. A new
  registration voids the previous one's session (a restarted learner rejoins without its old
  credential).
- **Liveness.** A learner silent for `liveness_timeout_s` (no push, pull, heartbeat or stream) is
  declared dead (`SyncerCore.leave`); its next call is refused FAILED_PRECONDITION and it
  registers again.
- **Eviction.** A learner that left or was declared dead `member_retention_s` ago is forgotten
  (and the longest-gone first once `max_members` are known); its next call finds it unregistered.

Not thread-safe, but for `learner_of`: the service calls it under its lock.
"""

import dataclasses
import hmac
import logging
import secrets
import threading
from collections.abc import Callable

import grpc

from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import SyncerCore
from ddiloco.transport import auth

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Member:
  """One learner's record: liveness clock, session, and what it said of itself at Register."""

  last_seen: float
  session: str = ""
  left_at: float | None = None  # When it left or was declared dead (None: alive, or not noticed).
  host: str = ""
  num_devices: int = 0
  batch_size: int = 0
  step: int = 0


class Members:
  """The learners the service knows (see module docstring).

  Args:
    core: the syncer core (which learners are alive; `leave` for the dead).
    config: liveness timeout, retention and table size.
    clock: the service's clock.
    refuse: makes (and counts) a refusal from a status code and a message.
  """

  def __init__(
    self,
    core: SyncerCore,
    config: ServiceConfig,
    clock: Callable[[], float],
    refuse: Callable[[grpc.StatusCode, str], Exception],
  ):
    self._core = core
    self._cfg = config
    self._clock = clock
    self._refuse = refuse
    self._table: dict[int, Member] = {}
    self._sessions: dict[str, int] = {}  # Each current session's learner.
    # `learner_of` is called without the service's lock (admission must not wait for a busy
    # syncer): the sessions have a lock of their own.
    self._sessions_lock = threading.Lock()

  def ids(self) -> frozenset[int]:
    """Ids in the table (alive, or gone and not yet forgotten)."""
    return frozenset(self._table)

  def get(self, learner_id: int) -> Member | None:
    return self._table.get(learner_id)

  def ensure_room(self, learner_id: int) -> None:
    """Makes room for `learner_id` in a full table (forgetting the longest-gone learner).

    Raises:
      Refusal: RESOURCE_EXHAUSTED for a new id when `max_members` are known and alive.
    """
    if (
      learner_id not in self._table
      and len(self._table) >= self._cfg.max_members
      and not self._make_room()
    ):
      raise self._refuse(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{self._cfg.max_members} learners are registered and alive; no room for learner "
        f"{learner_id}.",
      )

  def admit(self, learner_id: int, *, host: str, num_devices: int, batch_size: int) -> str:
    """Records a registration and returns its new session (the core registers it separately;
    call `ensure_room` first)."""
    # A new session voids the previous registration's: its calls are refused from now on.
    session = secrets.token_urlsafe(24)
    self._forget(learner_id)
    with self._sessions_lock:
      self._sessions[session] = learner_id
    self._table[learner_id] = Member(
      last_seen=self._clock(),
      session=session,
      host=host,
      num_devices=num_devices,
      batch_size=batch_size,
    )
    return session

  def learner_of(self, session: str) -> int | None:
    """The learner whose current session `session` is, or None (a hint for admission: `check`
    is what authorizes a call). Thread-safe without the service's lock."""
    with self._sessions_lock:
      return self._sessions.get(session)

  def check(self, learner_id: int, session: str) -> Member:
    """The learner's record if it is registered, alive and `session` is its own; marks it seen.

    Raises:
      Refusal: NOT_FOUND (never registered or forgotten), FAILED_PRECONDITION (left or declared
        dead), PERMISSION_DENIED (a missing or stale session).
    """
    member = self._table.get(learner_id)
    if member is None:
      raise self._refuse(
        grpc.StatusCode.NOT_FOUND, f"Learner {learner_id} is not registered; call Register first."
      )
    if learner_id not in self._core.alive():
      raise self._refuse(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Learner {learner_id} is not alive at the syncer (left or timed out); register again.",
      )
    self.check_session(learner_id, member, session)
    member.last_seen = self._clock()
    return member

  def check_session(self, learner_id: int, member: Member, session: str) -> None:
    """Raises PERMISSION_DENIED unless `session` is `member`'s."""
    if not session:
      raise self._refuse(
        grpc.StatusCode.PERMISSION_DENIED,
        f"Missing '{auth.SESSION_METADATA_KEY}' metadata for learner {learner_id}: send the "
        "session its Register returned.",
      )
    if not hmac.compare_digest(session.encode(), member.session.encode()):
      raise self._refuse(
        grpc.StatusCode.PERMISSION_DENIED,
        f"Wrong session for learner {learner_id}: it registered again since; register again.",
      )

  def left(self, learner_id: int) -> None:
    """Marks a learner gone now (it left): forgotten after the retention."""
    member = self._table.get(learner_id)
    if member is not None:
      member.left_at = self._clock()

  def sweep(self) -> list[int]:
    """Declares silent learners dead (`SyncerCore.leave`) and forgets those gone for
    `member_retention_s`; returns the ids declared dead now."""
    now = self._clock()
    alive = self._core.alive()
    dead = []
    for learner_id, member in list(self._table.items()):
      if learner_id in alive:
        if now - member.last_seen >= self._cfg.liveness_timeout_s:
          log.warning(
            "learner %d silent for %.1f s: declared dead", learner_id, now - member.last_seen
          )
          self._core.leave(learner_id)
          member.left_at = now
          dead.append(learner_id)
      elif member.left_at is None:
        member.left_at = now  # Left the core another way (e.g. a restored checkpoint).
      elif now - member.left_at > self._cfg.member_retention_s:
        self._forget(learner_id)
    return dead

  def next_deadline(self) -> float | None:
    """When the next alive learner will have been silent for the liveness timeout."""
    alive = self._core.alive()
    times = [
      m.last_seen + self._cfg.liveness_timeout_s for i, m in self._table.items() if i in alive
    ]
    return min(times) if times else None

  def _make_room(self) -> bool:
    """Frees a place in a full table, forgetting the longest-gone learner; False if every known
    learner is alive."""
    alive = self._core.alive()
    gone = [(m.left_at or 0.0, i) for i, m in self._table.items() if i not in alive]
    if not gone:
      return False
    self._forget(min(gone)[1])
    return True

  def _forget(self, learner_id: int) -> None:
    member = self._table.pop(learner_id, None)
    if member is not None:
      with self._sessions_lock:
        self._sessions.pop(member.session, None)
