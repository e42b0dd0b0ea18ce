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
    ABORTED             a late push: its round is closed, or its delta's anchor is no longer kept
                        (decided from the header, before decoding)
    ALREADY_EXISTS      a duplicate push: this learner already answered the round
    UNAUTHENTICATED     a missing or wrong shared token (transport/auth.py)
  A refused push leaves the global fragments, versions, optimizer states and rounds as they were.
  A retry of an answer already filed (same learner, round and counters) gets the first answer's
  reply, decided from the header: it is never filed twice.
- A merge is all or nothing (`SyncerCore._merge`), and the merge thread never retries a failing
  step with the lock held: RPCs and a signal's `stop()` always get through.
- Downlink (docs/algorithm.md §5): with a lossy downlink codec the syncer sends Θ_new − Θ_old quantized and adopts
  what a receiver decodes (`adopt`, wired into the core), so learners and syncer hold bit-identical
  fragments. The encoded delta is kept for the newest version only; a learner that holds an older
  version (or none) gets the full values in fp32, which is exact.
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
import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import gin
import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.fragments import compression
from ddiloco.protocol import counter_error, step_time_error
from ddiloco.syncer.core import (
  FragmentState,
  MergeEvent,
  ReportResult,
  RoundRequest,
  SyncerCore,
)
from ddiloco.transport import auth, messages, wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, ArrayPool
from ddiloco.transport.client import fragment_layouts
from ddiloco.transport.errors import WireError, WireSizeError
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "ddiloco.v1.Syncer"
# Room for a chunk's protobuf framing and header on top of its payload bytes.
_FRAMING_SLACK = 64 * 1024


@gin.configurable(module="ddiloco")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
  """Wire and liveness settings of the syncer service, sent to learners at Register.

  Attributes:
    uplink_codec: codec of the learners' outer-gradient pushes (docs/algorithm.md §5).
    downlink_codec: codec of fragment updates Θ_new − Θ_old (docs/algorithm.md §5); fp32 sends full values.
    block_size: values per absmax scale block for int8/int4.
    max_chunk_bytes: largest chunk payload accepted or sent (~1 MiB: gRPC's default message limit
      is 4 MiB, and 1 MiB chunks measured best on loopback).
    heartbeat_interval_s: how often learners call Heartbeat.
    liveness_timeout_s: silence after which a learner is declared dead.
    max_workers: server threads; each learner holds up to four concurrent calls (its Rounds
      stream, a push, a pull and a heartbeat).
  """

  uplink_codec: str = "bf16"
  downlink_codec: str = "bf16"
  block_size: int = 64
  max_chunk_bytes: int = DEFAULT_CHUNK_SIZE
  heartbeat_interval_s: float = 0.25
  liveness_timeout_s: float = 30.0
  max_workers: int = 32

  def __post_init__(self):
    for name in ("uplink_codec", "downlink_codec"):
      if getattr(self, name) not in compression.CODECS:
        raise ValueError(
          f"{name} must be one of {compression.CODECS}, got {getattr(self, name)!r}."
        )
    if not 1 <= self.block_size <= wire.MAX_BLOCK_SIZE:
      raise ValueError(f"block_size must be in [1, {wire.MAX_BLOCK_SIZE}], got {self.block_size}.")
    if self.max_chunk_bytes < 1024:
      raise ValueError(f"max_chunk_bytes must be >= 1024, got {self.max_chunk_bytes}.")
    if not 0 < self.heartbeat_interval_s < self.liveness_timeout_s:
      raise ValueError("Need 0 < heartbeat_interval_s < liveness_timeout_s.")
    if self.max_workers < 4:
      raise ValueError(f"max_workers must be >= 4, got {self.max_workers}.")

  def channel_options(self) -> list[tuple[str, int]]:
    """Explicit message size limits for both ends (gRPC's default receive limit is 4 MiB)."""
    limit = self.max_chunk_bytes + _FRAMING_SLACK
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


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
  """One learner's `Rounds` stream: the events waiting to be sent; None closes it."""

  def __init__(self):
    self.events: queue.SimpleQueue[syncer_pb2.SyncerEvent | None] = queue.SimpleQueue()

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


