"""The service's data streams: Push and Recover read, Pull sent, within the door's bounds.

Pushes and pulls come over the bulk port (service/bulk_server.py) or the in-process carrier,
a Recover over gRPC: the same handlers and rules whatever carries them.

Every stream is admitted by the `StreamGate` (service/stream_gate.py): a bulk port connection is
admitted by the port at its accept and hands its ticket to the handler, any other stream by its
handler. A push is read through a `PacedStream` and a pull watched by the `Watchdog`
(service/door.py) so that a stalled one is cut; the bulk port times every read and send itself
(its phase deadlines, `bulk_pace.PacedSocket`), so its calls have neither's deadlines. A push's
header is checked before its body is read: a late answer is dropped unread (ABORTED), and a
retry of an answer already filed (same learner, round and counters) gets the first answer's
reply: it is never filed twice. A refused push leaves the global fragments, versions, optimizer
states and rounds as they were.
"""

import collections
import functools
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from ddiloco.fragments import shards
from ddiloco.metrics.writer import quantiles
from ddiloco.protocol import counter_error, step_time_error
from ddiloco.service import door, stream_gate
from ddiloco.service.downlink import DownlinkAdopter
from ddiloco.service.members import Members
from ddiloco.service.publication import Publisher
from ddiloco.service.recovery import Recovery
from ddiloco.service.refusals import REPORT_STATUS_CODES, Refusal, Refusals, call_session
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import ReportResult, SyncerCore
from ddiloco.transport import bulk_wire, frames, messages, state_messages, wire
from ddiloco.transport.chunks import ArrayPool
from ddiloco.transport.client import fragment_layouts
from ddiloco.transport.errors import WireError, WireSizeError
from ddiloco.transport.events import push_response
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2

log = logging.getLogger(__name__)


