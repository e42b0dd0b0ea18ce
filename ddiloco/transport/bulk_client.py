"""The learner's side of the syncer's bulk port, its data plane (framing in transport/bulk_wire.py).

`BulkClient` sends a Push's chunk messages, or reads a Pull's, over one TCP (or TLS) connection
per call, with the shared token and the learner's session in the hello. A status other than OK
raises `bulk_wire.BulkError`, a `grpc.RpcError` with the syncer's code and message, as a control
call would. A connection that cannot be made, or that breaks before the syncer's answer, raises
`BulkUnavailable`, an UNAVAILABLE `BulkError` naming the port: the caller retries it with backoff
as any call to a syncer that is away (a push is idempotent at the syncer, a pull only reads).
There is no other path for data: a learner that cannot reach the bulk port trains on and retries.

Every socket operation has a timeout: the connect `connect_timeout_s`, then each read or write
at most what is left of the call's deadline.
"""

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Iterable, Iterator

import grpc

from ddiloco.transport import bulk_wire
from ddiloco.transport.frames import ChunkFrame
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto.syncer_pb2 import FragmentHeader

# Bytes sent between two looks for an early answer from the syncer (`_answered`).
_CHECK_BYTES = 1 << 20


class BulkUnavailable(bulk_wire.BulkError):
  """The bulk port could not be reached, or the connection broke before the syncer answered:
  UNAVAILABLE, as a control call to a syncer that is away."""

  def __init__(self, details: str):
    super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class BulkClient:
  """Calls a syncer's bulk port.

  Args:
    host: the syncer's host (that of its gRPC address).
    port: its bulk port (RegisterResponse.bulk_port).
    token: the shared token (None: none).
    tls: a client TLS context (trusting the syncer's CA), or None for plain TCP.
    max_frame_bytes: the largest chunk message a Pull may send (the syncer's chunk bound).
    chunk_bytes: the chunk size of this port's streams (RegisterResponse.bulk_chunk_bytes): a
      caller cuts its pushes into chunks of it, and bounds a pull's chunks by it (default:
      `max_frame_bytes`).
    connect_timeout_s: longest a connect (and TLS handshake) may take.
  """

  def __init__(
    self,
    host: str,
    port: int,
    *,
    token: str | None,
    tls: ssl.SSLContext | None = None,
    max_frame_bytes: int,
    chunk_bytes: int | None = None,
    connect_timeout_s: float = 5.0,
  ):
    self.host, self.port = host, port
    self._max_frame = max_frame_bytes
    self.chunk_bytes = chunk_bytes or max_frame_bytes
    self._pool = bulk_wire.frame_pool(max_frame_bytes)
    self._token = token
    self._tls = tls
    self._connect_s = connect_timeout_s

  def _connect(self, deadline: float) -> socket.socket:
    try:
      sock = socket.create_connection(
        (self.host, self.port), timeout=min(self._connect_s, _left(deadline))
      )
    except OSError as e:
      raise BulkUnavailable(self._unreachable(e)) from e
    try:
      bulk_wire.tune(sock)
      if self._tls is not None:
        sock = self._tls.wrap_socket(sock, server_hostname=self.host)
    except OSError as e:
      sock.close()
      raise BulkUnavailable(self._unreachable(e)) from e
    return sock

  def _unreachable(self, error: OSError) -> str:
    return (
      f"Cannot reach the syncer's bulk port {self.host}:{self.port} ({error}). Pushes and pulls "
      "travel only over it: it must be reachable from the learner as the syncer's gRPC port is."
    )

  def push(self, pieces: Iterable[bytes | memoryview], session: str, timeout_s: float) -> bytes:
    """Sends a Push's frames, then the end mark; returns the serialized PushResponse.

    `pieces` are the frames' bytes in order (`messages.push_pieces` with `bulk_wire.frame_head`,
    or `bulk_wire.message_frames` of whole chunk messages). Small `bytes` pieces are gathered; any other
    piece is sent, with what was gathered, in one `sendmsg` before the next is asked for, so the
    source may reuse its memory (the encoder's runs: each byte is copied once, by the kernel).
    Stops sending as soon as the syncer answers (a push refused from its header).

    Raises:
      BulkError: the syncer's refusal. BulkUnavailable: no connection, or it broke first.
      ValueError: from `pieces` (a report that cannot be encoded): the connection is cut mid-frame,
        so the syncer refuses the stream as truncated and files nothing.
    """
    deadline = time.monotonic() + timeout_s
    sock = self._connect(deadline)
    with sock:
      try:
        try:
          _send_pieces(
            sock, deadline, bulk_wire.hello(bulk_wire.OP_PUSH, self._token, session), pieces
          )
        except ValueError:
          # Cut mid-frame: the syncer refuses the stream as truncated. Its answer is awaited, so
          # the refusal is settled (and counted) when the error reaches the caller.
          with contextlib.suppress(OSError, bulk_wire.BulkError):
            sock.shutdown(socket.SHUT_WR)
            _late_answer(sock, deadline)
          raise
        return _answer(sock, deadline)
      except (OSError, bulk_wire.BulkClosed) as e:
        answer = _late_answer(sock, deadline)  # A refusal may have closed it: read it if there.
        if answer is None:
          raise BulkUnavailable(
            f"The push's connection to the bulk port {self.host}:{self.port} broke: {e}"
          ) from e
        return answer

  def pull(
    self, request: bytes, session: str, timeout_s: float, placement: Placement | None = None
  ) -> Iterator[memoryview | ChunkFrame]:
    """The chunk messages of a Pull (`request`: a serialized PullRequest), read as they come (a
    helper thread reads the next frames while the caller decodes).

    With `placement` (given to the reader that decodes the stream, transport/placement.py), a
    chunk whose bytes belong in an offered array is read into it and comes as a `ChunkFrame`.

    Raises (while iterated):
      BulkError: the syncer's refusal. BulkUnavailable: no connection, or it broke first.
    """
    deadline = time.monotonic() + timeout_s
    sock = self._connect(deadline)
    hello = bulk_wire.hello(bulk_wire.OP_PULL, self._token, session, request)
    reader = bulk_wire.FrameReader(sock, self._pool, placement, FragmentHeader)
    ahead = bulk_wire.Prefetch(self._frames(sock, deadline, hello, reader), name="bulk-pull-reader")
    try:
      yield from ahead
    finally:
      with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # A read under way in the helper ends at once.
      ahead.close()
      sock.close()

  def _frames(
    self, sock: socket.socket, deadline: float, hello: bytes, reader: "bulk_wire.FrameReader"
  ) -> Iterator[memoryview | ChunkFrame]:
    try:
      _send(sock, deadline, [hello])
      while True:
        sock.settimeout(_left(deadline))
        (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, bulk_wire.LENGTH.size))
        if n == bulk_wire.END:
          code, message, _ = bulk_wire.read_trailer(sock)
          _raise_status(code, message)
          return
        if n > self._max_frame:
          raise BulkUnavailable(f"bulk pull: a frame of {n} bytes is over the bound.")
        yield reader.read(n)
    except (OSError, bulk_wire.BulkClosed, ValueError) as e:
      raise BulkUnavailable(
        f"The pull's connection to the bulk port {self.host}:{self.port} broke: {e}"
      ) from e