@dataclasses.dataclass
class _Member:
  """What the service knows of a learner beyond the core: liveness clock and its own description."""

  last_seen: float
  host: str = ""
  num_devices: int = 0
  batch_size: int = 0
  step: int = 0


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
  ):
    self._core = core
    self._cfg = config
    self._layout_digest = layout_digest
    self._adopter = adopter
    self._clock = clock
    self._on_merge = on_merge
    self._record = record
    # What learners may see of each fragment: the core's version once `record` made it durable.
    self._served = [core.version(p) for p in range(core.num_fragments)]
    self._halted: str | None = None
    self._cond = threading.Condition()
    self._members: dict[int, _Member] = {}
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
    self._merges = 0
    self._digests: dict[tuple[int, int], str] = {
      (p, 0): core.state(p).digest for p in range(core.num_fragments)
    }
    self._merge_log: list[MergeEvent] = []
    self._started = clock()
    self._stopping = False
    self._thread: threading.Thread | None = None

  # -- lifecycle --------------------------------------------------------------------------------

  def start(self) -> None:
    """Starts the merge thread (idempotent)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._merge_loop, name="syncer-merge", daemon=True)
      self._thread.start()

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
    if flush:
      with self._cond:
        self._flush()

  def _merge_loop(self) -> None:
    with self._cond:
      while not self._stopping:
        try:
          if self._halted is None:  # Halted: rounds stay as they are, nothing merges.
            for request in self._core.tick():
              self._broadcast(_round_event(request))
            for event in self._core.poll():
              self._publish(event)
          self._check_liveness()
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
      sub.events.put(event)

  def _unsubscribe(self, learner_id: int) -> None:
    """Ends a learner's Rounds stream (caller holds the lock)."""
    sub = self._subscribers.pop(learner_id, None)
    if sub is not None:
      sub.close()

  def _check_liveness(self) -> None:
    now = self._clock()
    alive = self._core.alive()
    for learner_id, member in self._members.items():
      if learner_id in alive and now - member.last_seen > self._cfg.liveness_timeout_s:
        log.warning(
          "learner %d silent for %.1f s: declared dead", learner_id, now - member.last_seen
        )
        self._core.leave(learner_id)
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

  def traffic(self) -> tuple[int, int]:
    """(bytes received, bytes sent) in chunk messages."""
    with self._cond:
      return self._bytes_up, self._bytes_down

  # -- helpers ----------------------------------------------------------------------------------

  def _refuse(self, code: grpc.StatusCode, message: str) -> Refusal:
    with self._cond:
      self._refused[code.name] += 1
    return Refusal(code, message)

  def count_refusal(self, code: grpc.StatusCode, method: str) -> None:
    """For interceptors (e.g. the token check), which refuse before a servicer method runs."""
    del method
    with self._cond:
      self._refused[code.name] += 1

  def _member(self, learner_id: int) -> _Member:
    """The learner's record if it is registered and alive (caller holds the lock)."""
    member = self._members.get(learner_id)
    if member is None:
      raise self._refuse(
        grpc.StatusCode.NOT_FOUND, f"Learner {learner_id} is not registered; call Register first."
      )
    if learner_id not in self._core.alive():
      raise self._refuse(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Learner {learner_id} is not alive at the syncer (left or timed out); register again.",
      )
    member.last_seen = self._clock()
    return member

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
    with self._cond:
      self._core.register(int(request.learner_id))
      versions = self._versions()
      self._members[int(request.learner_id)] = _Member(
        last_seen=self._clock(),
        host=request.host,
        num_devices=request.num_devices,
        batch_size=request.batch_size,
      )
      fleet_step = self._core.fleet_step()
    log.info("learner %d registered from %s", request.learner_id, request.host or "?")
    cfg = self._cfg
    return syncer_pb2.RegisterResponse(
      learner_id=request.learner_id,
      versions=[versions[p] for p in range(len(versions))],
      fleet_step=fleet_step,
      uplink_codec=cfg.uplink_codec,
      downlink_codec=cfg.downlink_codec,
      block_size=cfg.block_size,
      overlap=self._core.config.overlap,
      max_chunk_bytes=cfg.max_chunk_bytes,
      heartbeat_interval_s=cfg.heartbeat_interval_s,
    )

  def Push(self, request_iterator, context):
    return _serve(context, self._push, request_iterator)

  def _push(self, request_iterator):
    it = iter(request_iterator)
    first = next(it, None)
    if first is not None:
      first = self._push_frame(first)
    if first is None or first.index != 0 or first.header is None:
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT, "A push must start with chunk 0 carrying the header."
      )
    h = first.header
    with self._cond:
      self._member(int(h.learner_id))
    self._check_fragment(h.fragment)
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
      anchor = int(h.anchor_version)
      if (
        late is None
        and h.delta
        and 0 <= anchor <= self._core.version(p)
        and not self._core.kept(p, anchor)
      ):
        late = f"anchor version {anchor} of fragment {p} is no longer kept"
      if late is not None:
        # Decided from the header alone: an answer to a closed round is dropped unread, and a
        # delta against an anchor that is no longer kept cannot be decoded (also after a restore
        # republished p). Its tokens count as dropped.
        self._core.drop_late(
          max(int(h.tokens), 0),
          late,
          learner_id=int(h.learner_id),
          new_tokens=max(int(h.new_tokens), 0),
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
        anchor_lookup=lambda v: self._anchor_values(p, v),
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
    with self._cond:
      self._bytes_up += nbytes
      self._member(report.learner_id)  # It may have been declared dead while streaming.
      result = self._core.report(report, copy=False)  # Freshly decoded, ours alone.
      self._cond.notify_all()
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

  def _anchor_values(self, p: int, version: int) -> Mapping[str, np.ndarray]:
    with self._cond:
      return self._core.values_at(p, version)  # KeyError -> WireError in messages.

  def Pull(self, request, context):
    try:
      yield from self._pull(request)
    except Refusal as r:
      context.abort(r.code, r.message)

  def _pull(self, request) -> Iterator[bytes]:
    """The serialized FragmentChunk messages of p's newest version (sent without a serializer)."""
    self._check_fragment(request.fragment)
    p, known = int(request.fragment), int(request.known_version)
    with self._cond:
      self._member(int(request.learner_id))
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
      sent += len(c)
      yield c
    with self._cond:
      self._bytes_down += sent
      if int(request.learner_id) in self._core.alive():
        self._core.mark_delivered(int(request.learner_id), p, state.version)

  def Heartbeat(self, request, context):
    return _serve(context, self._heartbeat, request)

  def _heartbeat(self, request):
    with self._cond:
      member = self._members.get(int(request.learner_id))
      registered = member is not None and int(request.learner_id) in self._core.alive()
      bad = counter_error(step=int(request.step)) or step_time_error(float(request.step_time_s))
      if registered and bad is not None:
        raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Heartbeat refused: {bad}.")
      if registered:
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
    return _serve(context, self._leave, request)

  def _leave(self, request):
    with self._cond:
      known = int(request.learner_id) in self._members
      if known:
        self._core.leave(int(request.learner_id))
        self._unsubscribe(int(request.learner_id))
        self._cond.notify_all()
    log.info("learner %d left", request.learner_id)
    return syncer_pb2.LeaveResponse(was_registered=known)

  def Rounds(self, request, context):
    """Streams a learner's round requests and version announcements (see the proto)."""
    learner_id = int(request.learner_id)
    try:
      with self._cond:
        self._member(learner_id)
        self._unsubscribe(learner_id)  # A new subscription replaces the old one.
        sub = _Subscription()
        self._subscribers[learner_id] = sub
        initial = [_round_event(r) for r in self._core.open_rounds()]
        initial += [_published_event(p, v) for p, v in enumerate(self._versions())]
    except Refusal as r:
      context.abort(r.code, r.message)
    try:
      yield from initial
      while context.is_active():
        try:
          event = sub.events.get(timeout=0.5)
        except queue.Empty:
          continue
        if event is None:
          return
        yield event
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


def _serve(context, fn, request):
  try:
    return fn(request)
  except Refusal as r:
    context.abort(r.code, r.message)


class DownlinkAdopter:
  """The core's `adopt` hook for a lossy downlink codec, and the cache of the encoded deltas.

  At each merge it encodes Θ_new − Θ_old once, decodes it exactly as a learner holding Θ_old will,
  and returns that as the published value (docs/algorithm.md §5). The bytes are kept for the newest version.
  """

  def __init__(self, codec: str, *, block_size: int, chunk_size: int):
    if codec == "fp32":
      raise ValueError("fp32 needs no adoption: the syncer sends exact full values.")
    self._codec, self._block, self._chunk = codec, block_size, chunk_size
    self._staged: dict[int, list[bytes]] = {}
    self._cache: dict[int, tuple[int, list[bytes]]] = {}  # p -> (version, serialized chunks).

  def __call__(self, p: int, new: Mapping[str, np.ndarray], prev: Mapping[str, np.ndarray]):
    # The bytes are encoded once and kept: re-encoding adopted − prev need not give the same ints.
    pieces = list(
      wire.serialize_chunks(
        new, self._codec, block_size=self._block, base=prev, chunk_size=self._chunk
      )
    )
    layout = {k: (tuple(np.shape(v)), np.asarray(v).dtype) for k, v in new.items()}
    adopted = wire.read_layout(
      pieces, layout, codec_name=self._codec, max_bytes=sum(map(len, pieces)), base=prev
    )
    self._staged[p] = pieces
    return adopted

  def published(self, p: int, version: int, digest: str) -> None:
    """Called (under the service lock) when version `version` of p, just adopted, is published.

    `digest` is the core's digest of the adopted values (MergeEvent.digest).
    """
    chunks = messages.encoded_state_messages(
      self._staged.pop(p),
      fragment=p,
      version=version,
      digest=digest,
      codec=self._codec,
      base_version=version - 1,
    )
    self._cache[p] = (version, chunks)

  def delta_chunks(self, p: int, version: int) -> list[bytes] | None:
    """The encoded update from version − 1 to `version` of p, if that is the newest cached, as
    serialized FragmentChunk messages: serialized once, sent to every learner as they are."""
    cached = self._cache.get(p)
    return cached[1] if cached is not None and cached[0] == version else None


@dataclasses.dataclass
class SyncerServer:
  """A running gRPC server with its service: `stop()` shuts both down."""

  server: grpc.Server
  service: SyncerService
  port: int
  health: health.HealthServicer

  def stop(self, grace_s: float = 2.0, *, flush: bool = True) -> None:
    self.health.enter_graceful_shutdown()
    self.server.stop(grace_s).wait(grace_s + 5)
    self.service.stop(flush=flush)


def make_syncer(
  *,
  fragment_keys,
  init_values: Mapping[str, np.ndarray],
  syncer_config,
  service_config: ServiceConfig,
  layout_digest: str,
  embedding_keys=(),
  clock: Callable[[], float] = time.monotonic,
  on_merge: Callable[[MergeEvent], None] | None = None,
  record: Callable[[MergeEvent], None] | None = None,
) -> SyncerService:
  """A SyncerCore and its SyncerService wired together (adoption for a lossy downlink codec)."""
  adopter = None
  if service_config.downlink_codec != "fp32":
    adopter = DownlinkAdopter(
      service_config.downlink_codec,
      block_size=service_config.block_size,
      chunk_size=service_config.max_chunk_bytes,
    )
  core = SyncerCore(
    fragment_keys=fragment_keys,
    init_values=init_values,
    config=syncer_config,
    clock=clock,
    embedding_keys=embedding_keys,
    adopt=adopter,
  )
  return SyncerService(
    core,
    layout_digest=layout_digest,
    config=service_config,
    adopter=adopter,
    clock=clock,
    on_merge=on_merge,
    record=record,
  )


class _Handlers:
  """Stands in for a server to collect the handlers `add_SyncerServicer_to_server` registers."""

  def add_generic_rpc_handlers(self, handlers) -> None:
    del handlers

  def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
    self.service_name, self.handlers = service_name, dict(handlers)


def _add_servicer(service: SyncerService, server: grpc.Server) -> None:
  """`add_SyncerServicer_to_server`, except that Push takes, and Pull sends, each chunk's
  serialized bytes.

  The Push handler reads them with `messages.parse_chunk`, the payload a view into the received
  bytes: protobuf's parser would copy every payload byte twice (scripts/bench_wire.py).
  Pull sends chunks made serialized (`messages.state_messages`) or cached serialized (the
  downlink deltas every learner pulls), so protobuf neither builds nor serializes them per pull.
  The bytes on the wire are the same; clients need not change.
  """
  collected = _Handlers()
  syncer_pb2_grpc.add_SyncerServicer_to_server(service, collected)
  handlers = collected.handlers
  push, pull = handlers["Push"], handlers["Pull"]
  handlers["Push"] = grpc.stream_unary_rpc_method_handler(
    push.stream_unary, request_deserializer=None, response_serializer=push.response_serializer
  )
  handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
    pull.unary_stream, request_deserializer=pull.request_deserializer, response_serializer=None
  )
  name = collected.service_name
  server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(name, handlers)])
  server.add_registered_method_handlers(name, handlers)