class DataStreams:
  """The Push, Recover and Pull handlers of the service (see module docstring).

  Args:
    core: the syncer core (filing reports, late rounds, deliveries).
    config: stream bounds, deadlines and codecs.
    lock: the service's lock, held around every touch of the core and of the collaborators.
    refusals: makes the counted refusals.
    members: checks each stream's learner and session.
    publisher: the served version a pull sends.
    recovery: the versions a Recover may hand back.
    adopter: a lossy downlink codec's cached deltas (None if exact).
    watchdog: cuts a pull whose client stopped reading.
  """

  def __init__(
    self,
    core: SyncerCore,
    config: ServiceConfig,
    lock: threading.Condition,
    *,
    refusals: Refusals,
    members: Members,
    publisher: Publisher,
    recovery: Recovery,
    adopter: DownlinkAdopter | None,
    watchdog: door.Watchdog,
  ):
    self._core = core
    self._cfg = config
    self._cond = lock
    self._refuse = refusals.refuse
    self._members = members
    self._publisher = publisher
    self._recovery = recovery
    self._adopter = adopter
    self._watchdog = watchdog
    states = [core.state(p) for p in range(core.num_fragments)]
    self._layouts = fragment_layouts(
      [list(st.values) for st in states], {k: v for st in states for k, v in st.values.items()}
    )
    self._max_bytes = [wire.max_wire_bytes(lay) for lay in self._layouts]
    # Pushes are decoded into recycled memory: fresh pages cost the kernel's zeroing (with a
    # round's M answers freed at its merge, a pool of one model's copy left M − 1 of the next
    # round's to fresh memory when M > P: half a bf16 push's CPU, scripts/bench_ingest.py).
    # Free buffers all held reports a moment before; kept within the most the reports ever held
    # at once, the pool adds nothing to the process's peak.
    self.pool = ArrayPool(sys.maxsize, within_peak=True)
    self._bytes_up = 0
    self._bytes_down = 0
    # Seconds per filed push: its chunks read and decoded (from chunk 0), waiting for the lock,
    # and filing in the core (`push_latency`).
    self._push_times: dict[str, collections.deque[float]] = {
      k: collections.deque(maxlen=4096) for k in ("read", "lock_wait", "file")
    }
    gate = stream_gate.StreamGate(
      config.max_data_streams,
      config.max_data_streams_per_learner,
      config.max_unclaimed_streams,
    )
    self.admission = stream_gate.Admission(gate, refusals.refuse)

  # -- counters ---------------------------------------------------------------------------------

  def traffic(self) -> tuple[int, int]:
    """(bytes received, bytes sent) in chunk messages."""
    with self._cond:
      return self._bytes_up, self._bytes_down

  def push_latency(self) -> dict[str, dict[str, float]]:
    """Median and 90th percentile, in seconds, of the filed pushes' `read` (chunk 0 to the decoded
    report), `lock_wait` (for the service's lock) and `file` (the core's filing) times."""
    with self._cond:
      samples = {k: list(v) for k, v in self._push_times.items()}
    return quantiles(samples)

  def open_count(self) -> int:
    """Push and Pull streams open now."""
    data, _ = self.admission.gate.open_streams()
    return data

  # -- Push and Recover -------------------------------------------------------------------------

  def push(
    self,
    request_iterator,
    session: str,
    placement: Placement | None = None,
    chunk_bytes: int | None = None,
    *,
    ticket: stream_gate.StreamTicket | None = None,
    paced: bool = False,
    interrupt: Callable[[], None] | None = None,
  ) -> syncer_pb2.PushResponse:
    """A learner's answer to a round, filed in the core; `placement`: where the bulk port
    receives its chunks in place (transport/placement.py); `chunk_bytes`: the stream's chunk bound
    (the bulk port's; default `max_chunk_bytes`); `ticket`: the stream's place if its carrier
    admitted it (the bulk port); `paced`: the carrier times each read itself (read in this
    thread); `interrupt`: cuts its read under way, when the stream loses its place."""
    chunk_bytes = chunk_bytes or self._cfg.max_chunk_bytes
    body = functools.partial(self._push, placement=placement, chunk_bytes=chunk_bytes)
    return self._admitted_push(
      request_iterator, session, body, ticket=ticket, paced=paced, interrupt=interrupt
    )

  def recover(self, request_iterator, session: str) -> syncer_pb2.RecoverResponse:
    """A learner hands back a version a restart lost (service/recovery.py)."""
    return self._admitted_push(request_iterator, session, self._recover)

  def _admitted_push(
    self,
    request_iterator,
    session: str,
    body: Callable,
    *,
    ticket: stream_gate.StreamTicket | None = None,
    paced: bool = False,
    interrupt: Callable[[], None] | None = None,
  ):
    """A push within the stream bounds, read with the idle and total deadlines (service/door.py)."""
    cfg = self._cfg
    # A paced carrier's deadlines are its own (see module docstring).
    idle_s, total_s = (None, None) if paced else (cfg.stream_idle_s, cfg.stream_deadline_s)
    stream = door.PacedStream(
      request_iterator, idle_s=idle_s, total_s=total_s, on_interrupt=interrupt
    )
    try:
      if ticket is None:
        ticket = self.admission.admit(on_evict=stream.interrupt)
      elif not ticket.watch(stream.interrupt):
        stream.interrupt()  # Evicted before its handler ran: refused below, as any eviction.
    except Refusal:
      stream.close()
      raise
    try:
      return body(stream, session, ticket)
    except door.StreamTimeout as e:
      if str(e) == "evicted":
        raise self.admission.evicted(ticket) from None
      if str(e) == "idle":
        message = f"No push chunk for {cfg.stream_idle_s} s: the stream was cut."
      else:
        message = f"Push stream open for more than {cfg.stream_deadline_s} s: it was cut."
      raise self._refuse(grpc.StatusCode.DEADLINE_EXCEEDED, message) from None
    finally:
      stream.close()
      ticket.close()

  def _recover(self, it: Iterator, session: str, ticket: stream_gate.StreamTicket):
    """A learner hands back a version a restart lost (`SyncerService.begin_recovery`)."""
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
      wanted = self._recovery.wanted(p)
      served = self._publisher.version(p)
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
      wanted = self._recovery.wanted(p)
      if wanted is None or wanted[0] != version:  # Another learner's copy came first.
        return syncer_pb2.RecoverResponse(
          adopted=False, reason="taken back already", version=self._publisher.version(p)
        )
      try:
        self._recovery.take_back(p, version, report.values)
      except ValueError as e:
        raise self._refuse(
          grpc.StatusCode.INVALID_ARGUMENT, f"Recovery of fragment {p} refused: {e}"
        ) from e
      self._cond.notify_all()
    log.info("fragment %d: version %d handed back by learner %d", p, version, h.learner_id)
    return syncer_pb2.RecoverResponse(adopted=True, version=version)

  def _stream_header(
    self, it: Iterator, session: str, ticket: stream_gate.StreamTicket, what: str
  ) -> frames.ChunkFrame:
    """Chunk 0 of a push or recovery stream, its header checked: text bounds, a registered and
    alive learner with its session (the stream's ticket is then claimed by it), the fragment."""
    first = next(it, None)
    if first is not None:
      if not ticket.arrived():  # Evicted between the read and now: cut as PacedStream cuts it.
        raise door.StreamTimeout("evicted")
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
      self._members.check(int(h.learner_id), session)
    if ticket.learner is None:  # Else claimed by its carrier, for the learner of its session.
      self.admission.claim(ticket, int(h.learner_id))
    self._check_fragment(h.fragment)
    return first

  def _push(
    self,
    it: Iterator,
    session: str,
    ticket: stream_gate.StreamTicket,
    placement: Placement | None,
    chunk_bytes: int,
  ):
    first = self._stream_header(it, session, ticket, "push")
    t_first = time.monotonic()
    h = first.header
    p = int(h.fragment)
    self._check_push_header(h, chunk_bytes)
    with self._cond:
      # A retry of an answer already filed gets the first answer's result, unread (idempotent).
      fingerprint = (
        int(h.step),
        int(h.tokens),
        int(h.steps),
        int(h.new_tokens),
        int(h.anchor_version),
      )
      replay = self._core.intake.replayed(int(h.learner_id), p, int(h.round_step), fingerprint)
    if replay is not None:
      return self._push_response(replay)
    with self._cond:
      late = self._core.rounds.late_reason(p, int(h.round_step))
      if late is not None:
        # Decided from the header alone: an answer to a closed round is dropped unread. Its
        # tokens count as dropped.
        self._core.intake.drop_late(
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
        frame = frames.as_frame(c, syncer_pb2.PushHeader)  # Raw bytes: see server._add_servicer.
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
        max_chunk_bytes=chunk_bytes,
        alloc=self.pool.empty,
        # NaN/Inf: the core's filing checks every value in the same pass as RDA's norm and
        # refuses the report untouched ("rejected", INVALID_ARGUMENT); one pass, not two.
        check_finite=False,
        placement=placement,
        # bf16 δ stays bfloat16 up to the merge, which widens it as it reads it (exact): the
        # door writes no float32 and the merge reads half the bytes.
        as_sent=True,
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
      self._members.check(report.learner_id, session)
      result = self._core.report(report, copy=False)  # Freshly decoded, ours alone.
      self._cond.notify_all()
      times = self._push_times
      times["read"].append(t_read - t_first)
      times["lock_wait"].append(t_locked - t_read)
      times["file"].append(time.monotonic() - t_locked)
    return self._push_response(result)

  def _check_push_header(self, h: syncer_pb2.PushHeader, chunk_bytes: int) -> None:
    """Refuses a push whose header has another codec, too many bytes, or counters out of bounds."""
    p = int(h.fragment)
    if h.codec not in (self._cfg.uplink_codec, "fp32"):
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Codec {h.codec!r}: this syncer takes {self._cfg.uplink_codec!r} (or exact 'fp32').",
      )
    if h.total_bytes > self._max_bytes[p] or h.num_chunks * chunk_bytes < h.total_bytes:
      raise self._refuse(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"Push of {h.total_bytes} bytes in {h.num_chunks} chunks: fragment {p} never needs more "
        f"than {self._max_bytes[p]} bytes, chunks at most {chunk_bytes}.",
      )
    bad = counter_error(
      tokens=int(h.tokens), steps=int(h.steps), step=int(h.step), new_tokens=int(h.new_tokens)
    ) or step_time_error(float(h.step_time_s))
    if bad is not None:
      raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Push refused: {bad}.")

  def _push_response(self, result: ReportResult) -> syncer_pb2.PushResponse:
    if result.status in REPORT_STATUS_CODES:
      raise self._refuse(REPORT_STATUS_CODES[result.status], f"{result.status}: {result.reason}")
    return push_response(result)

  def _push_frame(self, chunk) -> frames.ChunkFrame:
    """A Push chunk (its raw bytes, see `server._add_servicer`, or a PushChunk) as a frame."""
    try:
      return frames.as_frame(chunk, syncer_pb2.PushHeader)
    except WireError as e:
      raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"Push refused: {e}") from e

  # -- Pull -------------------------------------------------------------------------------------

  def pull(self, request, context) -> Iterator[bytes | memoryview]:
    """A pull: p's newest served version as framed pieces (`bulk_wire.frame_head`), watched, or
    the call aborted with a refusal."""
    ticket = getattr(context, "ticket", None)  # Admitted by its carrier (the bulk port).
    evicted = threading.Event()
    try:
      if ticket is None:
        # Named at once: claimed at entry.
        ticket = self.admission.admit(int(request.learner_id), on_evict=evicted.set)
      else:
        if not ticket.watch(evicted.set):
          evicted.set()
        if ticket.learner is None:  # Its session named no learner: refused, or claimed for it.
          with self._cond:
            self._members.check(int(request.learner_id), call_session(context))
          self.admission.claim(ticket, int(request.learner_id))
      context.add_callback(ticket.close)  # Also freed if the call drops the generator unfinished.
      # A bulk port call's context frames the stream itself (it tracks where a frame ends,
      # bulk_server._Call.frame_head) and bounds its chunks; the in-process carrier's does not.
      chunks = self._pull(
        request,
        call_session(context),
        getattr(context, "frame_head", bulk_wire.frame_head),
        getattr(context, "max_chunk_bytes", None) or self._cfg.max_chunk_bytes,
        lambda: self.admission.evicted(ticket) if evicted.is_set() else None,
      )
      if getattr(context, "paced", False):  # The carrier cuts a stuck send itself.
        yield from chunks
      else:  # A client that stops reading blocks a send: the watchdog cuts it.
        yield from self._watchdog.watched(context, chunks)
    except Refusal as r:
      context.abort(r.code, r.message)
    finally:
      if ticket is not None:
        ticket.close()

  def _pull(
    self,
    request,
    session: str,
    frame: Callable[[bytes, int], bytes],
    chunk_bytes: int,
    eviction: Callable[[], Refusal | None],
  ) -> Iterator[bytes | memoryview]:
    """p's newest version as the pieces of its FragmentChunk messages, each framed by `frame`
    (`state_messages.state_pieces`), in chunks of `chunk_bytes` (the cached downlink's are
    `max_chunk_bytes`: `ServiceConfig` keeps the bulk port's bound at least that with a lossy
    downlink); cut between two messages once `eviction` returns a refusal."""
    deadline = time.monotonic() + self._cfg.stream_deadline_s
    self._check_fragment(request.fragment)
    p, known = int(request.fragment), int(request.known_version)
    with self._cond:
      self._members.check(int(request.learner_id), session)
      state = self._publisher.served_state(p)
      cached = self._adopter.delta_chunks(p, state.version) if self._adopter else None
    if known > state.version:
      raise self._refuse(
        grpc.StatusCode.OUT_OF_RANGE,
        f"Learner holds version {known} of fragment {p}, newer than the syncer's {state.version}.",
      )
    if known == state.version:
      return
    sent = 0

    def framed(head: bytes, n: int) -> bytes:
      nonlocal sent
      refusal = eviction()
      if refusal is not None:  # Between two messages: its place went to another learner.
        raise refusal
      if time.monotonic() > deadline:  # Between two messages.
        raise self._refuse(
          grpc.StatusCode.DEADLINE_EXCEEDED,
          f"Pull stream open for more than {self._cfg.stream_deadline_s} s: it was cut.",
        )
      sent += len(head) + n
      return frame(head, n)

    if cached is not None and known == state.version - 1:
      yield from _framed_messages(cached, framed)
    else:
      yield from state_messages.state_pieces(state, "fp32", framed, chunk_size=chunk_bytes)
    with self._cond:
      self._bytes_down += sent
      if int(request.learner_id) in self._core.alive():
        self._core.mark_delivered(int(request.learner_id), p, state.version)

  # -- admission --------------------------------------------------------------------------------

  def _check_fragment(self, fragment: int) -> None:
    if not 0 <= fragment < self._core.num_fragments:
      raise self._refuse(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Unknown fragment {fragment}; this syncer holds 0..{self._core.num_fragments - 1}.",
      )
    if not self._core.owns(fragment):  # A syncer shard's: the learner asked the wrong shard.
      owned = sorted(self._core.owned)
      raise self._refuse(
        grpc.StatusCode.OUT_OF_RANGE,
        f"Fragment {fragment} {shards.NOT_OWNED}; this one owns {owned[:16]}"
        f"{' ...' if len(owned) > 16 else ''}.",
      )


def _framed_messages(messages_: list[bytes | memoryview], frame: Callable[[bytes, int], bytes]):
  """Whole serialized messages as pieces, each after `frame(b"", its length)`."""
  for m in messages_:
    yield frame(b"", len(m))
    yield m
