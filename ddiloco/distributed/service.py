"""The syncer as a gRPC service: the pure core behind a lock, a wall clock and a merge thread.

`SyncerService` implements `ddiloco.v1.Syncer` (transport/proto/syncer.proto). A background thread
runs the core's step clock: it opens rounds as they come due and announces each on every learner's
`Rounds` stream, and merges rounds as their deadlines come, announcing every published version on the
same streams (docs/algorithm.md §3-4). Learners answer rounds with pushes and pull what was announced; nothing a
learner does waits for a merge. Decisions (docs/algorithm.md, "Distributed runtime"):

- Validation at the door: every request is checked before it can touch the core, and every refusal has
  a precise status and is counted by status name (`Status.refused`):
    INVALID_ARGUMENT    malformed chunks or header, unknown fragment, wrong keys/shapes/dtypes, NaN/Inf,
                        counters out of their bounds (`protocol.counter_error`), an implausible
                        outer gradient, a codec other than the negotiated one (or fp32)
    RESOURCE_EXHAUSTED  a payload larger than the fragment can ever need, or a chunk above the limit
    NOT_FOUND           a learner that never registered
    FAILED_PRECONDITION a learner the syncer counts as dead (must register again), a layout digest or
                        fragment count that differs from the syncer's
    ABORTED             a late push: its round is closed
                        (decided from the header, before decoding)
    ALREADY_EXISTS      a duplicate push: this learner already answered the round
    UNAUTHENTICATED     a missing or wrong shared token (transport/auth.py)
    PERMISSION_DENIED   a missing or wrong learner session (below)
    INVALID_ARGUMENT    also: request bytes that do not decode, a text field over its bound (host
                        255 characters, layout digest 128, codec 16, any other 256; distributed/door.py)
    RESOURCE_EXHAUSTED  also: a Push or Pull beyond `max_data_streams` open (or
                        `max_data_streams_per_learner` for one learner), the oldest push still
                        without its first chunk when `max_unclaimed_streams` are (it is cut to
                        admit a new one), a Rounds stream beyond
                        `max_rounds_streams`, a new learner id beyond `max_members`
    DEADLINE_EXCEEDED   a push stream with no chunk for `stream_idle_s`, a push or pull stream open
                        past `stream_deadline_s`
    CANCELLED           a Pull or Rounds stream whose client stopped reading: a send stuck for
                        `stream_idle_s` is cut by the watchdog (the client sees CANCELLED)
  A refused push leaves the global fragments, versions, optimizer states and rounds as they were.
  A retry of an answer already filed (same learner, round and counters) gets the first answer's
  reply, decided from the header: it is never filed twice.
- A merge is all or nothing (`SyncerCore.poll`, `syncer/closing.py`), and the merge thread never
  retries a failing step with the lock held: RPCs and a signal's `stop()` always get through.
- Sessions: Register issues a random session credential bound to the learner id and that
  registration (RegisterResponse.session); every later Push, Pull, Heartbeat, Leave and Rounds call
  for the id must carry it as `ddiloco-session` metadata, or is refused PERMISSION_DENIED (distinct
  from the shared token's UNAUTHENTICATED: re-registering fixes it, so learners register again on
  it). The shared token still admits Register for any id, which voids the previous session: a
  restarted learner must be able to rejoin without its old credential.
- Capacity (distributed/door.py): the server is synchronous, every call holding a thread for its life.
  Its pool has `control_workers + max_data_streams + max_rounds_streams` threads; data streams and
  Rounds streams are admitted within their bounds, so at least `control_workers` threads always
  remain for Register, Heartbeat, Status, Leave and quick refusals. A push is read through a helper
  thread so that a stalled stream is cut at its idle deadline with DEADLINE_EXCEEDED; stuck sends
  are cut by a watchdog. Calls beyond the pool wait in gRPC's queue, bounded by `max_pending_calls`
  (beyond it gRPC itself refuses RESOURCE_EXHAUSTED, not counted here).
- Members: the service forgets a learner that left or was declared dead `member_retention_s` ago
  (and the longest-gone first once `max_members` are known); its next call finds it unregistered and
  it registers again. The core's per-learner records (token ledger) are kept.
- Serving (distributed/server.py): over gRPC on a port that is never shared, or in-process.
- Downlink (distributed/downlink.py): with a lossy downlink codec the syncer publishes what a
  learner decodes, so learners and syncer hold bit-identical fragments.
- Liveness: a learner that neither pushed, pulled nor sent a heartbeat for `liveness_timeout_s` is
  declared dead (`SyncerCore.leave`); its next call gets FAILED_PRECONDITION and it registers again.
- Durability: a merged version is served (announced, pulled, listed in Register, Heartbeat and
  Status) only once `record` (the merge journal) has made it durable and `on_merge` returned; the
  service keeps the served version of each fragment apart from the core's. If either raises an
  OSError (a full disk), the version is
  never served and the service halts: it merges and opens no more rounds and keeps serving the
  last durable versions; `halted()` says why, and the syncer process then stops (launch/runtime.py).
"""

