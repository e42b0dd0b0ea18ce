"""The syncer's bulk port, its data plane: pushes and pulls over a plain TCP (or TLS) socket.

gRPC's Python stack caps a push at about a third of what the socket carries (scripts/bench_wire.py;
docs/results.md, "Wire"), so data never goes over gRPC: the bulk port (framing in
transport/bulk_wire.py) carries the chunk messages with one kernel copy per byte on each side. Each
connection runs the data plane's handlers (`server.data_handlers`: the Push and Pull of
service/streams.py) behind the token check the control plane's calls pass
(`auth.TokenInterceptor`), with the learner's session passed as the call's metadata. The handlers
see a `bulk_calls.BulkCall` in place of gRPC's servicer context; a refusal they raise reaches the
client as a trailer with its gRPC status and message, counted in `Status.refused` as a control
call's.

The door, as hard as the gRPC port's:
- **Admission, fair between learners** (service/stream_gate.py). Each connection is a data
  stream of the service's `StreamGate` from its accept: unclaimed until its hello's session names
  its learner (`SyncerService.identify`), then counted against that learner (at most
  `max_data_streams_per_learner`). Unclaimed connections have a pool of their own
  (`max_unclaimed_streams`), where a new one evicts the oldest that has shown nothing: a flood of
  connections that never say who they are cannot keep a learner out, and takes none of the
  learners' places. When the learners' places (`max_data_streams`) are all taken, a learner with
  fewer open takes the newest of the learner with the most (it is cut RESOURCE_EXHAUSTED): stalled
  transfers of some learners cannot starve another. A connection whose session names no learner
  stays unclaimed until its handler refuses it.
- **Phase deadlines a trickle cannot reset** (`bulk_pace.PacedSocket`, `ServiceConfig.bulk_limits`):
  the hello (TLS handshake included) within `bulk_hello_s` of the accept; a push's first chunk
  message within `bulk_hello_s` of the hello, each later one within `stream_idle_s` plus its
  bytes at `bulk_min_rate`, read or sent (a pull's), and the whole call at that rate after the
  same grace, and within `stream_deadline_s`. Time counts only while the syncer waits on the
  peer, a send's bytes only once acknowledged. A phase past its deadline is cut with
  DEADLINE_EXCEEDED naming it, in the trailer when the peer can still read one, always counted
  (`Status.refused`, and by phase in `Status.counters`' `bulk_expired_<phase>`) and logged.
- **Bounded resources**: at most `ServiceConfig.bulk_connections` connections, each with one
  thread (a push's frames are read in it, one at a time) and one descriptor; one more is closed
  at once (counted, RESOURCE_EXHAUSTED). A connection buffers at most its hello (bounded before
  it is read, INVALID_ARGUMENT beyond) and a push's frame (a frame over `bulk_chunk_bytes +
  FRAMING_SLACK` is refused RESOURCE_EXHAUSTED before a byte of it is allocated); a stream cut
  mid-frame, or ended without its end mark, INVALID_ARGUMENT.
- The port is bound without SO_REUSEPORT (never shared); `stop` closes the listener, cuts every
  open connection and joins every thread.
"""

import collections
import contextlib
import logging
import socket
import ssl
import struct
import threading
import time

import grpc

from ddiloco.service import stream_gate
from ddiloco.service.bulk_calls import Aborted, BulkCall, PullFraming, PushFrames, Quiet
from ddiloco.service.refusals import Refusal
from ddiloco.service.service import SyncerService
from ddiloco.transport import auth, bulk_pace, bulk_wire
from ddiloco.transport.chunks import FRAMING_SLACK
from ddiloco.transport.placement import Placement

log = logging.getLogger(__name__)

_METHODS = {bulk_wire.OP_PUSH: bulk_wire.PUSH_METHOD, bulk_wire.OP_PULL: bulk_wire.PULL_METHOD}
_CallDetails = collections.namedtuple("_CallDetails", ["method", "invocation_metadata"])
_LAST_WORDS_S = 1.0  # Longest a refusal's trailer may wait to be sent on its way out.


