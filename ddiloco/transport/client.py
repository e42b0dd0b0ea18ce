"""The learner's side of `ddiloco.v1.Syncer`: a thin, thread-safe gRPC client with deadlines.

Every call has a deadline; the channel reconnects with gRPC's exponential backoff. Pushes answered
ABORTED (late) or ALREADY_EXISTS (duplicate) are protocol outcomes, returned as a `ReportResult`;
every other failure raises `grpc.RpcError` for the caller to retry or re-register (distributed/retry.py).
The same client runs over a socket or over the in-process transport (`transport/in_process.py`):
the messages, and so the protocol, are the same.

The client keeps the session each Register returns, per learner id, and sends it on that learner's
Push, Pull, Heartbeat, Leave and Rounds calls (`auth.SESSION_METADATA_KEY`); a call refused
PERMISSION_DENIED (another registration of the id voided it) is fixed by registering again.

Push and Pull carry their chunks as serialized messages (scripts/bench_wire.py): a push's
messages are made while the stream is sent (`messages.push_messages`, one copy per payload byte,
no protobuf object), and a pull's are parsed by hand and decoded as they arrive
(`frames.parse_chunk`, the payload never copied out of the received bytes).
"""

import itertools
import logging
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from ddiloco.protocol import FragmentState, Report, ReportResult
from ddiloco.transport import (
  auth,
  bulk_client,
  bulk_route,
  bulk_wire,
  events,
  messages,
  state_messages,
  wire,
)
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, FRAMING_SLACK, ArrayPool
from ddiloco.transport.frames import ChunkFrame
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

log = logging.getLogger(__name__)

# Push refusals that are answers of the protocol, not failures of the call (distributed/refusals.py).
_PROTOCOL_STATUSES = {
  grpc.StatusCode.ABORTED: "late",
  grpc.StatusCode.ALREADY_EXISTS: "duplicate",
}


