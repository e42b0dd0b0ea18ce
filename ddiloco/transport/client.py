"""The learner's side of the syncer: a thin, thread-safe client with deadlines.

Control calls (Register, Heartbeat, Rounds, Leave, Status, Recover) are gRPC on the syncer's
address; its data, pushes and pulls, go over the syncer's bulk port (transport/bulk_client.py),
which Register advertises, and never over gRPC. Every call has a deadline; the gRPC channel
reconnects with gRPC's exponential backoff. Pushes answered ABORTED (late) or ALREADY_EXISTS
(duplicate) are protocol outcomes, returned as a `ReportResult`; every other failure raises
`grpc.RpcError` for the caller to retry or re-register (learner_process/retry.py). A bulk port that
cannot be reached fails UNAVAILABLE with the port in the message, logged once per outage; the
caller retries it with backoff as any call to a syncer that is away.

The same client runs over the in-process transport (`transport/in_process.py`) in the simulated
cluster: control calls through its channel, and data through the same frames, joined back into
whole chunk messages (`in_process.InProcessData`). The messages, and so the protocol, are the same.

The client keeps the session each Register returns, per learner id, and sends it on that
learner's pushes, pulls, Heartbeat, Leave, Rounds and Recover calls (`auth.SESSION_METADATA_KEY`;
in a data call's hello); a call refused PERMISSION_DENIED (another registration of the id voided
it) is fixed by registering again.

A push's frames are made while it is sent (`messages.push_pieces`: δ encoded in runs handed to
the socket as they are made, no protobuf object), and a pull's are decoded as they arrive, each
chunk received in place where its array waits for it (transport/placement.py).
"""

import itertools
import logging
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import grpc
import numpy as np

from ddiloco.protocol import FragmentState, Report, ReportResult
from ddiloco.transport import (
  auth,
  bulk_client,
  bulk_wire,
  events,
  in_process,
  messages,
  state_messages,
  wire,
)
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, FRAMING_SLACK, ArrayPool
from ddiloco.transport.frames import ChunkFrame
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

log = logging.getLogger(__name__)

# Push refusals that are answers of the protocol, not failures of the call (service/refusals.py).
_PROTOCOL_STATUSES = {
  grpc.StatusCode.ABORTED: "late",
  grpc.StatusCode.ALREADY_EXISTS: "duplicate",
}


class DataCarrier(Protocol):
  """What carries a client's pushes and pulls: the bulk port (`bulk_client.BulkClient`), or the
  in-process carrier of the simulated cluster."""

  chunk_bytes: int  # The chunk size of its streams.

  def push(self, pieces: Iterable[bytes | memoryview], session: str, timeout_s: float) -> bytes:
    """Sends a Push's frames (`bulk_wire.frame_head` pieces); returns the serialized PushResponse."""

  def pull(
    self, request: bytes, session: str, timeout_s: float, placement: Placement | None = None
  ) -> Iterator[Any]:
    """The chunk messages of a Pull (`request`: a serialized PullRequest), as they come."""