class _Connection:
  """One accepted connection: its socket (replaced by its TLS wrapper), its place in the gate, and
  its eviction, which may come from any thread (another connection's admission)."""

  def __init__(self, sock: socket.socket, started: float):
    self.sock = sock
    self.started = started
    self.ticket: stream_gate.StreamTicket | None = None
    self.call: BulkCall | None = None
    self.evicted = threading.Event()
    self._lock = threading.Lock()

  def use(self, sock: socket.socket) -> socket.socket:
    """Makes `sock` (the TLS wrapper) the connection's socket."""
    with self._lock:
      self.sock = sock
      if self.evicted.is_set():
        _shutdown(sock, socket.SHUT_RD)
    return sock

  def evict(self) -> None:
    """Its place went to another stream before its handler ran: its reads end at once; it then
    answers RESOURCE_EXHAUSTED (`BulkServer._connection`)."""
    with self._lock:
      self.evicted.set()
      _shutdown(self.sock, socket.SHUT_RD)

  def reset(self) -> None:
    """Closes with a reset: the kernel drops what the socket still queues for the peer."""
    with self._lock, contextlib.suppress(OSError):
      self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

  def cut(self) -> None:
    if self.call is not None:
      self.call.close()
    with self._lock:
      _shutdown(self.sock, socket.SHUT_RDWR)


def _shutdown(sock: socket.socket, how: int) -> None:
  with contextlib.suppress(OSError):
    sock.shutdown(how)


