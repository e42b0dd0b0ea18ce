"""What learners may see of each fragment: a merged version is served only once it is durable.

A merged version is served (announced, pulled, listed in Register, Heartbeat and Status) only once
`record` (the merge journal) has made it durable and `on_merge` returned; the served version of
each fragment is kept apart from the core's. If either raises an OSError (a full disk), the version
is never served and the service halts: it merges and opens no more rounds and keeps serving the
last durable versions (`halted` says why).
"""

import logging
from collections.abc import Callable

from ddiloco.service.downlink import DownlinkAdopter
from ddiloco.syncer.core import FragmentState, MergeEvent, SyncerCore
from ddiloco.transport.events import published_event
from ddiloco.transport.proto import syncer_pb2

log = logging.getLogger(__name__)


class Publisher:
  """The served versions, their digests and the merge log (see module docstring).

  Not thread-safe: the service calls it under its lock.

  Args:
    core: the syncer core.
    broadcast: queues an event on every learner's Rounds stream.
    adopter: a lossy downlink codec's adoption, told of each published version (None if exact).
    on_merge: called with each merge's MergeEvent after `record`, before its version is served.
    record: makes a merge durable (the merge journal) before its version is served.
  """

  def __init__(
    self,
    core: SyncerCore,
    broadcast: Callable[[syncer_pb2.SyncerEvent], None],
    *,
    adopter: DownlinkAdopter | None,
    on_merge: Callable[[MergeEvent], None] | None,
    record: Callable[[MergeEvent], None] | None,
  ):
    self._core = core
    self._broadcast = broadcast
    self._adopter = adopter
    self._on_merge = on_merge
    self._record = record
    # What learners may see of each fragment: the core's version once `record` made it durable.
    self._served = [core.version(p) for p in range(core.num_fragments)]
    self._halted: str | None = None
    self._merges = 0
    self._digests: dict[tuple[int, int], str] = {
      (p, 0): core.state(p).digest for p in range(core.num_fragments)
    }
    self._merge_log: list[MergeEvent] = []

  @property
  def halted(self) -> str | None:
    """Why merging stopped (a version could not be made durable), or None."""
    return self._halted

  @property
  def merges(self) -> int:
    """Merges published since start."""
    return self._merges

  def versions(self) -> list[int]:
    """Each fragment's served version."""
    return list(self._served)

  def version(self, p: int) -> int:
    return self._served[p]

  def digests(self) -> dict[tuple[int, int], str]:
    """{(fragment, version): digest} of every version published since start."""
    return dict(self._digests)

  def merge_log(self) -> list[MergeEvent]:
    return list(self._merge_log)

  def served_state(self, p: int) -> FragmentState:
    """Fragment p at its served version."""
    if self._served[p] == self._core.version(p):
      return self._core.state(p)
    return self._core.state_at(p, self._served[p])  # Kept: keep_versions >= 2.

  def publish(self, event: MergeEvent) -> None:
    """Serves a merged version once `record` and `on_merge` returned; an OSError halts instead."""
    if self._halted is None:
      try:
        for hook in (self._record, self._on_merge):
          if hook is not None:
            hook(event)
      except OSError as e:  # A full disk: the version may not be durable.
        self._halted = f"a merge could not be recorded ({e})"
        log.error("syncer halted: %s; serving the last durable versions", self._halted)
    if self._halted is not None:
      log.error(
        "version %d of fragment %d is not durable: never served", event.version, event.fragment
      )
      return
    self._served[event.fragment] = event.version
    self._merges += 1
    self._digests[(event.fragment, event.version)] = event.digest
    self._merge_log.append(event)
    if self._adopter is not None:
      self._adopter.published(event.fragment, event.version, event.digest)
    self._broadcast(published_event(event.fragment, event.version))

  def record_republished(self, event: MergeEvent) -> bool:
    """Makes a republished version durable (`record`); False, halted, if that raised an OSError."""
    try:
      if self._record is not None:
        self._record(event)
    except OSError as e:
      self._halted = f"a republished version could not be recorded ({e})"
      log.error("syncer halted: %s", self._halted)
      return False
    return True

  def serve_version(self, p: int, version: int, digest: str) -> None:
    """Makes a (durable) version of p visible: served, digest recorded, announced."""
    self._served[p] = version
    self._digests[(p, version)] = digest
    self._broadcast(published_event(p, version))

  def refresh(self) -> None:
    """Records and serves the core's current versions (after its state was restored)."""
    for p in range(self._core.num_fragments):
      st = self._core.state(p)
      self._digests[(p, st.version)] = st.digest
      self._served[p] = st.version