class SyncerClient:
  """Calls the syncer service at `address` (host:port), or over `channel`.

  Args:
    address: the syncer's host:port; its bulk port is on the same host.
    channel: a channel to call instead of connecting to `address`: the in-process transport
      (`server.serve_in_process(...).channel()`); `tls` and `tls_ca_file` do not apply to it.
    token: shared token sent as `authorization: Bearer ...` (None: none).
    tls_ca_file: use TLS trusting this PEM CA (None with `tls=False`: plain TCP), on both ports.
    tls: use TLS; with `tls_ca_file` None the system roots are trusted.
    deadline_s: deadline of unary calls.
    transfer_deadline_s: deadline of Push, Pull and Recover streams.
    max_chunk_bytes: largest chunk payload of a Recover, and of the in-process carrier's streams
      (the syncer's `ServiceConfig.max_chunk_bytes`); the bulk port's is advertised at Register.
    subscription_s: deadline of a Rounds subscription; the learner subscribes again when it ends
      (and then gets the open rounds and current versions again, so nothing is missed).
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
    self._md = auth.token_metadata(token)
    self._token = token
    self._tls: ssl.SSLContext | None = None
    # Over a socket the bulk port's client, made at Register; in process the in-process carrier.
    self._data: DataCarrier | None = None
    if channel is not None:
      if tls or tls_ca_file:
        raise ValueError("TLS applies to an address, not to a given channel.")
      if not isinstance(channel, in_process.InProcessChannel):
        raise ValueError(
          "A channel is the in-process transport's; over a network give the syncer's address "
          "(its data travels over its bulk port, which Register advertises)."
        )
      self._channel = channel
      self._data = in_process.InProcessData(channel, self._md, max_chunk_bytes)
      address = "in-process"
    elif tls or tls_ca_file:
      self._channel = grpc.secure_channel(address, auth.channel_credentials(tls_ca_file), options)
      self._tls = ssl.create_default_context(cafile=tls_ca_file)
    else:
      self._channel = grpc.insecure_channel(address, options)
    self._stub = syncer_pb2_grpc.SyncerStub(self._channel)
    # Recover's chunk side as raw bytes (request_serializer None): the same messages on the wire
    # as the generated stub's.
    self._recover_raw = self._channel.stream_unary(
      "/ddiloco.v1.Syncer/Recover",
      request_serializer=None,
      response_deserializer=syncer_pb2.RecoverResponse.FromString,
    )
    self._sessions: dict[int, str] = {}  # learner id -> session of its newest registration.
    self.address = address
    self.deadline_s = deadline_s
    self.transfer_deadline_s = transfer_deadline_s
    self.max_chunk_bytes = max_chunk_bytes
    self.subscription_s = subscription_s
    self._lock = threading.Lock()
    self._data_down = False  # The bulk port failed to connect last time (logged once).
    # Pulled values are received into recycled memory: fresh pages cost the kernel's zeroing on
    # every pull. A buffer comes back once the caller dropped every array made from it; at most
    # the largest fragment pulled so far is kept free.
    self._pull_pool = ArrayPool(0)
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
    """Registers `learner_id` and keeps the session the syncer issues for its later calls, and
    the bulk port it advertises for its data.

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
      if not isinstance(
        self._data, in_process.InProcessData
      ):  # A restarted syncer may have another port.
        self._data = self._bulk(resp)
    return resp

  def _bulk(self, resp: syncer_pb2.RegisterResponse) -> bulk_client.BulkClient | None:
    """The client of the bulk port a Register advertised (None: it advertised none)."""
    if not resp.bulk_port:
      return None
    chunk_bytes = resp.bulk_chunk_bytes or self.max_chunk_bytes
    return bulk_client.BulkClient(
      bulk_client.address_host(self.address),
      resp.bulk_port,
      token=self._token,
      tls=self._tls,
      max_frame_bytes=chunk_bytes + FRAMING_SLACK,
      chunk_bytes=chunk_bytes,
    )

  @property
  def bulk_port(self) -> int | None:
    """The syncer's bulk port this client pushes and pulls over; None before a Register (and
    over the in-process transport)."""
    data = self._data
    return data.port if isinstance(data, bulk_client.BulkClient) else None

  def _carrier(self) -> DataCarrier:
    """What carries data now, or UNAVAILABLE if the syncer advertised no bulk port."""
    data = self._data
    if data is None:
      raise bulk_client.BulkUnavailable(
        f"The syncer at {self.address} advertised no bulk port (register first): pushes and "
        "pulls travel only over it."
      )
    return data

  def _carried(self, call: Callable[[DataCarrier], Any]) -> Any:
    """`call(the carrier)`, with an unreachable bulk port logged once per outage."""
    try:
      result = call(self._carrier())
    except bulk_client.BulkUnavailable as e:
      with self._lock:
        first, self._data_down = not self._data_down, True
      if first:
        log.warning("%s Retrying with backoff.", e.details())
      raise
    if self._data_down:
      with self._lock:
        self._data_down = False
      log.info("the syncer's bulk port at %s answers again", self.address)
    return result

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

    `encoded`: that delta already encoded in `codec` (`messages.push_encoder`). The frames are
    encoded while the stream is sent (`messages.push_pieces`).

    Raises:
      ValueError: if the report cannot be encoded (e.g. a NaN/Inf value). Found midway, the stream
        ends short and the syncer refuses it as incomplete: nothing is filed.
      grpc.RpcError: for any failure other than a late or duplicate answer (UNAVAILABLE for a bulk
        port that cannot be reached, naming it).
    """
    sent = 0

    def push(data: DataCarrier) -> bytes:
      def frame(head: bytes, n: int) -> bytes:
        nonlocal sent
        sent += len(head) + n
        return bulk_wire.frame_head(head, n)

      pieces = messages.push_pieces(
        report,
        codec,
        frame,
        block_size=block_size,
        chunk_size=data.chunk_bytes,
        anchor_values=anchor_values,
        encoded=encoded,
      )
      return data.push(pieces, self.session(report.learner_id), self.transfer_deadline_s)

    try:
      resp = syncer_pb2.PushResponse.FromString(self._carried(push))
    except grpc.RpcError as e:
      status = _PROTOCOL_STATUSES.get(e.code())
      if status is None:
        raise
      self._count(up=sent)
      return ReportResult(status, e.details() or "", 0.0)
    self._count(up=sent)
    return events.report_result(resp)

  def recover(
    self, learner_id: int, fragment: int, version: int, values: Mapping[str, np.ndarray]
  ) -> syncer_pb2.RecoverResponse:
    """Hands `version` of `fragment` (its exact values, as received) back to a restarted syncer
    (a control call, over gRPC: rare, after a restart that lost merges)."""
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
    pieces = messages.push_pieces(
      report, "fp32", bulk_wire.frame_head, chunk_size=self.max_chunk_bytes
    )
    outgoing = [bytes(m) for m in bulk_wire.messages_of(pieces)]
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
      grpc.RpcError: on a failed call (UNAVAILABLE for a bulk port that cannot be reached, naming
        it); WireError on a malformed or mismatching stream.
    """
    request = syncer_pb2.PullRequest(
      learner_id=learner_id, fragment=fragment, known_version=known_version
    ).SerializeToString()
    received = 0

    def pull(data: DataCarrier) -> FragmentState | None:
      nonlocal received
      placement = Placement() if isinstance(data, bulk_client.BulkClient) else None
      stream = data.pull(request, self.session(learner_id), self.transfer_deadline_s, placement)
      try:
        first = next(stream, None)
        if first is None:
          return None

        def counted():
          nonlocal received
          for message in itertools.chain([first], stream):
            received += message.nbytes if isinstance(message, ChunkFrame) else len(message)
            yield message

        return state_messages.chunks_to_state(
          counted(),
          layout_keys,
          shapes,
          dtypes,
          base_lookup=base_lookup,
          max_chunk_bytes=data.chunk_bytes,
          placement=placement,
          alloc=self._pull_alloc,
        )
      finally:
        stream.close()  # A no-op once the stream is done; stops it if decoding failed midway.

    try:
      return self._carried(pull)
    finally:
      self._count(down=received)

  def _pull_alloc(self, n: int, dtype: np.dtype) -> np.ndarray:
    pool = self._pull_pool
    pool.max_free_bytes = max(pool.max_free_bytes, n * np.dtype(dtype).itemsize)
    return pool.empty(n, dtype)

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