class BulkServer:
  """Serves a `SyncerService`'s Push and Pull on a port of its own (see module docstring).

  Args:
    service: the service (its config bounds the door; refusals are counted in it; its
      `admission` admits the connections).
    handlers: the service's data handlers, by method path (`server.data_handlers(service)`).
    host: the interface to bind ("" or "0.0.0.0": every IPv4 one; "::": every one).
    port: the port (0: a free one).
    token: the shared token every call must carry (None: none).
    tls: (cert_file, key_file) to serve TLS, as the gRPC port does; None: plain TCP.
    max_connections: connections open at once (None: the config's `bulk_connections`).
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
    self._limits = cfg.bulk_limits()
    self._max_frame = cfg.bulk_chunk_bytes + FRAMING_SLACK
    self._max_connections = max_connections or cfg.bulk_connections
    self._admission = service.admission
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
    self._open: dict[threading.Thread, _Connection] = {}
    self._stopping = threading.Event()
    self.calls: collections.Counter[str] = collections.Counter()  # Push and Pull calls served.
    # Calls cut by a phase deadline, by phase; connections closed at their accept, by why.
    self.expired: collections.Counter[str] = collections.Counter()
    self.dropped: collections.Counter[str] = collections.Counter()
    self._acceptor = threading.Thread(target=self._accept_loop, name="syncer-bulk", daemon=True)
    self._acceptor.start()

  def stop(self, timeout_s: float = 5.0) -> None:
    """Stops accepting, cuts every open connection and joins every thread."""
    self._stopping.set()
    self._acceptor.join(timeout_s)
    self._listener.close()
    with self._lock:
      connections = dict(self._open)
    for connection in connections.values():
      connection.cut()
    deadline = time.monotonic() + timeout_s
    for thread in connections:
      thread.join(max(0.0, deadline - time.monotonic()))

  def open_connections(self) -> int:
    with self._lock:
      return len(self._open)

  # -- admission ----------------------------------------------------------------------------------

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
      self._admit(sock, time.monotonic())

  def _admit(self, sock: socket.socket, started: float) -> None:
    """Starts a connection's thread, or closes it at once (counted) when it cannot be admitted."""
    with self._lock:
      full = len(self._open) >= self._max_connections
    if full:
      message = f"The syncer's bulk port has {self._max_connections} connections open; retry later."
      self._drop(sock, "connections", self._refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
      return
    connection = _Connection(sock, started)
    # Unclaimed until its hello names its learner: evicted (its reads cut) for a newer one.
    ticket, why = self._admission.gate.admit(on_evict=connection.evict)
    if ticket is None:
      self._drop(sock, why, self._admission.refusal(why, None))
      return
    connection.ticket = ticket
    thread = threading.Thread(
      target=self._connection, args=(connection,), name="syncer-bulk-conn", daemon=True
    )
    with self._lock:
      self._open[thread] = connection
    thread.start()

  def _drop(self, sock: socket.socket, why: str, refusal: Refusal) -> None:
    """Closes a connection at its accept (its refusal counted), with its trailer if it fits the
    socket's buffer at once (a TLS client would need a handshake first: it just sees a close)."""
    with self._lock:
      self.dropped[why] += 1
    with contextlib.suppress(OSError), sock:
      if self._tls is None:
        sock.send(bulk_wire.trailer(refusal.code, refusal.message), socket.MSG_DONTWAIT)

  def _identify(self, call: BulkCall, session: str) -> None:
    """Claims the connection for the learner its session names (fairly: `StreamGate`); one that
    names none stays unclaimed, for its handler to refuse. Refusals raised as `Aborted`."""
    learner_id = self._service.identify(session)
    if learner_id is None:
      return
    try:
      self._admission.claim(call.ticket, learner_id)
    except Refusal as r:
      raise self._aborted(r) from None

  # -- a connection -------------------------------------------------------------------------------

  def _connection(self, connection: _Connection) -> None:
    me = threading.current_thread()
    sock = connection.sock
    try:
      bulk_wire.tune(sock)
      if self._tls is not None:  # The handshake is part of the hello's phase.
        sock.settimeout(max(0.001, connection.started + self._limits.hello_s - time.monotonic()))
        try:
          sock = connection.use(self._tls.wrap_socket(sock, server_side=True))
        except TimeoutError:
          message = f"No TLS handshake within {self._limits.hello_s:g} s of the connection."
          self._expired(bulk_pace.PhaseTimeout("hello", message))
          return
      paced = bulk_pace.PacedSocket(sock, self._limits, started=connection.started)
      op, metadata, session, request = self._hello(paced)
      paced.begin_transfer()
      connection.call = BulkCall(
        paced, metadata, self._service.config.bulk_chunk_bytes, connection.ticket
      )
      if not self._stopping.is_set():
        self._run(paced, connection.call, op, session, request)
    except Aborted as a:
      connection.ticket.close()  # Its place is free before its client reads why.
      self._last_words(connection.sock, a.code, a.message)
    except (OSError, ssl.SSLError, bulk_wire.BulkClosed, Quiet) as e:
      if isinstance(e, bulk_pace.PhaseTimeout):  # A pull's client not reading: no trailer.
        self._expired(e)
        connection.reset()  # What its socket still queues for it is dropped, not kept.
      elif connection.evicted.is_set() and connection.call is None:
        r = self._admission.evicted(connection.ticket)
        connection.ticket.close()
        self._last_words(connection.sock, r.code, r.message)
      else:
        log.debug("bulk connection ended: %s", e)
    except Exception:  # A bug must not kill the thread silently nor leak the connection.
      log.exception("bulk connection failed")
      self._last_words(connection.sock, grpc.StatusCode.INTERNAL, "The syncer failed on this call.")
    finally:
      if connection.call is not None:
        connection.call.close()
        connection.call.run_callbacks()
      connection.ticket.close()
      connection.sock.close()
      with self._lock:
        self._open.pop(me, None)

  def _hello(self, sock: bulk_pace.PacedSocket) -> tuple[int, tuple, str, bytes]:
    """(op, call metadata, session, request bytes) of the hello; refusals raised as `Aborted`."""
    try:
      head = bulk_wire.recv_exact(sock, len(bulk_wire.MAGIC) + bulk_wire.HELLO.size)
      if bytes(head[:4]) != bulk_wire.MAGIC:
        raise self._aborted(
          self._refusal(grpc.StatusCode.INVALID_ARGUMENT, "Not a bulk hello (bad magic).")
        )
      op, n_token, n_session, n_request = bulk_wire.HELLO.unpack(head[4:])
      if (
        op not in _METHODS
        or n_token > bulk_wire.MAX_TOKEN_BYTES
        or n_session > bulk_wire.MAX_SESSION_BYTES
        or n_request > bulk_wire.MAX_REQUEST_BYTES
      ):
        message = (
          f"Bulk hello out of bounds: op {op}, token {n_token}, session {n_session}, request "
          f"{n_request} bytes (at most {bulk_wire.MAX_TOKEN_BYTES}, "
          f"{bulk_wire.MAX_SESSION_BYTES}, {bulk_wire.MAX_REQUEST_BYTES})."
        )
        raise self._aborted(self._refusal(grpc.StatusCode.INVALID_ARGUMENT, message))
      rest = bytes(bulk_wire.recv_exact(sock, n_token + n_session + n_request))
      token = rest[:n_token].decode()
      session = rest[n_token : n_token + n_session].decode()
    except bulk_pace.PhaseTimeout as e:
      raise self._aborted(self._expired(e)) from None
    except UnicodeDecodeError:
      raise self._aborted(
        self._refusal(grpc.StatusCode.INVALID_ARGUMENT, "Bulk hello: text not UTF-8.")
      ) from None
    metadata = auth.token_metadata(token) + auth.session_metadata(session)
    return op, metadata, session, rest[n_token + n_session :]

  def _run(
    self, sock: bulk_pace.PacedSocket, call: BulkCall, op: int, session: str, request: bytes
  ) -> None:
    """Runs the call's handler, behind the token check, and sends its answer."""
    method = _METHODS[op]
    with self._lock:
      self.calls["Push" if op == bulk_wire.OP_PUSH else "Pull"] += 1
    handler = self._handlers[method]
    if self._interceptor is not None:
      details = _CallDetails(method, call.invocation_metadata())
      checked = self._interceptor.intercept_service(lambda _: handler, details)
      admitted, handler = checked is handler, checked
    else:
      admitted = True
    if admitted:  # The token is good: the session may claim the connection for its learner.
      self._identify(call, session)
    if op == bulk_wire.OP_PUSH:
      self._push(sock, call, handler)
    else:
      self._pull(sock, call, handler, request)

  def _push(self, sock: bulk_pace.PacedSocket, call: BulkCall, handler) -> None:
    call.placement = Placement()
    frames = PushFrames(
      sock,
      call,
      max_frame=self._max_frame,
      pool=self._pool,
      refuse=self._refusal,
      on_expired=self._count_expired,
    )
    try:
      response = handler.stream_unary(iter(frames), call)
      status = (grpc.StatusCode.OK, "", handler.response_serializer(response))
    except Aborted as a:
      status = (a.code, a.message, b"")
    call.placement.stop()  # Lets go of the arrays it offered.
    call.closing.set()  # A read that fails from now on ends quietly.
    # Its last words: not paced, as a push cut for its pace has no budget left to send why.
    self._last_words(sock.raw, *status)
    frames.drain()

  def _pull(self, sock: bulk_pace.PacedSocket, call: BulkCall, handler, request: bytes) -> None:
    framing = PullFraming(sock)
    call.frame_head = framing.head  # The stream comes as pieces, framed (module doc).
    pieces = handler.unary_stream(handler.request_deserializer(request), call)
    try:
      with contextlib.closing(pieces):  # Its `finally` (the stream's ticket) runs on any exit.
        pending = bulk_wire.send_pieces(sock, framing.counted(pieces))
    except bulk_pace.PhaseTimeout:
      raise  # A client that stopped reading: nothing more reaches it (`_connection`).
    except Exception as e:
      if framing.mid_frame():  # A trailer now would be read as the frame's bytes: cut instead.
        log.warning("bulk pull failed mid-frame, connection cut: %r", e)
        raise bulk_wire.BulkClosed("The pull failed mid-frame.") from None
      raise
    sock.begin_chunk()
    bulk_wire.send_parts(sock, [*pending, bulk_wire.trailer(grpc.StatusCode.OK, "")])

  # -- refusals -----------------------------------------------------------------------------------

  def _refusal(self, code: grpc.StatusCode, message: str) -> Refusal:
    """A refusal made at the bulk port, counted as the handlers' are."""
    self._service.count_refusal(code, "")
    return Refusal(code, message)

  def _aborted(self, refusal: Refusal) -> Aborted:
    return Aborted(refusal.code, refusal.message)

  def door_counters(self) -> dict[str, int]:
    """The door's counts as `Status.counters`: `bulk_expired_<phase>` (cut past a phase's
    deadline) and `bulk_dropped_<why>` (closed at the accept: over the connection cap, or no
    place in the stream gate)."""
    with self._lock:
      out = {f"bulk_expired_{phase}": n for phase, n in self.expired.items()}
      out |= {f"bulk_dropped_{why}": n for why, n in self.dropped.items()}
    return out

  def _count_expired(self, phase: str) -> None:
    with self._lock:
      self.expired[phase] += 1

  def _expired(self, e: bulk_pace.PhaseTimeout) -> Refusal:
    """The counted DEADLINE_EXCEEDED of a phase past its deadline, logged."""
    self._count_expired(e.phase)
    log.info("bulk call cut in its %s phase: %s", e.phase, e)
    return self._refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"{e} ({e.phase})")

  def _last_words(
    self, sock: socket.socket, code: grpc.StatusCode, message: str, body: bytes = b""
  ) -> None:
    """Sends a call's trailer, waiting at most `_LAST_WORDS_S` (a peer that does not read does
    not get it)."""
    with contextlib.suppress(OSError, ValueError):
      sock.settimeout(_LAST_WORDS_S)
      bulk_wire.send_parts(sock, [bulk_wire.trailer(code, message, body)])
