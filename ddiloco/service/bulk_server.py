"""The syncer's bulk port, its data plane: pushes and pulls over a plain TCP (or TLS) socket.

gRPC's Python stack caps a push at about a third of what the socket carries (scripts/bench_wire.py;
docs/results.md, "Wire"), so data never goes over gRPC: the bulk port (framing in
transport/bulk_wire.py) carries the chunk messages with one kernel copy per byte on each side. Each
connection runs the data plane's handlers (`server.data_handlers`: the Push and Pull of
service/streams.py, admitted by the `StreamGate`, read through a `PacedStream`, watched by the
`Watchdog`), behind the token check the control plane's calls pass (`auth.TokenInterceptor`),
with the learner's session passed as the call's metadata. The handlers see a `_Call` in place of
gRPC's servicer context; a refusal they raise reaches the client as a trailer with its gRPC
status and message, counted in `Status.refused` as a control call's.

The door's own bounds, on top of the handlers':
- at most `max_connections` connections (default: `max_data_streams`); one more is answered
  RESOURCE_EXHAUSTED and closed;
- the hello must arrive within `stream_idle_s`, its lengths within `bulk_wire`'s bounds (checked
  before anything is read), or INVALID_ARGUMENT / DEADLINE_EXCEEDED;
- a Push frame over `bulk_chunk_bytes + FRAMING_SLACK` is refused RESOURCE_EXHAUSTED before a
  byte of it is allocated (the handlers bound each chunk's data by `bulk_chunk_bytes`, which
  Register advertises, as they bound gRPC's by `max_chunk_bytes`); a stream cut mid-frame, or ended without its end mark, INVALID_ARGUMENT;
- every socket operation has a timeout (`stream_idle_s`, plus a second so that the handlers' own
  idle deadline, with its precise status, comes first); a Pull's stuck send is cut by the
  watchdog (CANCELLED), a Push's silence by `PacedStream` (DEADLINE_EXCEEDED);
- the port is bound without SO_REUSEPORT (never shared); `stop` closes the listener, cuts every
  open connection and joins every thread.
"""

import collections
import contextlib
import logging
import socket
import ssl
import threading
import time

import grpc

from ddiloco.service.refusals import Refusal
from ddiloco.service.service import SyncerService
from ddiloco.transport import auth, bulk_wire
from ddiloco.transport.chunks import FRAMING_SLACK, ArrayPool
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2

log = logging.getLogger(__name__)

_METHODS = {bulk_wire.OP_PUSH: bulk_wire.PUSH_METHOD, bulk_wire.OP_PULL: bulk_wire.PULL_METHOD}
_DRAIN_S = 2.0  # Longest a refused push's unread bytes are drained (so the trailer is not reset).
_CallDetails = collections.namedtuple("_CallDetails", ["method", "invocation_metadata"])


class _Aborted(Exception):
  """A handler aborted its call (`_Call.abort`): the status and message the client gets."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code, self.message = code, message


class _Call:
  """What the Push and Pull handlers use of gRPC's servicer context, for one bulk connection."""

  def __init__(
    self, sock: socket.socket, metadata: tuple[tuple[str, str], ...], max_chunk_bytes: int
  ):
    self._sock = sock
    self._metadata = metadata
    self.max_chunk_bytes = max_chunk_bytes  # The handlers' chunk bound on this port.
    self._callbacks: list = []
    self.closing = threading.Event()  # Set once the call is over: reads then stop quietly.
    # A push's chunks are received where the handler's reader offers (transport/placement.py).
    self.placement: Placement | None = None
    # A pull's stream is sent as pieces framed by this (`state_messages.state_pieces`).
    self.frame_head = None

  def invocation_metadata(self):
    return self._metadata

  def add_callback(self, callback) -> bool:
    self._callbacks.append(callback)
    return True

  def abort(self, code: grpc.StatusCode, details: str):
    raise _Aborted(code, details)

  def cancel(self) -> None:
    """The watchdog cuts a stuck send: the socket is shut, the blocked send raises."""
    self.close()

  def close(self) -> None:
    self.closing.set()
    with contextlib.suppress(OSError):
      self._sock.shutdown(socket.SHUT_RDWR)

  def run_callbacks(self) -> None:
    for callback in self._callbacks:
      callback()