def address_host(address: str) -> str:
  """The host of a "host:port" or "[v6]:port" address (what the bulk port is reached on)."""
  if address.startswith("["):
    return address[1:].partition("]")[0]
  host, sep, _ = address.rpartition(":")
  return host if sep else address


def _left(deadline: float) -> float:
  left = deadline - time.monotonic()
  if left <= 0:
    raise TimeoutError("The call's deadline passed.")
  return left


def _send(sock: socket.socket, deadline: float, parts: list) -> None:
  sock.settimeout(_left(deadline))
  bulk_wire.send_parts(sock, parts)


def _send_pieces(sock: socket.socket, deadline: float, hello: bytes, pieces: Iterable) -> None:
  """The hello, then `pieces` (see `BulkClient.push`), then the end mark unless the syncer
  answered first."""
  pending, gathered, unchecked = [hello], 0, 0
  for piece in pieces:
    pending.append(piece)
    gathered += len(piece)
    if isinstance(piece, bytes) and gathered < bulk_wire.GATHER_BYTES:
      continue
    if unchecked >= _CHECK_BYTES:  # Now and then, not per send: select is a system call.
      if _answered(sock):
        return
      unchecked = 0
    _send(sock, deadline, pending)
    unchecked += gathered
    pending, gathered = [], 0
  _send(sock, deadline, [*pending, bulk_wire.LENGTH.pack(bulk_wire.END)])


def _answered(sock: socket.socket) -> bool:
  """Whether the syncer has answered already (its trailer is waiting to be read).

  Not known on TLS: the server's session tickets make the socket readable too, and TLS cannot
  peek; a refused push is then sent whole (the syncer drains it for a while), or its connection
  breaks and the caller's retry is refused again with the same status.
  """
  if hasattr(sock, "cipher"):
    return False
  readable, _, _ = select.select([sock], [], [], 0)
  return bool(readable)


def _answer(sock: socket.socket, deadline: float) -> bytes:
  """The body of the syncer's trailer (a Push's), or its refusal raised."""
  sock.settimeout(_left(deadline))
  (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, bulk_wire.LENGTH.size))
  if n != bulk_wire.END:
    raise bulk_wire.BulkClosed(f"Expected the syncer's answer, got a {n}-byte frame.")
  code, message, body = bulk_wire.read_trailer(sock)
  _raise_status(code, message)
  return body


def _late_answer(sock: socket.socket, deadline: float) -> bytes | None:
  """The answer of a syncer that cut the connection after answering; None if there is none."""
  try:
    return _answer(sock, min(deadline, time.monotonic() + 1.0))
  except (OSError, bulk_wire.BulkClosed, ValueError):
    return None


def _raise_status(code, message: str) -> None:
  if code.value[0] != 0:
    raise bulk_wire.BulkError(code, message)
