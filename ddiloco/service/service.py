"""The syncer as a service: the pure core behind a lock, a wall clock and a merge thread.

`SyncerService` implements `ddiloco.v1.Syncer` (transport/proto/syncer.proto), the control plane,
and the data plane's Push and Pull, which its bulk port serves (service/bulk_server.py). A background thread
(service/merge_loop.py) runs the core's step clock: it opens rounds as they come due and announces each on every learner's
`Rounds` stream, and merges rounds as their deadlines come, announcing every published version on the
same streams (docs/algorithm.md §3-4). Learners answer rounds with pushes and pull what was announced; nothing a
learner does waits for a merge. Decisions (docs/algorithm.md, "Distributed runtime"):

- Validation at the door: every request is checked before it can touch the core, and every refusal has
  a precise status and is counted by status name (`Status.refused`; the table is in
  service/refusals.py). A refused push leaves the global fragments, versions, optimizer states
  and rounds as they were. A retry of an answer already filed (same learner, round and counters)
  gets the first answer's reply, decided from the header: it is never filed twice
  (service/streams.py).
- A merge is all or nothing (`RoundCloser.poll`, `syncer/closing.py`), and the merge thread never
  retries a failing step with the lock held: RPCs and a signal's `stop()` always get through.
- Sessions: Register issues a random session credential bound to the learner id and that
  registration (RegisterResponse.session); every later push, pull, Heartbeat, Leave and Rounds call
  for the id must carry it (`ddiloco-session` metadata; a bulk hello's session), or is refused
  PERMISSION_DENIED (distinct
  from the shared token's UNAUTHENTICATED: re-registering fixes it, so learners register again on
  it). The shared token still admits Register for any id, which voids the previous session: a
  restarted learner must be able to rejoin without its old credential.
- Capacity (service/door.py): the gRPC server is synchronous, every call holding a thread for
  its life. Its pool has `control_workers + max_data_streams + max_rounds_streams` threads (a
  Recover is a data stream on gRPC); streams are admitted within their bounds, so at least
  `control_workers` threads always remain for Register, Heartbeat, Status, Leave and quick
  refusals. The bulk port holds a thread per connection (`ServiceConfig.bulk_connections` at
  most), admitted fairly between learners and timed by phase (service/bulk_server.py). A
  Recover is read through a helper thread so that a stalled stream is cut at its idle deadline
  with DEADLINE_EXCEEDED; stuck Rounds sends are cut by a watchdog. Calls beyond the pool wait in gRPC's queue, bounded by `max_pending_calls`
  (beyond it gRPC itself refuses RESOURCE_EXHAUSTED, not counted here).
- Members (service/members.py): the service forgets a learner that left or was declared dead `member_retention_s` ago
  (and the longest-gone first once `max_members` are known); its next call finds it unregistered and
  it registers again. The core's per-learner records (token ledger) are kept.
- Serving (service/server.py): control over gRPC and data over the bulk port, on ports that are
  never shared, or both in-process.
- Downlink (service/downlink.py): with a lossy downlink codec the syncer publishes what a
  learner decodes, so learners and syncer hold bit-identical fragments.
- Liveness: a learner that neither pushed, pulled nor sent a heartbeat for `liveness_timeout_s` is
  declared dead (`SyncerCore.leave`); its next call gets FAILED_PRECONDITION and it registers again.
- Durability (service/publication.py): a merged version is served (announced, pulled, listed in
  Register, Heartbeat and Status) only once `record` (the merge journal) has made it durable and
  `on_merge` returned. If either raises an OSError (a full disk), the version is never served and the
  service halts: it merges and opens no more rounds and keeps serving the last durable versions;
  `halted()` says why, and the syncer process then stops (launch/runtime.py).
- Recovery (service/recovery.py): versions a restart lost are taken back from learners.
"""

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np