class BulkServer:
  """Serves a `SyncerService`'s Push and Pull on a port of its own (see module docstring).

  Args:
    service: the service (its config bounds the door; refusals are counted in it).
    handlers: the service's data handlers, by method path (`server.data_handlers(service)`).
    host: the interface to bind ("" or "0.0.0.0": every IPv4 one; "::": every one).
    port: the port (0: a free one).
    token: the shared token every call must carry (None: none).
    tls: (cert_file, key_file) to serve TLS, as the gRPC port does; None: plain TCP.
    max_connections: connections open at once (None: the config's `max_data_streams`).
  """

  def __init__(
    self,
    service: SyncerService,
    handlers: dict[str, grpc.RpcMethodHandler],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    tls: tuple[str, str] | None = None,
    max_connections: int | None = None,
  ):
    self._service = service
    self._handlers = handlers
    cfg = service.config
    self._idle_s = cfg.stream_idle_s
    self._max_frame = cfg.bulk_chunk_bytes + FRAMING_SLACK
    self._max_connections = max_connections or cfg.max_data_streams
    self._pool = bulk_wire.frame_pool(self._max_frame)
    self._interceptor = auth.TokenInterceptor(token, service.count_refusal) if token else None
    self._tls = None
    if tls is not None:
      self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
      self._tls.load_cert_chain(*tls)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # create_server sets SO_REUSEADDR (restarts past TIME_WAIT) and never SO_REUSEPORT. An IPv6
    # socket takes IPv4 too, as gRPC's does on the same address: create_server alone would make it
    # IPv6-only, and learners reaching a syncer on "[::]" over IPv4 would find no bulk port.
    dualstack = family == socket.AF_INET6 and socket.has_dualstack_ipv6()
    self._listener = socket.create_server(
      (host, port), family=family, backlog=64, dualstack_ipv6=dualstack
    )
    self._listener.settimeout(0.2)  # The accept loop checks for `stop` this often.
    self.port = self._listener.getsockname()[1]
    self._lock = threading.Lock()
    self._open: dict[threading.Thread, list] = {}  # Thread -> [its socket, its _Call or None].
    self._stopping = threading.Event()
    self.calls: collections.Counter[str] = collections.Counter()  # Push and Pull calls served.
    self._acceptor = threading.Thread(target=self._accept_loop, name="syncer-bulk", daemon=True)
    self._acceptor.start()

  def stop(self, timeout_s: float = 5.0) -> None:
    """Stops accepting, cuts every open connection and joins every thread."""
    self._stopping.set()
    self._acceptor.join(timeout_s)
    self._listener.close()
    with self._lock:
      threads = {t: list(v) for t, v in self._open.items()}
    for sock, call in threads.values():
      if call is not None:
        call.close()
      with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # A connection still in its hello ends too.
    deadline = time.monotonic() + timeout_s
    for thread in threads:
      thread.join(max(0.0, deadline - time.monotonic()))

  def open_connections(self) -> int:
    with self._lock:
      return len(self._open)

  # -- connections --------------------------------------------------------------------------------

  def _accept_loop(self) -> None:
    while not self._stopping.is_set():
      try:
        sock, _ = self._listener.accept()
      except TimeoutError:
        continue
      except OSError:
        if self._stopping.is_set():
          return
        time.sleep(0.05)  # Out of descriptors, say: the next try may pass.
        continue
      with self._lock:
        full = len(self._open) >= self._max_connections
        if not full:
          thread = threading.Thread(
            target=self._connection, args=(sock,), name="syncer-bulk-conn", daemon=True
          )
          self._open[thread] = [sock, None]
      if full:
        self._refuse_connection(sock)
      else:
        thread.start()

  def _refuse_connection(self, sock: socket.socket) -> None:
    """Answers a connection beyond the bound RESOURCE_EXHAUSTED (counted) and closes it."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    self._service.count_refusal(code, "")
    message = f"The syncer's bulk port has {self._max_connections} connections open; retry later."
    with contextlib.suppress(OSError), sock:
      sock.settimeout(1.0)
      if self._tls is None:  # A TLS client would need a handshake first: it just sees a close.
        sock.sendall(bulk_wire.trailer(code, message))

  def _connection(self, sock: socket.socket) -> None:
    me = threading.current_thread()
    call = None
    try:
      sock.settimeout(self._idle_s)
      bulk_wire.tune(sock)
      if self._tls is not None:
        sock = self._tls.wrap_socket(sock, server_side=True)  # Handshake within the timeout.
      op, metadata, request = self._hello(sock)
      call = _Call(sock, metadata, self._service.config.bulk_chunk_bytes)
      with self._lock:
        self._open[me][1] = call
      if self._stopping.is_set():
        return
      sock.settimeout(self._idle_s + 1.0)  # The handlers' deadlines come first (module doc).
      self._run(sock, call, op, request)
    except _Aborted as a:
      self._send_status(sock, a.code, a.message)
    except (OSError, ssl.SSLError, bulk_wire.BulkClosed) as e:
      log.debug("bulk connection ended: %s", e)
    except Exception:  # A bug must not kill the thread silently nor leak the connection.
      log.exception("bulk connection failed")
      self._send_status(sock, grpc.StatusCode.INTERNAL, "The syncer failed on this call.")
    finally:
      if call is not None:
        call.close()
        call.run_callbacks()
      sock.close()
      with self._lock:
        self._open.pop(me, None)

  def _hello(self, sock: socket.socket) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
    """(op, call metadata, request bytes) of the hello; refusals raised as `_Aborted`."""
    try:
      head = bulk_wire.recv_exact(sock, len(bulk_wire.MAGIC) + bulk_wire.HELLO.size)
    except TimeoutError:
      raise self._refused(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"No bulk hello within {self._idle_s} s."
      ) from None
    if bytes(head[:4]) != bulk_wire.MAGIC:
      raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, "Not a bulk hello (bad magic).")
    op, n_token, n_session, n_request = bulk_wire.HELLO.unpack(head[4:])
    if (
      op not in _METHODS
      or n_token > bulk_wire.MAX_TOKEN_BYTES
      or n_session > bulk_wire.MAX_SESSION_BYTES
      or n_request > bulk_wire.MAX_REQUEST_BYTES
    ):
      raise self._refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Bulk hello out of bounds: op {op}, token {n_token}, session {n_session}, request "
        f"{n_request} bytes (at most {bulk_wire.MAX_TOKEN_BYTES}, {bulk_wire.MAX_SESSION_BYTES}, "
        f"{bulk_wire.MAX_REQUEST_BYTES}).",
      )
    try:
      rest = bytes(bulk_wire.recv_exact(sock, n_token + n_session + n_request))
      token = rest[:n_token].decode()
      session = rest[n_token : n_token + n_session].decode()
    except TimeoutError:
      raise self._refused(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"No whole bulk hello within {self._idle_s} s."
      ) from None
    except UnicodeDecodeError:
      raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, "Bulk hello: text not UTF-8.") from None
    metadata = auth.token_metadata(token) + auth.session_metadata(session)
    return op, metadata, rest[n_token + n_session :]

  def _refused(self, code: grpc.StatusCode, message: str) -> _Aborted:
    self._service.count_refusal(code, "")
    return _Aborted(code, message)

  def _run(self, sock: socket.socket, call: _Call, op: int, request: bytes) -> None:
    """Runs the call's handler, behind the token check, and sends its answer."""
    method = _METHODS[op]
    with self._lock:
      self.calls["Push" if op == bulk_wire.OP_PUSH else "Pull"] += 1
    handler = self._handlers[method]
    if self._interceptor is not None:
      details = _CallDetails(method, call.invocation_metadata())
      handler = self._interceptor.intercept_service(lambda _: handler, details)
    if op == bulk_wire.OP_PUSH:
      call.placement = Placement()
      frames = _PushFrames(
        sock,
        call,
        max_frame=self._max_frame,
        idle_s=self._idle_s,
        service=self._service,
        pool=self._pool,
      )
      try:
        response = handler.stream_unary(iter(frames), call)
        status = (grpc.StatusCode.OK, "", handler.response_serializer(response))
      except _Aborted as a:
        status = (a.code, a.message, b"")
      call.placement.stop()  # Lets go of the arrays it offered.
      call.closing.set()  # A read still under way in the handler's reader thread ends quietly.
      bulk_wire.send_parts(sock, [bulk_wire.trailer(*status)])
      frames.drain()
      return
    framing = _PullFraming()
    call.frame_head = framing.head  # The stream comes as pieces, framed (module doc).
    pieces = handler.unary_stream(handler.request_deserializer(request), call)
    try:
      with contextlib.closing(pieces):  # Its `finally` (the stream's ticket) runs on any exit.
        pending = bulk_wire.send_pieces(sock, framing.counted(pieces))
    except Exception as e:
      if framing.mid_frame():  # A trailer now would be read as the frame's bytes: cut instead.
        log.warning("bulk pull failed mid-frame, connection cut: %r", e)
        raise bulk_wire.BulkClosed("The pull failed mid-frame.") from None
      raise
    bulk_wire.send_parts(sock, [*pending, bulk_wire.trailer(grpc.StatusCode.OK, "")])

  def _send_status(self, sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
      bulk_wire.send_parts(sock, [bulk_wire.trailer(code, message)])


class _PullFraming:
  """Frames a Pull's pieces (`bulk_wire.frame_head`) and knows whether a frame is under way: a
  failure mid-frame must cut the connection, as a trailer would be read as the frame's bytes."""

  def __init__(self):
    self._yielded = 0  # Bytes of the pieces handed to the sender.
    self._frame_end = 0  # Where the last frame begun ends.

  def head(self, message_head: bytes, data_len: int) -> bytes:
    head = bulk_wire.frame_head(message_head, data_len)
    self._frame_end = self._yielded + len(head) + data_len
    return head

  def counted(self, pieces):
    for piece in pieces:
      self._yielded += len(piece)
      yield piece

  def mid_frame(self) -> bool:
    return self._yielded != self._frame_end and self._yielded > 0


class _Quiet(Exception):
  """A read failed after the call was over: nobody listens, nothing is counted."""


class _PushFrames:
  """A Push's frames as the handler's request iterator: each chunk message read into its own
  buffer, its length checked first; refusals counted and raised as the handler's `Refusal`s are.

  The handler reads it in `PacedStream`'s helper thread; once the call is over (`call.closing`)
  a read that fails ends it quietly: the call's status is already decided.
  """

  def __init__(
    self,
    sock,
    call: _Call,
    *,
    max_frame: int,
    idle_s: float,
    service: SyncerService,
    pool: ArrayPool,
  ):
    self._sock, self._call, self._max, self._idle_s = sock, call, max_frame, idle_s
    self._service = service
    self._reader = bulk_wire.FrameReader(sock, pool, call.placement, syncer_pb2.PushHeader)
    self.ended = False  # The end mark was read: nothing of the client's is left unread.

  def __iter__(self):
    try:
      while True:
        (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(self._sock, bulk_wire.LENGTH.size))
        if n == bulk_wire.END:
          self.ended = True
          return
        if n > self._max:
          raise self._refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Push frame of {n} bytes: chunk messages are at most {self._max} bytes.",
          )
        yield self._reader.read(n)
    except bulk_wire.BulkClosed as e:
      raise self._refusal(grpc.StatusCode.INVALID_ARGUMENT, f"Push stream truncated: {e}") from None
    except TimeoutError:
      raise self._refusal(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"No push bytes for {self._idle_s} s."
      ) from None
    except OSError:
      if not self._call.closing.is_set():
        raise

  def _refusal(self, code: grpc.StatusCode, message: str) -> Exception:
    if self._call.closing.is_set():
      return _Quiet()
    self._service.count_refusal(code, "")
    return Refusal(code, message)

  def drain(self) -> None:
    """Reads what the client still sends of a refused push until it closes, for at most
    `_DRAIN_S`: closing with unread bytes would make the kernel reset the connection, and the
    client could lose the trailer before reading it. The client stops sending once it sees it."""
    if self.ended:
      return
    deadline = time.monotonic() + _DRAIN_S
    buf = bytearray(1 << 16)
    with contextlib.suppress(OSError, ValueError):
      while time.monotonic() < deadline:
        self._sock.settimeout(max(0.01, deadline - time.monotonic()))
        if self._sock.recv_into(buf) == 0:
          return