class SyncerClient:
  """Calls the syncer service at `address` (host:port), or over `channel`.

  Args:
    address: the syncer's host:port.
    channel: a channel to call instead of connecting to `address`, e.g. the in-process transport
      (`server.serve_in_process(...).channel()`); `tls` and `tls_ca_file` do not apply to it.
    token: shared token sent as `authorization: Bearer ...` (None: none).
    tls_ca_file: use TLS trusting this PEM CA (None with `tls=False`: plain TCP).
    tls: use TLS; with `tls_ca_file` None the system roots are trusted.
    deadline_s: deadline of unary calls.
    transfer_deadline_s: deadline of Push and Pull streams.
    max_chunk_bytes: largest chunk payload (the syncer's limit).
    subscription_s: deadline of a Rounds subscription; the learner subscribes again when it ends
      (and then gets the open rounds and current versions again, so nothing is missed).
    bulk: push and pull over the syncer's bulk port when its Register advertises one
      (distributed/bulk_server.py); on a connection failure the client goes back to gRPC and
      tries the port again after a backoff (`bulk_route.BulkRoute`; `bulk_retry_s`, doubled
      after each failure up to 5 minutes; a Register starts anew). Never over a given `channel`.
    bulk_retry_s: the first backoff before the bulk port is tried again.
  """

  def __init__(
    self,
    address: str | None = None,
    *,
    channel: Any = None,
    token: str | None = None,
    tls: bool = False,
    tls_ca_file: str | None = None,
    deadline_s: float = 10.0,
    transfer_deadline_s: float = 60.0,
    max_chunk_bytes: int = DEFAULT_CHUNK_SIZE,
    subscription_s: float = 300.0,
    bulk: bool = True,
    bulk_retry_s: float = 10.0,
  ):
    limit = max_chunk_bytes + FRAMING_SLACK
    options = [
      ("grpc.max_send_message_length", limit),
      ("grpc.max_receive_message_length", limit),
      ("grpc.initial_reconnect_backoff_ms", 200),
      ("grpc.max_reconnect_backoff_ms", 5000),
    ]
    if (address is None) == (channel is None):
      raise ValueError("SyncerClient needs an address or a channel, not both.")
    if channel is not None:
      if tls or tls_ca_file:
        raise ValueError("TLS applies to an address, not to a given channel.")
      self._channel = channel
      address = "in-process"
    elif tls or tls_ca_file:
      self._channel = grpc.secure_channel(address, auth.channel_credentials(tls_ca_file), options)
    else:
      self._channel = grpc.insecure_channel(address, options)
    self._stub = syncer_pb2_grpc.SyncerStub(self._channel)
    # The two streaming calls with raw bytes on the chunk side (request_serializer /
    # response_deserializer None): the same messages on the wire as the generated stub's.
    self._push_raw = self._channel.stream_unary(
      "/ddiloco.v1.Syncer/Push",
      request_serializer=None,
      response_deserializer=syncer_pb2.PushResponse.FromString,
    )
    self._recover_raw = self._channel.stream_unary(
      "/ddiloco.v1.Syncer/Recover",
      request_serializer=None,
      response_deserializer=syncer_pb2.RecoverResponse.FromString,
    )
    self._pull_raw = self._channel.unary_stream(
      "/ddiloco.v1.Syncer/Pull",
      request_serializer=syncer_pb2.PullRequest.SerializeToString,
      response_deserializer=None,
    )
    self._md = auth.token_metadata(token)
    self._sessions: dict[int, str] = {}  # learner id -> session of its newest registration.
    self.address = address
    self.deadline_s = deadline_s
    self.transfer_deadline_s = transfer_deadline_s
    self.max_chunk_bytes = max_chunk_bytes
    self.subscription_s = subscription_s
    self._lock = threading.Lock()
    bulk_tls = ssl.create_default_context(cafile=tls_ca_file) if tls or tls_ca_file else None
    self._bulk_wanted = bulk and channel is None
    self._route = bulk_route.BulkRoute(
      bulk_client.address_host(address) if address else "",
      token=token,
      tls=bulk_tls,
      retry_s=bulk_retry_s,
    )
    # Pulled values are received into recycled memory: fresh pages cost the kernel's zeroing on
    # every pull. A buffer comes back once the caller dropped every array made from it; at most
    # the largest fragment pulled so far is kept free.
    self._pull_pool = ArrayPool(0)
    self._token = token
    self.bytes_up = 0
    self.bytes_down = 0

  def close(self) -> None:
    self._channel.close()

  def wait_ready(self, timeout_s: float) -> None:
    """Blocks until the channel is connected; raises grpc.FutureTimeoutError after `timeout_s`."""
    ready = getattr(self._channel, "wait_ready", None)  # The in-process transport's.
    if ready is not None:
      ready(timeout_s)
      return
    grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

  def session(self, learner_id: int) -> str:
    """The session `learner_id`'s newest registration got ("" before one)."""
    with self._lock:
      return self._sessions.get(learner_id, "")

  def learner_metadata(self, learner_id: int) -> tuple[tuple[str, str], ...]:
    """Call metadata for `learner_id`'s calls: the shared token and its session, if registered."""
    with self._lock:
      session = self._sessions.get(learner_id)
    return self._md + auth.session_metadata(session)

  def register(
    self,
    learner_id: int,
    *,
    layout_digest: str,
    num_fragments: int,
    num_devices: int = 0,
    batch_size: int = 0,
    host: str = "",
    held: Mapping[int, tuple[int, str]] | None = None,
  ) -> syncer_pb2.RegisterResponse:
    """Registers `learner_id` and keeps the session the syncer issues for its later calls.

    `held` is {fragment: (version, digest)} of the newest versions the learner holds: a restarted
    syncer that lost one asks for it back (`RegisterResponse.recover`, then `recover`).
    """
    resp = self._stub.Register(
      syncer_pb2.RegisterRequest(
        learner_id=learner_id,
        layout_digest=layout_digest,
        num_fragments=num_fragments,
        num_devices=num_devices,
        batch_size=batch_size,
        host=host,
        held=[
          syncer_pb2.HeldFragment(fragment=p, version=v, digest=d)
          for p, (v, d) in sorted((held or {}).items())
        ],
      ),
      timeout=self.deadline_s,
      metadata=self._md,
    )
    with self._lock:
      self._sessions[learner_id] = resp.session
    # A syncer restarted without a bulk port (or with another) is heeded. The port's chunk bound:
    # a syncer that does not advertise one takes gRPC's there.
    self._route.advertise(
      resp.bulk_port if self._bulk_wanted else 0, resp.bulk_chunk_bytes or self.max_chunk_bytes
    )
    return resp

  @property
  def bulk_port(self) -> int | None:
    """The syncer's bulk port this client pushes and pulls over now; None: over gRPC."""
    return self._route.port

  def push(
    self,
    report: Report,
    codec: str,
    *,
    block_size: int = 64,
    anchor_values: Mapping[str, np.ndarray] | None = None,
    encoded: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
  ) -> ReportResult:
    """Streams one report; `anchor_values` (Θ^(anchor) as held) makes it a delta (docs/algorithm.md §5).

    `encoded`: that delta already encoded in `codec` (`messages.push_encoder`).

    The chunks are encoded while the stream is sent (`messages.push_messages`).

    Raises:
      ValueError: if the report cannot be encoded (e.g. a NaN/Inf value). Found midway, the stream
        ends short and the syncer refuses it as incomplete: nothing is filed.
      grpc.RpcError: for any failure other than a late or duplicate answer.
    """
    failed: list[ValueError] = []
    sent = 0

    def stream():  # Made anew if the bulk port fails and the push goes over gRPC.
      nonlocal sent
      sent = 0
      outgoing = messages.push_messages(
        report,
        codec,
        block_size=block_size,
        chunk_size=self.max_chunk_bytes,
        anchor_values=anchor_values,
        encoded=encoded,
      )
      try:
        for message in outgoing:
          sent += len(message)
          yield message
      except ValueError as e:  # gRPC's request thread would only log it: keep it for the caller.
        failed.append(e)

    def pieces(chunk_bytes: int):  # The bulk port's: the same messages (in the port's chunk
      # size), framed, sent piece by piece uncopied.
      nonlocal sent
      sent = 0

      def frame(head: bytes, n: int) -> bytes:
        nonlocal sent
        sent += len(head) + n
        return bulk_wire.frame_head(head, n)

      return messages.push_pieces(
        report,
        codec,
        frame,
        block_size=block_size,
        chunk_size=chunk_bytes,
        anchor_values=anchor_values,
        encoded=encoded,
      )

    try:
      resp = self._push_call(stream, pieces, report.learner_id)
    except grpc.RpcError as e:
      if failed:
        raise failed[0] from e
      status = _PROTOCOL_STATUSES.get(e.code())
      if status is None:
        raise
      self._count(up=sent)
      return ReportResult(status, e.details() or "", 0.0)
    if failed:  # The syncer cannot accept a short stream; should it, the report is still bad.
      raise failed[0]
    self._count(up=sent)
    return events.report_result(resp)

  def _push_call(
    self, stream: Callable, pieces: Callable, learner_id: int
  ) -> syncer_pb2.PushResponse:
    """A Push: `pieces(the port's chunk size)` over the bulk port if there is one, else (or if it
    fails to connect or breaks) `stream()`'s messages over gRPC."""
    bulk = self._route.current()
    if bulk is not None:
      try:
        body = bulk.push(
          pieces(bulk.chunk_bytes), self.session(learner_id), self.transfer_deadline_s
        )
        return syncer_pb2.PushResponse.FromString(body)
      except bulk_client.BulkUnavailable as e:
        self._route.down(e)
    return self._push_raw(
      stream(), timeout=self.transfer_deadline_s, metadata=self.learner_metadata(learner_id)
    )

  def recover(
    self, learner_id: int, fragment: int, version: int, values: Mapping[str, np.ndarray]
  ) -> syncer_pb2.RecoverResponse:
    """Hands `version` of `fragment` (its exact values, as received) back to a restarted syncer."""
    report = Report(
      learner_id=learner_id,
      fragment=fragment,
      values=values,
      tokens=0,
      steps=0,
      anchor_version=version,
      step=0,
      round_step=0,
    )
    outgoing = list(messages.push_messages(report, "fp32", chunk_size=self.max_chunk_bytes))
    resp = self._recover_raw(
      iter(outgoing),
      timeout=self.transfer_deadline_s,
      metadata=self.learner_metadata(learner_id),
    )
    self._count(up=sum(len(m) for m in outgoing))
    return resp

  def pull(
    self,
    learner_id: int,
    fragment: int,
    known_version: int,
    *,
    layout_keys: Sequence[str],
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, object],
    base_lookup: Callable[[int], Mapping[str, np.ndarray]] | None = None,
  ) -> FragmentState | None:
    """The newest version of `fragment`, or None if `known_version` is already the newest.

    Chunks are decoded as they arrive; the digest is verified against the header
    (transport/state_messages.py).

    Raises:
      grpc.RpcError: on a failed call; WireError on a malformed or mismatching stream.
    """
    request = syncer_pb2.PullRequest(
      learner_id=learner_id, fragment=fragment, known_version=known_version
    )

    def again(error: Exception) -> FragmentState | None:
      """The same pull over gRPC, after the bulk port failed (a pull only reads)."""
      self._route.down(error)
      return self.pull(
        learner_id,
        fragment,
        known_version,
        layout_keys=layout_keys,
        shapes=shapes,
        dtypes=dtypes,
        base_lookup=base_lookup,
      )

    bulk = self._route.current()
    placement = Placement() if bulk is not None else None
    stream, cancel = self._pull_call(request, bulk, placement)
    try:
      first = next(stream, None)
    except bulk_client.BulkUnavailable as e:
      return again(e)
    if first is None:
      return None
    received = 0

    def counted():
      nonlocal received
      for message in itertools.chain([first], stream):
        received += message.nbytes if isinstance(message, ChunkFrame) else len(message)
        yield message

    try:
      return state_messages.chunks_to_state(
        counted(),
        layout_keys,
        shapes,
        dtypes,
        base_lookup=base_lookup,
        max_chunk_bytes=self.max_chunk_bytes if bulk is None else bulk.chunk_bytes,
        placement=placement,
        alloc=self._pull_alloc,
      )
    except bulk_client.BulkUnavailable as e:
      return again(e)
    finally:
      cancel()  # A no-op once the stream is done; stops it if decoding failed midway.
      self._count(down=received)

  def _pull_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
    pool = self._pull_pool
    pool.max_free_bytes = max(pool.max_free_bytes, n * np.dtype(dtype).itemsize)
    return pool.empty(n, dtype)

  def _pull_call(
    self,
    request: syncer_pb2.PullRequest,
    bulk: bulk_client.BulkClient | None,
    placement: Placement | None,
  ) -> tuple[Iterator, Callable[[], None]]:
    """(the chunk messages of a Pull, a callable that stops it): over the bulk port `bulk` if
    there is one (chunks received in place where `placement` says), else over gRPC."""
    if bulk is not None:
      session = self.session(int(request.learner_id))
      stream = bulk.pull(
        request.SerializeToString(), session, self.transfer_deadline_s, placement=placement
      )
      return stream, stream.close
    call = self._pull_raw(
      request,
      timeout=self.transfer_deadline_s,
      metadata=self.learner_metadata(int(request.learner_id)),
    )
    return call, call.cancel

  def heartbeat(
    self, learner_id: int, *, step: int = 0, step_time_s: float = 0.0
  ) -> syncer_pb2.HeartbeatResponse:
    return self._stub.Heartbeat(
      syncer_pb2.HeartbeatRequest(learner_id=learner_id, step=step, step_time_s=step_time_s),
      timeout=self.deadline_s,
      metadata=self.learner_metadata(learner_id),
    )

  def rounds(self, learner_id: int) -> "RoundStream":
    """Subscribes to the syncer's round requests and version announcements (docs/algorithm.md §3).

    Iterate the result for `RoundRequest`s and `(fragment, version)` announcements; `cancel()` ends
    it. Iterating raises `grpc.RpcError` when the call fails or its deadline passes.
    """
    call = self._stub.Rounds(
      syncer_pb2.RoundsRequest(learner_id=learner_id),
      timeout=self.subscription_s,
      metadata=self.learner_metadata(learner_id),
    )
    return RoundStream(call)

  def leave(self, learner_id: int) -> bool:
    resp = self._stub.Leave(
      syncer_pb2.LeaveRequest(learner_id=learner_id),
      timeout=self.deadline_s,
      metadata=self.learner_metadata(learner_id),
    )
    return resp.was_registered

  def status(self) -> syncer_pb2.StatusResponse:
    return self._stub.Status(syncer_pb2.StatusRequest(), timeout=self.deadline_s, metadata=self._md)

  def _count(self, *, up: int = 0, down: int = 0) -> None:
    with self._lock:
      self.bytes_up += up
      self.bytes_down += down


def fragment_layouts(
  fragments: Sequence[Sequence[str]], values: Mapping[str, np.ndarray]
) -> list[wire.Layout]:
  """Per fragment, {key: (shape, dtype)} from the layout keys and any values with those keys."""
  return [
    wire.make_layout(
      list(ks), {k: np.shape(values[k]) for k in ks}, {k: values[k].dtype for k in ks}
    )
    for ks in fragments
  ]


class RoundStream:
  """A `Rounds` subscription: yields `RoundRequest`s and (fragment, version) announcements."""

  def __init__(self, call):
    self._call = call

  def __iter__(self):
    for event in self._call:
      read = events.syncer_event(event)
      if read is not None:
        yield read

  def cancel(self) -> None:
    self._call.cancel()