def serve(
  service: SyncerService,
  *,
  address: str = "127.0.0.1:0",
  token: str | None = None,
  tls: tuple[str, str] | None = None,
) -> SyncerServer:
  """Starts a gRPC server for `service` (and the standard health service) and its merge thread.

  Args:
    service: the servicer.
    address: host:port; port 0 picks a free one. Loopback unless told otherwise.
    token: shared token required on every call but health checks (None: no authentication).
    tls: (cert_file, key_file) for TLS, or None for plain TCP.

  Returns:
    The running server, with the bound port.

  Raises:
    RuntimeError: if the address cannot be bound.
  """
  interceptors = [auth.TokenInterceptor(token, service.count_refusal)] if token else []
  cfg = service.config
  server = grpc.server(
    futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="syncer-rpc"),
    interceptors=interceptors,
    options=cfg.channel_options(),
  )
  _add_servicer(service, server)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  if tls is None:
    port = server.add_insecure_port(address)
  else:
    port = server.add_secure_port(address, auth.server_credentials(*tls))
  if port == 0:
    raise RuntimeError(f"Could not bind the syncer to {address}.")
  service.start()
  server.start()
  for name in ("", SERVICE_NAME):
    health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
  return SyncerServer(server=server, service=service, port=port, health=health_servicer)


def report_result(response: Any) -> ReportResult:
  """A PushResponse as the core's ReportResult (what the learner protocol consumes)."""
  return ReportResult(
    response.status, response.reason, response.weight, response.fleet_step, response.round_version
  )