import collections
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import grpc
import numpy as np

from ddiloco.distributed import door
from ddiloco.distributed.downlink import DownlinkAdopter
from ddiloco.distributed.members import Member, Members
from ddiloco.distributed.service_config import ServiceConfig
from ddiloco.metrics.writer import quantiles
from ddiloco.protocol import counter_error, step_time_error
from ddiloco.syncer.core import (
  FragmentState,
  MergeEvent,
  ReportResult,
  RoundRequest,
  SyncerCore,
)
from ddiloco.transport import auth, messages, wire
from ddiloco.transport.chunks import ArrayPool
from ddiloco.transport.client import fragment_layouts
from ddiloco.transport.errors import WireError, WireSizeError
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "ddiloco.v1.Syncer"


class Refusal(Exception):
  """A request refused at the door: a gRPC status code and a precise message."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


# Report statuses that are refusals on the wire (the push itself was well-formed).
_STATUS_CODES = {
  "late": grpc.StatusCode.ABORTED,
  "duplicate": grpc.StatusCode.ALREADY_EXISTS,
  "rejected": grpc.StatusCode.INVALID_ARGUMENT,
}


class _Subscription:
  """One learner's `Rounds` stream: the events waiting to be sent; None closes it.

  Any object with `put(event)` and `close()` can subscribe instead (`SyncerService.subscribe`):
  the simulated cluster's does, on its virtual clock (distributed/virtual.py).
  """

  def __init__(self):
    self.events: queue.SimpleQueue[syncer_pb2.SyncerEvent | None] = queue.SimpleQueue()

  def put(self, event: syncer_pb2.SyncerEvent) -> None:
    self.events.put(event)

  def close(self) -> None:
    self.events.put(None)


def _round_event(request: RoundRequest) -> syncer_pb2.SyncerEvent:
  return syncer_pb2.SyncerEvent(
    round=syncer_pb2.RoundOpen(
      fragment=request.fragment,
      round_step=request.round_step,
      base_version=request.base_version,
    )
  )


def _published_event(fragment: int, version: int) -> syncer_pb2.SyncerEvent:
  return syncer_pb2.SyncerEvent(published=syncer_pb2.Published(fragment=fragment, version=version))


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
  ):
    self._core = core
    self._cfg = config
    self._layout_digest = layout_digest
    self._adopter = adopter
    self._clock = clock
    self._on_merge = on_merge
    self._record = record
    self._on_recovery = on_recovery
    # What learners may see of each fragment: the core's version once `record` made it durable.
    self._served = [core.version(p) for p in range(core.num_fragments)]
    self._halted: str | None = None
    # Fragments a restart left behind the versions it had published ({p: (version, digest)}), to be
    # taken back from a learner holding them until `_recovery_deadline` (`begin_recovery`).
    self._recovering: dict[int, tuple[int, str]] = {}
    self._recovery_deadline = 0.0
    self._recovered: list[int] = []  # Fragments taken back from learners.
    self._republished: list[int] = []  # Fragments republished when no learner had them.
    self._cond = threading.Condition()
    self._members = Members(core, config, clock, self._refuse)
    self._subscribers: dict[int, _Subscription] = {}
    states = [core.state(p) for p in range(core.num_fragments)]
    self._layouts = fragment_layouts(
      [list(st.values) for st in states], {k: v for st in states for k, v in st.values.items()}
    )
    self._max_bytes = [wire.max_wire_bytes(lay) for lay in self._layouts]
    # Pushes are decoded into recycled memory: fresh pages cost the kernel's zeroing.
    # Free buffers all held reports a moment before, so the pool adds nothing to the peak; it is
    # capped at one copy of the model.
    self._pool = ArrayPool(
      sum(d.itemsize * math.prod(s) for lay in self._layouts for s, d in lay.values())
    )
    self._refused: collections.Counter[str] = collections.Counter()
    self._bytes_up = 0
    self._bytes_down = 0
    # Seconds per filed push: its chunks read and decoded (from chunk 0), waiting for the lock,
    # and filing in the core (`push_latency`).
    self._push_times: dict[str, collections.deque[float]] = {
      k: collections.deque(maxlen=4096) for k in ("read", "lock_wait", "file")
    }
    self._merges = 0
    self._digests: dict[tuple[int, int], str] = {
      (p, 0): core.state(p).digest for p in range(core.num_fragments)
    }
    self._merge_log: list[MergeEvent] = []
    self._gate = door.StreamGate(
      config.max_data_streams,
      config.max_data_streams_per_learner,
      config.max_unclaimed_streams,
    )
    self._watchdog = door.Watchdog(config.stream_idle_s, self._count_cut)
    self._started = clock()
    self._stopping = False
    self._thread: threading.Thread | None = None

  # -- lifecycle --------------------------------------------------------------------------------

  def start(self) -> None:
    """Starts the merge thread (idempotent)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._merge_loop, name="syncer-merge", daemon=True)
      self._thread.start()
    self._watchdog.start()

  def stop(self, *, flush: bool = True) -> None:
    """Stops the merge thread; with `flush`, first merges every round that has its quorum."""
    with self._cond:
      self._stopping = True
      for sub in self._subscribers.values():
        sub.close()
      self._subscribers.clear()
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=60)
      self._thread = None
    self._watchdog.stop()
    if flush:
      with self._cond:
        self._flush()

  def _merge_loop(self) -> None:
    with self._cond:
      while not self._stopping:
        try:
          self._advance()
        except Exception:  # A bug must not kill the thread silently (a failed merge is atomic).
          log.exception("merge loop error")
          # Never spin on a failing step with the lock held: RPCs and a signal's stop() need it.
          self._cond.wait(0.05)
        wait = min(1.0, self._cfg.heartbeat_interval_s)
        for deadline in (self._core.next_deadline(), self._core.next_tick_time()):
          if deadline is not None and self._halted is None:  # Halted: overdue rounds stay so.
            wait = min(wait, max(deadline - self._clock(), 0.0))
        if wait > 0:
          self._cond.wait(wait)

  def _advance(self, open_rounds: bool = True) -> None:
    """What is due at the clock now (caller holds the lock): recovery's end, the rounds that came
    due (announced) unless not `open_rounds`, the merges whose time has come (published), and
    liveness."""
    if self._recovering and self._clock() >= self._recovery_deadline:
      self._end_recovery()
    if self._halted is None:  # Halted: rounds stay as they are, nothing merges.
      for request in self._core.tick() if open_rounds else ():
        self._broadcast(_round_event(request))
      for event in self._core.poll():
        self._publish(event)
    self._check_liveness()

  def advance(self, *, open_rounds: bool = True) -> None:
    """Does what is due now, as the merge thread does; for a service on a virtual clock whose
    merge thread is not started (distributed/virtual.py). Call it at `next_wakeup()`.
    `open_rounds=False` only merges (a simulated run's end: no rounds past the steps trained)."""
    with self._cond:
      self._advance(open_rounds)

  def next_wakeup(self) -> float | None:
    """The earliest clock time at which `advance` has something to do: a round coming due, a
    merge, the end of a recovery window, a learner's liveness deadline; None if none."""
    with self._cond:
      times = []
      if self._halted is None:
        times += [self._core.next_deadline(), self._core.next_tick_time()]
      if self._recovering:
        times.append(self._recovery_deadline)
      times.append(self._members.next_deadline())
      times = [t for t in times if t is not None]
      return min(times) if times else None

  def _flush(self) -> None:
    """Merges every round that has its quorum, ignoring grace deadlines (shutdown)."""
    if self._halted is not None:
      return
    for event in self._core.flush():
      self._publish(event)

  def _publish(self, event: MergeEvent) -> None:
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
    self._broadcast(_published_event(event.fragment, event.version))

  def _broadcast(self, event: syncer_pb2.SyncerEvent) -> None:
    """Queues an event on every learner's Rounds stream (caller holds the lock)."""
    for sub in self._subscribers.values():
      sub.put(event)

  def _unsubscribe(self, learner_id: int) -> None:
    """Ends a learner's Rounds stream (caller holds the lock)."""
    sub = self._subscribers.pop(learner_id, None)
    if sub is not None:
      sub.close()

  def _check_liveness(self) -> None:
    """Declares silent learners dead and forgets those gone long ago (distributed/members.py)."""
    for learner_id in self._members.sweep():
      self._unsubscribe(learner_id)

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
    with self._cond:
      return dict(self._refused)

  def published_digests(self) -> dict[tuple[int, int], str]:
    """{(fragment, version): digest} of every version published since start."""
    with self._cond:
      return dict(self._digests)

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
      for p, (version, digest) in lost.items():
        self._core.freeze(p)
        self._recovering[int(p)] = (int(version), str(digest))
      self._recovery_deadline = self._clock() + max(window_s, 0.0)
      if self._recovering:
        log.warning(
          "syncer restored behind the journal for fragments %s: asking the learners for them "
          "for %.0f s",
          sorted(self._recovering),
          window_s,
        )
      self._cond.notify_all()

  def recovery(self) -> dict[str, list[int]]:
    """Fragments still waiting to be handed back, handed back, and republished without."""
    with self._cond:
      return {
        "waiting": sorted(self._recovering),
        "recovered": list(self._recovered),
        "republished": list(self._republished),
      }

  def _end_recovery(self) -> None:
    """Republishes every fragment no learner handed back (caller holds the lock)."""
    for p, (version, _) in sorted(self._recovering.items()):
      new = version + 1
      self._core.republish(p, new)
      state = self._core.state(p)
      event = MergeEvent(
        fragment=p,
        version=new,
        time=self._clock(),
        contributors=(),
        weights=(),
        tokens=0,
        open_time=self._clock(),
        quorum_time=self._clock(),
        grace_s=0.0,
        digest=state.digest,
      )
      try:
        if self._record is not None:
          self._record(event)
      except OSError as e:
        self._halted = f"a republished version could not be recorded ({e})"
        log.error("syncer halted: %s", self._halted)
        return
      log.warning(
        "no learner handed back version %d of fragment %d: republished as %d from the "
        "restored values",
        version,
        p,
        new,
      )
      del self._recovering[p]
      self._core.unfreeze(p)
      self._republished.append(p)
      self._serve_version(p, new, state.digest)
      if self._on_recovery is not None:
        self._on_recovery(p, new, "republished")

  def _serve_version(self, p: int, version: int, digest: str) -> None:
    """Makes a (durable) version of p visible: served, digest recorded, announced."""
    self._served[p] = version
    self._digests[(p, version)] = digest
    self._broadcast(_published_event(p, version))

  def refresh_published(self) -> None:
    """Records and serves the core's current versions (after its state was restored)."""
    with self._cond:
      for p in range(self._core.num_fragments):
        st = self._core.state(p)
        self._digests[(p, st.version)] = st.digest
        self._served[p] = st.version

  def halted(self) -> str | None:
    """Why the service stopped merging (a version could not be made durable), or None."""
    with self._cond:
      return self._halted

  def served_versions(self) -> list[int]:
    """Each fragment's version as learners see it (durable; the core may hold one more)."""
    with self._cond:
      return self._versions()

  def merge_log(self) -> list[MergeEvent]:
    with self._cond:
      return list(self._merge_log)

  def push_latency(self) -> dict[str, dict[str, float]]:
    """Median and 90th percentile, in seconds, of the filed pushes' `read` (chunk 0 to the decoded
    report), `lock_wait` (for the service's lock) and `file` (the core's filing) times."""
    with self._cond:
      samples = {k: list(v) for k, v in self._push_times.items()}
    return quantiles(samples)

  def traffic(self) -> tuple[int, int]:
    """(bytes received, bytes sent) in chunk messages."""
    with self._cond:
      return self._bytes_up, self._bytes_down

  # -- helpers ----------------------------------------------------------------------------------

  def _refuse(self, code: grpc.StatusCode, message: str) -> Refusal:
    with self._cond:
      self._refused[code.name] += 1
    return Refusal(code, message)

  def _count_cut(self, reason: str) -> None:
    """The watchdog cut a stream whose send was stuck ("idle") or that ran too long ("total")."""
    log.warning("a stream was cut by the watchdog (%s)", reason)
    self.count_refusal(grpc.StatusCode.CANCELLED, "")

  def refuse_garbled(self, request: door.Garbled) -> Refusal:
    """The refusal of a request that did not decode or is out of bounds (`door.parse_request`)."""
    return self._refuse(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

  def open_streams(self) -> dict[str, int]:
    """Streams open now: {"data": Push and Pull, "rounds": Rounds subscriptions}."""
    data, _ = self._gate.open_streams()
    with self._cond:
      return {"data": data, "rounds": len(self._subscribers)}

  def members(self) -> frozenset[int]:
    """Ids in the member table (alive or gone but not yet forgotten)."""
    with self._cond:
      return self._members.ids()

  def _admit(self, learner_id: int | None = None, on_evict=None) -> door.StreamTicket:
    """A place for a new data stream (of `learner_id` if known), or a refusal when none is left."""
    ticket = self._gate.enter(learner_id, on_evict)
    if ticket is None:
      if learner_id is not None and self._gate.open_streams()[0] < self._cfg.max_data_streams:
        self._claim_refused(learner_id)
      raise self._refuse(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"The syncer's push and pull streams are all taken (at most {self._cfg.max_data_streams}, "
        f"{self._cfg.max_unclaimed_streams} of them before their first chunk); retry later.",
      )
    return ticket

  def _claim(self, ticket: door.StreamTicket, learner_id: int) -> None:
    if not ticket.claim(learner_id):
      self._claim_refused(learner_id)

  def _claim_refused(self, learner_id: int):
    raise self._refuse(
      grpc.StatusCode.RESOURCE_EXHAUSTED,
      f"Learner {learner_id} has {self._cfg.max_data_streams_per_learner} push and pull "
      "streams open; retry later.",
    )

  def count_refusal(self, code: grpc.StatusCode, method: str) -> None:
    """For interceptors (e.g. the token check), which refuse before a servicer method runs."""
    del method
    with self._cond:
      self._refused[code.name] += 1

  def _member(self, learner_id: int, session: str) -> Member:
    """The learner's record if it is registered, alive and `session` is its own (caller holds the
    lock; `Members.check`)."""
    return self._members.check(learner_id, session)

  def _check_fragment(self, fragment: int) -> None:
    if not 0 <= fragment < self._core.num_fragments:
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Unknown fragment {fragment}; this syncer holds 0..{self._core.num_fragments - 1}.",
      )

  def _versions(self) -> list[int]:
    return list(self._served)

  def _served_state(self, p: int) -> FragmentState:
    """Fragment p at its served version (caller holds the lock)."""
    if self._served[p] == self._core.version(p):
      return self._core.state(p)
    return self._core.state_at(p, self._served[p])  # Kept: keep_versions >= 2.

  # -- RPCs -------------------------------------------------------------------------------------

  def Register(self, request, context):
    return _serve(context, self._register, request)

  def _register(self, request):
    if request.layout_digest != self._layout_digest:
      raise self._refuse(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Layout digest {request.layout_digest!r} differs from the syncer's "
        f"{self._layout_digest!r}: model, fragment count or layout strategy differ.",
      )
    if request.num_fragments != self._core.num_fragments:
      raise self._refuse(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Learner has {request.num_fragments} fragments, the syncer {self._core.num_fragments}.",
      )
    if request.learner_id < 0:
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT, f"learner_id must be >= 0, got {request.learner_id}."
      )
    learner_id = int(request.learner_id)
    with self._cond:
      self._members.ensure_room(learner_id)
      if len(request.held) > self._core.num_fragments:
        raise self._refuse(
          grpc.StatusCode.INVALID_ARGUMENT,
          f"{len(request.held)} held fragments; the layout has {self._core.num_fragments}.",
        )
      self._core.register(learner_id)
      versions = self._versions()
      # It holds a version a restart lost, with the journal's digest: ask for it back.
      recover = sorted(
        {
          int(h.fragment)
          for h in request.held
          if self._recovering.get(int(h.fragment)) == (int(h.version), h.digest)
        }
      )
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
    )

  def Push(self, request_iterator, context):
    return _serve(context, self._admitted_push, (request_iterator, _session(context), self._push))

  def Recover(self, request_iterator, context):
    return _serve(
      context, self._admitted_push, (request_iterator, _session(context), self._recover)
    )

  def _admitted_push(self, args):
    """A push within the stream bounds, read with the idle and total deadlines (distributed/door.py)."""
    request_iterator, session, body = args
    cfg = self._cfg
    stream = door.PacedStream(
      request_iterator, idle_s=cfg.stream_idle_s, total_s=cfg.stream_deadline_s
    )
    try:
      ticket = self._admit(on_evict=stream.interrupt)
    except Refusal:
      stream.close()
      raise
    try:
      return body(stream, session, ticket)
    except door.StreamTimeout as e:
      if str(e) == "evicted":
        raise self._refuse(
          grpc.StatusCode.RESOURCE_EXHAUSTED,
          f"No first push chunk yet while {cfg.max_unclaimed_streams} pushes waited for theirs: "
          "this one, the oldest, was cut to make room.",
        ) from None
      if str(e) == "idle":
        message = f"No push chunk for {cfg.stream_idle_s} s: the stream was cut."
      else:
        message = f"Push stream open for more than {cfg.stream_deadline_s} s: it was cut."
      raise self._refuse(grpc.StatusCode.DEADLINE_EXCEEDED, message) from None
    finally:
      stream.close()
      ticket.close()

  def _recover(self, it: Iterator, session: str, ticket: door.StreamTicket):
    """A learner hands back a version a restart lost (`begin_recovery`)."""
    first = self._stream_header(it, session, ticket, "recovery")
    h = first.header
    p, version = int(h.fragment), int(h.anchor_version)
    if h.codec != "fp32" or h.delta:
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT, "A recovery carries the full values in 'fp32' (exact)."
      )
    if h.total_bytes > self._max_bytes[p]:
      raise self._refuse(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"Recovery of {h.total_bytes} bytes: fragment {p} never needs more than "
        f"{self._max_bytes[p]}.",
      )
    with self._cond:
      wanted = self._recovering.get(p)
      served = self._served[p]
    if wanted is None or wanted[0] != version:
      return syncer_pb2.RecoverResponse(
        adopted=False, reason=f"version {version} of fragment {p} is not wanted", version=served
      )
    layout = self._layouts[p]
    try:
      report = messages.chunks_to_report(
        itertools.chain([first], it),
        list(layout),
        {k: s for k, (s, _) in layout.items()},
        {k: d for k, (_, d) in layout.items()},
        max_bytes=self._max_bytes[p],
        max_chunk_bytes=self._cfg.max_chunk_bytes,
      )
    except WireError as e:
      raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Recovery of {p} refused: {e}") from e
    with self._cond:
      wanted = self._recovering.get(p)
      if wanted is None or wanted[0] != version:  # Another learner's copy came first.
        return syncer_pb2.RecoverResponse(
          adopted=False, reason="taken back already", version=self._served[p]
        )
      try:
        self._core.recover(p, version, report.values, wanted[1])
      except ValueError as e:
        raise self._refuse(
          grpc.StatusCode.INVALID_ARGUMENT, f"Recovery of fragment {p} refused: {e}"
        ) from e
      del self._recovering[p]
      self._core.unfreeze(p)
      self._recovered.append(p)
      self._serve_version(p, version, wanted[1])  # Journaled before the restart.
      if self._on_recovery is not None:
        self._on_recovery(p, version, "recovered")
      self._cond.notify_all()
    log.info("fragment %d: version %d handed back by learner %d", p, version, h.learner_id)
    return syncer_pb2.RecoverResponse(adopted=True, version=version)

  def _stream_header(
    self, it: Iterator, session: str, ticket: door.StreamTicket, what: str
  ) -> messages.ChunkFrame:
    """Chunk 0 of a push or recovery stream, its header checked: text bounds, a registered and
    alive learner with its session (the stream's ticket is then claimed by it), the fragment."""
    first = next(it, None)
    if first is not None:
      first = self._push_frame(first)
    if first is None or first.index != 0 or first.header is None:
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"A {what} must start with chunk 0 carrying the header.",
      )
    h = first.header
    fault = door.text_fault(h)
    if fault is not None:
      raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{what.capitalize()} header: {fault}")
    with self._cond:
      self._member(int(h.learner_id), session)
    self._claim(ticket, int(h.learner_id))
    self._check_fragment(h.fragment)
    return first

  def _push(self, it: Iterator, session: str, ticket: door.StreamTicket):
    first = self._stream_header(it, session, ticket, "push")
    t_first = time.monotonic()
    h = first.header
    p = int(h.fragment)
    if h.codec not in (self._cfg.uplink_codec, "fp32"):
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Codec {h.codec!r}: this syncer takes {self._cfg.uplink_codec!r} (or exact 'fp32').",
      )
    if (
      h.total_bytes > self._max_bytes[p] or h.num_chunks * self._cfg.max_chunk_bytes < h.total_bytes
    ):
      raise self._refuse(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"Push of {h.total_bytes} bytes in {h.num_chunks} chunks: fragment {p} never needs more "
        f"than {self._max_bytes[p]} bytes, chunks at most {self._cfg.max_chunk_bytes}.",
      )
    bad = counter_error(
      tokens=int(h.tokens), steps=int(h.steps), step=int(h.step), new_tokens=int(h.new_tokens)
    ) or step_time_error(float(h.step_time_s))
    if bad is not None:
      raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Push refused: {bad}.")
    with self._cond:
      # A retry of an answer already filed gets the first answer's result, unread (idempotent).
      fingerprint = (
        int(h.step),
        int(h.tokens),
        int(h.steps),
        int(h.new_tokens),
        int(h.anchor_version),
      )
      replay = self._core.replayed(int(h.learner_id), p, int(h.round_step), fingerprint)
    if replay is not None:
      return self._push_response(replay)
    with self._cond:
      late = self._core.late_reason(p, int(h.round_step))
      if late is not None:
        # Decided from the header alone: an answer to a closed round is dropped unread. Its
        # tokens count as dropped.
        self._core.drop_late(
          max(int(h.tokens), 0),
          late,
          learner_id=int(h.learner_id),
          new_tokens=max(int(h.new_tokens), 0),
          fragment=p,
          round_step=int(h.round_step),
        )
        raise self._refuse(grpc.StatusCode.ABORTED, f"late: {late}")
    nbytes = 0

    def counted(chunks):
      nonlocal nbytes
      for c in chunks:
        frame = messages.as_frame(c, syncer_pb2.PushHeader)  # Raw bytes: see _add_servicer.
        nbytes += frame.nbytes
        yield frame

    layout = self._layouts[p]
    try:
      report = messages.chunks_to_report(
        counted(itertools.chain([first], it)),
        list(layout),
        {k: s for k, (s, _) in layout.items()},
        {k: d for k, (_, d) in layout.items()},
        max_bytes=self._max_bytes[p],
        max_chunk_bytes=self._cfg.max_chunk_bytes,
        alloc=self._pool.empty,
        # NaN/Inf: the core's filing checks every value in the same pass as RDA's norm and
        # refuses the report untouched ("rejected", INVALID_ARGUMENT); one pass, not two.
        check_finite=False,
      )
    except WireError as e:
      code = grpc.StatusCode.INVALID_ARGUMENT
      if isinstance(e, WireSizeError):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
      raise self._refuse(code, f"Push of fragment {p} refused: {e}") from e
    t_read = time.monotonic()
    with self._cond:
      t_locked = time.monotonic()
      self._bytes_up += nbytes
      # It may have been declared dead, or registered again, while streaming.
      self._member(report.learner_id, session)
      result = self._core.report(report, copy=False)  # Freshly decoded, ours alone.
      self._cond.notify_all()
      times = self._push_times
      times["read"].append(t_read - t_first)
      times["lock_wait"].append(t_locked - t_read)
      times["file"].append(time.monotonic() - t_locked)
    return self._push_response(result)

  def _push_response(self, result: ReportResult) -> syncer_pb2.PushResponse:
    if result.status in _STATUS_CODES:
      raise self._refuse(_STATUS_CODES[result.status], f"{result.status}: {result.reason}")
    return syncer_pb2.PushResponse(
      status=result.status,
      reason=result.reason,
      weight=result.weight,
      fleet_step=result.fleet_step,
      round_version=result.round_version,
    )

  def _push_frame(self, chunk) -> messages.ChunkFrame:
    """A Push chunk (its raw bytes, see `_add_servicer`, or a PushChunk) as a frame."""
    try:
      return messages.as_frame(chunk, syncer_pb2.PushHeader)
    except WireError as e:
      raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Push refused: {e}") from e

  def Pull(self, request, context):
    ticket = None
    try:
      ticket = self._admit(int(request.learner_id))  # Named at once: never "unclaimed".
      context.add_callback(ticket.close)  # Also freed if gRPC drops the generator unfinished.
      chunks = self._pull(request, _session(context))
      # A client that stops reading blocks a send: the watchdog cuts it after stream_idle_s.
      yield from self._watchdog.watched(context, chunks)
    except Refusal as r:
      context.abort(r.code, r.message)
    finally:
      if ticket is not None:
        ticket.close()

  def _pull(self, request, session: str) -> Iterator[bytes]:
    """The serialized FragmentChunk messages of p's newest version (sent without a serializer)."""
    deadline = time.monotonic() + self._cfg.stream_deadline_s
    self._check_fragment(request.fragment)
    p, known = int(request.fragment), int(request.known_version)
    with self._cond:
      self._member(int(request.learner_id), session)
      state = self._served_state(p)
      cached = self._adopter.delta_chunks(p, state.version) if self._adopter else None
    if known > state.version:
      raise self._refuse(
        grpc.StatusCode.OUT_OF_RANGE,
        f"Learner holds version {known} of fragment {p}, newer than the syncer's {state.version}.",
      )
    if known == state.version:
      return
    if cached is not None and known == state.version - 1:
      chunks = cached
    else:
      chunks = messages.state_messages(state, "fp32", chunk_size=self._cfg.max_chunk_bytes)
    sent = 0
    for c in chunks:
      if time.monotonic() > deadline:
        raise self._refuse(
          grpc.StatusCode.DEADLINE_EXCEEDED,
          f"Pull stream open for more than {self._cfg.stream_deadline_s} s: it was cut.",
        )
      sent += len(c)
      yield c
    with self._cond:
      self._bytes_down += sent
      if int(request.learner_id) in self._core.alive():
        self._core.mark_delivered(int(request.learner_id), p, state.version)

  def Heartbeat(self, request, context):
    return _serve(context, self._heartbeat, (request, _session(context)))

  def _heartbeat(self, args):
    request, session = args
    with self._cond:
      member = self._members.get(int(request.learner_id))
      registered = member is not None and int(request.learner_id) in self._core.alive()
      if registered:
        # Only the registration's holder keeps a learner alive: not any token holder.
        self._members.check_session(int(request.learner_id), member, session)
        bad = counter_error(step=int(request.step)) or step_time_error(float(request.step_time_s))
        if bad is not None:
          raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Heartbeat refused: {bad}.")
        member.last_seen = self._clock()
        member.step = int(request.step)
        # The learner's step on the fleet's schedule: the syncer's step clock runs at these rates.
        self._core.observe_steps(
          int(request.learner_id), int(request.step), step_time_s=float(request.step_time_s)
        )
      return syncer_pb2.HeartbeatResponse(
        registered=registered,
        versions=self._versions(),
        fleet_step=self._core.cadence_step(),
        # Under the same lock as the versions: the learner's ledger settles on the pair.
        merged_steps=self._core.merged_steps(int(request.learner_id)) if registered else [],
      )

  def Leave(self, request, context):
    return _serve(context, self._leave, (request, _session(context)))

  def _leave(self, args):
    request, session = args
    with self._cond:
      member = self._members.get(int(request.learner_id))
      known = member is not None
      if known:
        self._members.check_session(int(request.learner_id), member, session)
        self._core.leave(int(request.learner_id))
        self._unsubscribe(int(request.learner_id))
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
      self._member(learner_id, session)
      limit = self._cfg.max_rounds_streams
      if learner_id not in self._subscribers and len(self._subscribers) >= limit:
        raise self._refuse(
          grpc.StatusCode.RESOURCE_EXHAUSTED,
          f"{limit} Rounds streams are open, one per learner; no room for learner {learner_id}.",
        )
      self._unsubscribe(learner_id)  # A new subscription replaces the old one.
      self._subscribers[learner_id] = sink
      initial = [_round_event(r) for r in self._core.open_rounds()]
      initial += [_published_event(p, v) for p, v in enumerate(self._versions())]
    return initial

  def Rounds(self, request, context):
    """Streams a learner's round requests and version announcements (see the proto)."""
    learner_id = int(request.learner_id)
    sub = _Subscription()
    try:
      initial = self.subscribe(learner_id, _session(context), sub)
    except Refusal as r:
      context.abort(r.code, r.message)
    try:
      # A client that stops reading blocks a send: the watchdog cuts it after stream_idle_s.
      yield from self._watchdog.watched(context, _events(initial, sub, context))
    finally:
      with self._cond:
        if self._subscribers.get(learner_id) is sub:
          del self._subscribers[learner_id]

  def Status(self, request, context):
    return _serve(context, lambda _: self.status(), request)

  def status(self) -> syncer_pb2.StatusResponse:
    with self._cond:
      stats = self._core.stats()
      hist = stats.get("quorum_size_counts", {})
      counters = {k: int(v) for k, v in stats.items() if isinstance(v, int | np.integer)}
      return syncer_pb2.StatusResponse(
        versions=self._versions(),
        merges=self._merges,
        alive=sorted(self._core.alive()),
        counters=counters,
        refused=dict(self._refused),
        quorum_histogram=[int(hist.get(q, 0)) for q in range(max(hist, default=-1) + 1)],
        bytes_up=self._bytes_up,
        bytes_down=self._bytes_down,
        uptime_s=self._clock() - self._started,
        fleet_step=self._core.fleet_step(),
      )


def _events(initial, sub: _Subscription, context) -> Iterator[syncer_pb2.SyncerEvent]:
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


def _serve(context, fn, request):
  try:
    return fn(request)
  except Refusal as r:
    context.abort(r.code, r.message)


def _session(context) -> str:
  """The learner session a call carries (`auth.SESSION_METADATA_KEY`), or ""."""
  for key, value in context.invocation_metadata() or ():
    if key == auth.SESSION_METADATA_KEY and isinstance(value, str):
      return value
  return ""