from ddiloco.protocol import counter_error, step_time_error
from ddiloco.service import door
from ddiloco.service.downlink import DownlinkAdopter
from ddiloco.service.members import Members
from ddiloco.service.merge_loop import MergeLoop
from ddiloco.service.publication import Publisher
from ddiloco.service.recovery import Recovery
from ddiloco.service.refusals import Refusal, Refusals, call_session, run_or_abort
from ddiloco.service.service_config import ServiceConfig
from ddiloco.service.stream_gate import Admission
from ddiloco.service.streams import DataStreams
from ddiloco.service.subscriptions import Subscribers, Subscription, stream_events
from ddiloco.syncer.core import MergeEvent, SyncerCore
from ddiloco.transport.events import published_event, round_event
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "ddiloco.v1.Syncer"


class SyncerService(syncer_pb2_grpc.SyncerServicer):
  """The `ddiloco.v1.Syncer` servicer around one `SyncerCore` (see module docstring).

  Build the core with `adopt=service_adopter(...)`'s result when the downlink codec is lossy; use
  `make_syncer` to get both wired together.

  Args:
    core: the syncer core, built with `clock` as its clock.
    layout_digest: the fragment layout's digest; Register refuses any other.
    config: wire and liveness settings.
    clock: the core's clock (wall, monotonic).
    on_merge: called with each merge's MergeEvent after `record`, before its version is served
      (under the lock; keep it short); an OSError from it halts the service too.
    record: makes a merge durable (the merge journal), under the lock, before its version is
      served; an OSError from it halts the service (see the module docstring).
    on_recovery: called with (fragment, version, "recovered" | "republished") when a version a
      restart lost was handed back by a learner or republished without (`begin_recovery`).
    shard: this syncer's shard index (its core owns `core.owned`; fragments/shards.py).
    shard_addresses: every shard's host:port, told to learners at Register (empty: unsharded).
  """

  def __init__(
    self,
    core: SyncerCore,
    *,
    layout_digest: str,
    config: ServiceConfig,
    adopter: "DownlinkAdopter | None" = None,
    clock: Callable[[], float] = time.monotonic,
    on_merge: Callable[[MergeEvent], None] | None = None,
    record: Callable[[MergeEvent], None] | None = None,
    on_recovery: Callable[[int, int, str], None] | None = None,
    shard: int = 0,
    shard_addresses: Sequence[str] = (),
  ):
    self._core = core
    self._shard = shard
    self._shard_addresses = tuple(shard_addresses)
    self._cfg = config
    self._layout_digest = layout_digest
    self._clock = clock
    self._cond = threading.Condition()
    self._refusals = Refusals(self._cond)
    self._members = Members(core, config, clock, self._refusals.refuse)
    self._subscribers = Subscribers()
    self._publisher = Publisher(
      core, self._subscribers.broadcast, adopter=adopter, on_merge=on_merge, record=record
    )
    self._recovery = Recovery(core, self._publisher, clock, on_recovery)
    self._merging = MergeLoop(
      core,
      self._cond,
      clock,
      min(1.0, config.heartbeat_interval_s),
      publisher=self._publisher,
      recovery=self._recovery,
      members=self._members,
      subscribers=self._subscribers,
    )
    self._watchdog = door.Watchdog(config.stream_idle_s, self._count_cut)
    self._streams = DataStreams(
      core,
      config,
      self._cond,
      refusals=self._refusals,
      members=self._members,
      publisher=self._publisher,
      recovery=self._recovery,
      adopter=adopter,
      watchdog=self._watchdog,
    )
    self._started = clock()
    self._bulk_port = 0  # Advertised at Register once a bulk port serves (`advertise_bulk`).
    self._door_counters: Callable[[], dict[str, int]] = dict  # The bulk door's (`count_door`).

  # -- lifecycle --------------------------------------------------------------------------------

  def start(self) -> None:
    """Starts the merge thread (idempotent)."""
    self._merging.start()
    self._watchdog.start()

  def stop(self, *, flush: bool = True) -> None:
    """Stops the merge thread; with `flush`, first merges every round that has its quorum."""
    with self._cond:
      self._subscribers.close_all()
    self._merging.stop()
    self._watchdog.stop()
    if flush:
      with self._cond:
        self._merging.flush()

  def advance(self, *, open_rounds: bool = True) -> None:
    """Does what is due now, as the merge thread does; for a service on a virtual clock whose
    merge thread is not started (service/virtual.py). Call it at `next_wakeup()`.
    `open_rounds=False` only merges (a simulated run's end: no rounds past the steps trained)."""
    with self._cond:
      self._merging.advance(open_rounds)

  def next_wakeup(self) -> float | None:
    """The earliest clock time at which `advance` has something to do: a round coming due, a
    merge, the end of a recovery window, a learner's liveness deadline; None if none."""
    with self._cond:
      return self._merging.next_wakeup()

  def begin_recovery(self, lost: Mapping[int, tuple[int, str]], window_s: float) -> None:
    """Waits up to `window_s` for learners to hand back versions a restart lost.

    `lost` is {fragment: (version, digest)}: the newest version the journal records, which the
    restored state lacks. Such a fragment opens no rounds meanwhile (`SyncerCore.freeze`); a learner
    that registers holding that version with that digest is asked for it (RegisterResponse.recover)
    and uploads it (Recover), and it becomes the fragment's version again: no merge is lost. A
    fragment nobody handed back by the deadline is republished from the restored values past the
    journal's version (versions never go back; the merges since the checkpoint are lost).
    """
    with self._cond:
      self._recovery.begin(lost, window_s)
      self._cond.notify_all()

  @property
  def shard(self) -> int:
    """This syncer's shard index (0 when unsharded)."""
    return self._shard

  def count_door(self, counters: Callable[[], dict[str, int]]) -> None:
    """Adds a door's counts (the bulk port's `BulkServer.door_counters`) to `Status.counters`."""
    self._door_counters = counters

  def advertise_bulk(self, port: int) -> None:
    """Tells learners at Register that pushes and pulls go to `port` (the bulk port, or a proxy's
    in front of it)."""
    with self._cond:
      self._bulk_port = port

  def refresh_published(self) -> None:
    """Records and serves the core's current versions (after its state was restored)."""
    with self._cond:
      self._publisher.refresh()

  # -- read-only views (launcher, tests) ----------------------------------------------------------

  @property
  def core(self) -> SyncerCore:
    return self._core

  @property
  def config(self) -> ServiceConfig:
    return self._cfg

  @property
  def lock(self) -> threading.Condition:
    return self._cond

  def refused(self) -> dict[str, int]:
    return self._refusals.counts()

  def published_digests(self) -> dict[tuple[int, int], str]:
    """{(fragment, version): digest} of every version published since start."""
    with self._cond:
      return self._publisher.digests()

  def recovery(self) -> dict[str, list[int]]:
    """Fragments still waiting to be handed back, handed back, and republished without."""
    with self._cond:
      return self._recovery.summary()

  def halted(self) -> str | None:
    """Why the service stopped merging (a version could not be made durable), or None."""
    with self._cond:
      return self._publisher.halted

  def served_versions(self) -> list[int]:
    """Each fragment's version as learners see it (durable; the core may hold one more)."""
    with self._cond:
      return self._publisher.versions()

  def merge_log(self) -> list[MergeEvent]:
    with self._cond:
      return self._publisher.merge_log()

  def push_latency(self) -> dict[str, dict[str, float]]:
    """Median and 90th percentile, in seconds, of the filed pushes' `read` (chunk 0 to the decoded
    report), `lock_wait` (for the service's lock) and `file` (the core's filing) times."""
    return self._streams.push_latency()

  def traffic(self) -> tuple[int, int]:
    """(bytes received, bytes sent) in chunk messages."""
    return self._streams.traffic()

  def open_streams(self) -> dict[str, int]:
    """Streams open now: {"data": Push and Pull, "rounds": Rounds subscriptions}."""
    data = self._streams.open_count()
    with self._cond:
      return {"data": data, "rounds": len(self._subscribers)}

  def members(self) -> frozenset[int]:
    """Ids in the member table (alive or gone but not yet forgotten)."""
    with self._cond:
      return self._members.ids()

  # -- refusals made outside the RPCs -------------------------------------------------------------

  def _count_cut(self, reason: str) -> None:
    """The watchdog cut a stream whose send was stuck ("idle") or that ran too long ("total")."""
    log.warning("a stream was cut by the watchdog (%s)", reason)
    self.count_refusal(grpc.StatusCode.CANCELLED, "")

  def refuse_garbled(self, request: door.Garbled) -> Refusal:
    """The refusal of a request that did not decode or is out of bounds (`door.parse_request`)."""
    return self._refusals.refuse(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

  @property
  def admission(self) -> Admission:
    """The admission of data streams (the bulk port admits its connections through it)."""
    return self._streams.admission

  def identify(self, session: str) -> int | None:
    """The learner whose current session `session` is (None: none), for admission only: every
    call's session is still checked against the learner it names (`Members.check`). Never waits
    for the service's lock: a busy syncer does not leave connections unnamed, and evictable."""
    return self._members.learner_of(session)

  def count_refusal(self, code: grpc.StatusCode, method: str) -> None:
    """For interceptors (e.g. the token check), which refuse before a servicer method runs."""
    del method
    self._refusals.count(code)

  # -- RPCs -------------------------------------------------------------------------------------

  def Register(self, request, context):
    return run_or_abort(context, self._register, request)

  def _register(self, request):
    refuse = self._refusals.refuse
    if request.layout_digest != self._layout_digest:
      raise refuse(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Layout digest {request.layout_digest!r} differs from the syncer's "
        f"{self._layout_digest!r}: model, fragment count or layout strategy differ.",
      )
    if request.num_fragments != self._core.num_fragments:
      raise refuse(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Learner has {request.num_fragments} fragments, the syncer {self._core.num_fragments}.",
      )
    if request.learner_id < 0:
      raise refuse(
        grpc.StatusCode.INVALID_ARGUMENT, f"learner_id must be >= 0, got {request.learner_id}."
      )
    learner_id = int(request.learner_id)
    with self._cond:
      self._members.ensure_room(learner_id)
      if len(request.held) > self._core.num_fragments:
        raise refuse(
          grpc.StatusCode.INVALID_ARGUMENT,
          f"{len(request.held)} held fragments; the layout has {self._core.num_fragments}.",
        )
      self._core.register(learner_id)
      versions = self._publisher.versions()
      recover = self._recovery.asked(request.held)
      session = self._members.admit(
        learner_id,
        host=request.host,
        num_devices=request.num_devices,
        batch_size=request.batch_size,
      )
      fleet_step = self._core.fleet_step()
    log.info("learner %d registered from %s", learner_id, door.clip(request.host or "?"))
    cfg = self._cfg
    return syncer_pb2.RegisterResponse(
      learner_id=request.learner_id,
      versions=[versions[p] for p in range(len(versions))],
      fleet_step=fleet_step,
      uplink_codec=cfg.uplink_codec,
      downlink_codec=cfg.downlink_codec,
      block_size=cfg.block_size,
      overlap=self._core.schedule.overlap,
      max_chunk_bytes=cfg.max_chunk_bytes,
      heartbeat_interval_s=cfg.heartbeat_interval_s,
      session=session,
      recover=recover,
      shard=self._shard,
      shard_addresses=self._shard_addresses,
      bulk_port=self._bulk_port,
      bulk_chunk_bytes=cfg.bulk_chunk_bytes,
    )

  def Push(self, request_iterator, context):
    """The data plane's push (`server.data_handlers`, not a gRPC method). A bulk port call's
    context carries where its chunks may be received and their bound (bulk_server._Call)."""
    return run_or_abort(
      context,
      lambda: self._streams.push(
        request_iterator,
        call_session(context),
        getattr(context, "placement", None),
        getattr(context, "max_chunk_bytes", None),
        ticket=getattr(context, "ticket", None),
        paced=getattr(context, "paced", False),
        interrupt=getattr(context, "interrupt", None),
      ),
    )

  def Recover(self, request_iterator, context):
    return run_or_abort(context, self._streams.recover, request_iterator, call_session(context))

  def Pull(self, request, context):
    """The data plane's pull (`server.data_handlers`, not a gRPC method)."""
    return self._streams.pull(request, context)

  def Heartbeat(self, request, context):
    return run_or_abort(context, self._heartbeat, request, call_session(context))

  def _heartbeat(self, request, session: str):
    with self._cond:
      member = self._members.get(int(request.learner_id))
      registered = member is not None and int(request.learner_id) in self._core.alive()
      if registered:
        # Only the registration's holder keeps a learner alive: not any token holder.
        self._members.check_session(int(request.learner_id), member, session)
        bad = counter_error(step=int(request.step)) or step_time_error(float(request.step_time_s))
        if bad is not None:
          raise self._refusals.refuse(
            grpc.StatusCode.INVALID_ARGUMENT, f"Heartbeat refused: {bad}."
          )
        member.last_seen = self._clock()
        member.step = int(request.step)
        # The learner's step on the fleet's schedule: the syncer's step clock runs at these rates.
        self._core.observe_steps(
          int(request.learner_id), int(request.step), step_time_s=float(request.step_time_s)
        )
      return syncer_pb2.HeartbeatResponse(
        registered=registered,
        versions=self._publisher.versions(),
        fleet_step=self._core.pacer.cadence_step(),
        # Under the same lock as the versions: the learner's ledger settles on the pair.
        merged_steps=self._core.merged_steps(int(request.learner_id)) if registered else [],
      )

  def Leave(self, request, context):
    return run_or_abort(context, self._leave, request, call_session(context))

  def _leave(self, request, session: str):
    with self._cond:
      member = self._members.get(int(request.learner_id))
      known = member is not None
      if known:
        self._members.check_session(int(request.learner_id), member, session)
        self._core.leave(int(request.learner_id))
        self._subscribers.unsubscribe(int(request.learner_id))
        self._members.left(int(request.learner_id))
        self._cond.notify_all()
    log.info("learner %d left", request.learner_id)
    return syncer_pb2.LeaveResponse(was_registered=known)

  def subscribe(self, learner_id: int, session: str, sink) -> list[syncer_pb2.SyncerEvent]:
    """Subscribes `sink` (`put(event)`, `close()`) to a learner's round requests and version
    announcements, replacing its previous subscription; returns what a new subscriber gets
    first: the rounds open now and every current version. What `Rounds` streams.

    Raises:
      Refusal: an unregistered or dead learner, a wrong session, no room for another stream.
    """
    with self._cond:
      self._members.check(learner_id, session)
      limit = self._cfg.max_rounds_streams
      if learner_id not in self._subscribers and len(self._subscribers) >= limit:
        raise self._refusals.refuse(
          grpc.StatusCode.RESOURCE_EXHAUSTED,
          f"{limit} Rounds streams are open, one per learner; no room for learner {learner_id}.",
        )
      self._subscribers.replace(learner_id, sink)
      initial = [round_event(r) for r in self._core.rounds.open_requests()]
      initial += [
        published_event(p, v)
        for p, v in enumerate(self._publisher.versions())
        if self._core.owns(p)  # A shard announces only its own fragments.
      ]
    return initial

  def Rounds(self, request, context):
    """Streams a learner's round requests and version announcements (see the proto)."""
    learner_id = int(request.learner_id)
    sub = Subscription()
    try:
      initial = self.subscribe(learner_id, call_session(context), sub)
    except Refusal as r:
      context.abort(r.code, r.message)
    try:
      # A client that stops reading blocks a send: the watchdog cuts it after stream_idle_s.
      yield from self._watchdog.watched(context, stream_events(initial, sub, context))
    finally:
      with self._cond:
        self._subscribers.discard(learner_id, sub)

  def Status(self, request, context):
    return run_or_abort(context, lambda _: self.status(), request)

  def status(self) -> syncer_pb2.StatusResponse:
    with self._cond:
      stats = self._core.stats()
      hist = stats.get("quorum_size_counts", {})
      counters = {k: int(v) for k, v in stats.items() if isinstance(v, int | np.integer)}
      counters |= self._door_counters()
      bytes_up, bytes_down = self._streams.traffic()
      return syncer_pb2.StatusResponse(
        versions=self._publisher.versions(),
        merges=self._publisher.merges,
        alive=sorted(self._core.alive()),
        counters=counters,
        refused=self._refusals.counts(),
        quorum_histogram=[int(hist.get(q, 0)) for q in range(max(hist, default=-1) + 1)],
        bytes_up=bytes_up,
        bytes_down=bytes_down,
        uptime_s=self._clock() - self._started,
        fleet_step=self._core.fleet_step(),
        shard=self._shard,
        num_shards=max(1, len(self._shard_addresses)),
      )
