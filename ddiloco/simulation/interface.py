"""What the simulated cluster needs of the syncer: the transport interface it drives.

The simulated cluster (cluster.py) knows nothing of gRPC or threads. It drives a `Syncer` on its
virtual clock, and each of its learners talks to it through a `Link` of its own. The implementation
`simulate()` plugs in is the distributed runtime's own service reached over the in-process
transport (service/virtual.py, learner_process/link.py): the same door, core, codecs and
messages as a `ddiloco-syncer` with learner processes.
"""

from collections.abc import Callable
from typing import Any, Protocol

from ddiloco.learner.held import HeldVersions
from ddiloco.protocol import Answer, FragmentState, ReportResult, RoundRequest
from ddiloco.syncer.core import MergeEvent, SyncerCore

# What a subscription hands over: a round request, or a (fragment, version) just published.
Announcement = RoundRequest | tuple[int, int]


class Registration(Protocol):
  """What a learner learns when it registers."""

  versions: tuple[int, ...]
  fleet_step: int
  overlap: int


class Heartbeat(Protocol):
  """A heartbeat's answer."""

  registered: bool
  versions: Any  # Sequence[int]
  merged_steps: Any  # Sequence[int]


class Link(Protocol):
  """One learner's connection to the syncer (learner_process/link.py `SyncerLink`)."""

  learner_id: int
  bytes_received: int  # Bytes pulled so far.

  def register(self, *, num_devices: int = 0, batch_size: int = 0, host: str = "") -> Registration:
    """Registers (a new epoch: nothing counts as delivered until pulled again)."""

  def pull(self, p: int, known: int | None = None) -> FragmentState | None:
    """The newest version of p, or None if `known` (default: the newest held) is the newest."""

  def push(self, answer: Answer) -> ReportResult:
    """Sends an answer as the outer gradient against its anchor (fp32 θ without one)."""

  def heartbeat(self, step: int, step_time_s: float = 0.0) -> Heartbeat:
    """Reports the learner's schedule step and step time."""

  def leave(self) -> bool:
    """Leaves the fleet."""


class Syncer(Protocol):
  """The syncer on a virtual clock (service/virtual.py `VirtualSyncer`)."""

  @property
  def core(self) -> SyncerCore:
    """The core, to read versions, states, counters and the ledger (never to change)."""

  def link(self, learner_id: int, *, held: HeldVersions | None = None) -> Link:
    """A new connection for a (re)started learner, pulling into the versions it holds."""

  def subscribe(
    self,
    link: Link,
    on_event: Callable[[Announcement], None],
    on_close: Callable[[], None] = ...,
  ) -> list[Announcement]:
    """Subscribes a registered learner to round requests and announcements; returns the open
    rounds and the current versions."""

  def advance(self, *, open_rounds: bool = True) -> None:
    """Does what is due at the clock now (rounds unless not `open_rounds`, merges, liveness)."""

  def next_wakeup(self) -> float | None:
    """When `advance` next has something to do."""

  def merge_log(self) -> list[MergeEvent]:
    """Every merge published so far, in order."""

  def observe_sync_time(self, seconds: float) -> None:
    """Folds a merge's delivery time into the grace window's ξ_sync."""

  def stats(self) -> dict[str, Any]:
    """The core's counters with the service's refusals and wire bytes."""

  def traffic(self) -> tuple[int, int]:
    """(bytes pushed, bytes pulled) on the wire."""

  @property
  def config(self) -> Any:
    """The service's settings: `uplink_codec`, `downlink_codec`, `block_size` at least."""

  def close(self) -> None:
    """Releases the syncer."""
