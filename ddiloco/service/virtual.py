"""The syncer service on a virtual clock: what the simulated cluster talks to.

`VirtualSyncer` is the runtime's `SyncerService` (the door, the core, the downlink adoption,
sessions, liveness and durability hooks of `ddiloco-syncer`) built on an injected clock and
served over the in-process transport with its merge thread not started: the simulated cluster
(simulation/cluster.py) calls `advance()` at `next_wakeup()`. Each simulated learner reaches it
through a `SyncerLink` of its own, over its own in-process channel: the same client, messages,
codecs and status codes as a learner process over its sockets. Round requests and version announcements
reach it through a subscription that calls back (the `Rounds` stream's, without the stream), so
that the simulator can deliver them after its network latency.

So the simulator and the distributed runtime run one protocol through one code path; they differ
in the clock and in when things happen (the simulator's events), not in what happens.
"""

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.held import HeldVersions
from ddiloco.learner_process.link import SyncerLink
from ddiloco.protocol import RoundRequest
from ddiloco.service import server
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import MergeEvent, SyncerCore
from ddiloco.syncer.types import SyncerConfig
from ddiloco.transport.client import SyncerClient, fragment_layouts
from ddiloco.transport.events import syncer_event

Announcement = RoundRequest | tuple[int, int]  # A round request, or (fragment, version) published.


class _Sink:
  """A subscription that hands each event, read as the learner reads it, to a callback."""

  def __init__(self, on_event: Callable[[Announcement], None], on_close: Callable[[], None]):
    self._on_event, self._on_close = on_event, on_close

  def put(self, event) -> None:
    read = syncer_event(event)
    if read is not None:
      self._on_event(read)

  def traffic(self) -> tuple[int, int]:
    return self.service.traffic()

  def close(self) -> None:
    self._on_close()


class VirtualSyncer:
  """A syncer service on `clock`, advanced by its caller (see module docstring).

  Args:
    fragment_keys: the layout's keys of each fragment.
    init_values: the initial global values, by key.
    syncer_config: quorum, grace, merge and outer optimizer.
    service_config: codecs, chunk size, heartbeats and liveness (in the clock's seconds).
    layout_digest: the layout's digest (learners register with it).
    embedding_keys: tensors merged with the weighted mean.
    schedule: the fragment schedule (P, H, τ).
    clock: the virtual clock.
  """

  def __init__(
    self,
    *,
    fragment_keys,
    init_values: Mapping[str, np.ndarray],
    syncer_config: SyncerConfig,
    service_config: ServiceConfig,
    layout_digest: str,
    embedding_keys=(),
    schedule: FragmentSchedule | None = None,
    clock: Callable[[], float],
  ):
    self.service = server.make_syncer(
      fragment_keys=fragment_keys,
      init_values=init_values,
      syncer_config=syncer_config,
      service_config=service_config,
      layout_digest=layout_digest,
      embedding_keys=embedding_keys,
      schedule=schedule,
      clock=clock,
    )
    self._server = server.serve_in_process(self.service, start=False)
    self._config = service_config
    self._digest = layout_digest
    self._layouts = fragment_layouts(fragment_keys, init_values)

  @property
  def core(self) -> SyncerCore:
    """The syncer core (read its versions, states, counters and ledger; do not change it)."""
    return self.service.core

  @property
  def config(self) -> ServiceConfig:
    return self._config

  def link(self, learner_id: int, *, held: HeldVersions | None = None) -> SyncerLink:
    """A new connection for `learner_id`: a client on a channel of its own, as a process has,
    pulling into `held` (its learner's kernel's versions; None: the link's own)."""
    client = SyncerClient(
      channel=self._server.channel(), max_chunk_bytes=self._config.max_chunk_bytes
    )
    return SyncerLink(
      client,
      learner_id=learner_id,
      layouts=self._layouts,
      layout_digest=self._digest,
      held=held,
    )

  def subscribe(
    self,
    link: SyncerLink,
    on_event: Callable[[Announcement], None],
    on_close: Callable[[], None] = lambda: None,
  ) -> list[Announcement]:
    """Subscribes `link`'s learner to round requests and announcements, as `Rounds` does.

    `on_event` gets each later one as it happens (under the service's lock: only schedule work
    from it), `on_close` the subscription's end (the learner left or was declared dead).

    Returns:
      What a new subscriber gets first: the rounds open now and every current version.

    Raises:
      refusals.Refusal: as `Rounds` refuses (e.g. a learner that is not registered).
    """
    initial = self.service.subscribe(
      link.learner_id, link.client.session(link.learner_id), _Sink(on_event, on_close)
    )
    return [read for e in initial if (read := syncer_event(e)) is not None]

  def advance(self, *, open_rounds: bool = True) -> None:
    """Does what is due at the clock now: opens rounds (unless not `open_rounds`), merges, ends
    recoveries, liveness."""
    self.service.advance(open_rounds=open_rounds)

  def next_wakeup(self) -> float | None:
    return self.service.next_wakeup()

  def merge_log(self) -> list[MergeEvent]:
    return self.service.merge_log()

  def observe_sync_time(self, seconds: float) -> None:
    """Folds the time to deliver a merge (ξ_sync) into the grace window, which the core cannot
    see on a virtual clock (docs/algorithm.md §4.2)."""
    with self.service.lock:
      self.core.grace.observe_sync_time(seconds)

  def stats(self) -> dict[str, Any]:
    """The core's counters, and the service's refusals and bytes on the wire."""
    with self.service.lock:
      stats = self.core.stats()
    bytes_up, bytes_down = self.service.traffic()
    return {
      **stats,
      "refused": self.service.refused(),
      "wire_up": bytes_up,
      "wire_down": bytes_down,
    }

  def traffic(self) -> tuple[int, int]:
    return self.service.traffic()

  def close(self) -> None:
    self._server.stop(flush=False)
