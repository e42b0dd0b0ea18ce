"""The in-process transport: gRPC calls that reach a server's handlers without a socket.

`InProcessServer` holds the method handlers a `grpc.Server` would serve; its `channel()` stands in
for a `grpc.Channel` wherever a stub or `SyncerClient` takes one. Every
call goes through the same method handlers a `grpc.Server` would run (the same request
deserializers and response serializers, the same server interceptors), so the bytes, the codecs,
the checks at the door and the status codes are those of the gRPC runtime; only the socket and the
server's thread pool are gone. A call runs on the caller's thread (a server-streaming call on the
thread that iterates it).

What it keeps of gRPC's semantics:
  - errors are `grpc.RpcError`s with `code()` and `details()`: `context.abort` gives its code, an
    exception in the handler UNKNOWN, an unknown method UNIMPLEMENTED;
  - deadlines: a server-streaming call past its deadline ends with DEADLINE_EXCEEDED, and
    `context.is_active()` turns false; a unary call that returns after its deadline fails with
    DEADLINE_EXCEEDED (its work is done, as on a server whose answer came too late);
  - `cancel()` on a server-streaming call closes the handler's generator and ends the call with
    CANCELLED; callbacks given to `context.add_callback` run once the call ends, however it ends.

Used to run learners and a syncer in one process (tests, notebooks, the simulated cluster) over the
very protocol the runtime speaks: control calls as gRPC calls, and data, pushes and pulls, through
`InProcessData` in the bulk port's frames.
"""

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from ddiloco.transport import auth, bulk_wire
from ddiloco.transport.placement import Placement

__all__ = ["InProcessChannel", "InProcessData", "InProcessRpcError", "InProcessServer"]


class InProcessRpcError(grpc.RpcError, grpc.Call):
  """A failed in-process call, shaped like the error a gRPC channel raises."""

  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(f"{code.name}: {details}")
    self._code, self._details = code, details

  def code(self) -> grpc.StatusCode:
    return self._code

  def details(self) -> str:
    return self._details

  def initial_metadata(self):
    return ()

  def trailing_metadata(self):
    return ()

  def is_active(self) -> bool:
    return False

  def time_remaining(self) -> float | None:
    return None

  def cancel(self) -> bool:
    return False

  def add_callback(self, callback) -> bool:
    del callback
    return False


class _Abort(Exception):
  """Raised by `_Context.abort` to unwind the handler (grpc raises its own exception there)."""

  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(details)
    self.code, self.details = code, details


class _HandlerCallDetails(grpc.HandlerCallDetails):
  def __init__(self, method: str, metadata: Sequence[tuple[str, str]]):
    self.method = method
    self.invocation_metadata = tuple(metadata)


class _Context(grpc.ServicerContext):
  """What a handler sees of its call: metadata, deadline, abort, cancellation and callbacks."""

  def __init__(self, metadata: Sequence[tuple[str, str]], timeout: float | None):
    self._metadata = tuple(metadata)
    self._deadline = None if timeout is None else time.monotonic() + timeout
    self._cancelled = threading.Event()
    self._callbacks: list[Callable[[], None]] = []
    self._lock = threading.Lock()
    self._done = False

  # -- grpc.ServicerContext -----------------------------------------------------------------------

  def invocation_metadata(self):
    return self._metadata

  def peer(self) -> str:
    return "in-process"

  def peer_identities(self):
    return None

  def peer_identity_key(self):
    return None

  def auth_context(self):
    return {}

  def abort(self, code: grpc.StatusCode, details: str):
    raise _Abort(code, details)

  def abort_with_status(self, status):
    raise _Abort(status.code, status.details)

  def is_active(self) -> bool:
    return not self._cancelled.is_set() and not self.expired()

  def time_remaining(self) -> float | None:
    return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

  def cancel(self) -> None:
    self._cancelled.set()

  def add_callback(self, callback: Callable[[], None]) -> bool:
    with self._lock:
      if self._done:
        return False
      self._callbacks.append(callback)
    return True

  def send_initial_metadata(self, initial_metadata) -> None:
    del initial_metadata

  def set_trailing_metadata(self, trailing_metadata) -> None:
    del trailing_metadata

  def set_compression(self, compression) -> None:
    del compression

  def disable_next_message_compression(self) -> None:
    pass

  def set_code(self, code) -> None:
    del code

  def set_details(self, details) -> None:
    del details

  # -- the call's end -----------------------------------------------------------------------------

  def expired(self) -> bool:
    return self._deadline is not None and time.monotonic() > self._deadline

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def finish(self) -> None:
    """Runs the callbacks, once."""
    with self._lock:
      if self._done:
        return
      self._done = True
      callbacks, self._callbacks = self._callbacks, []
    for callback in callbacks:
      callback()


def _carry(message: Any, serialize: Callable | None, deserialize: Callable | None) -> Any:
  """`message` as the other side reads it: serialized, then deserialized, as on a wire."""
  data = serialize(message) if serialize is not None else message
  return deserialize(data) if deserialize is not None else data


def _error(exc: BaseException) -> InProcessRpcError:
  if isinstance(exc, InProcessRpcError):
    return exc
  if isinstance(exc, _Abort):
    return InProcessRpcError(exc.code, exc.details)
  return InProcessRpcError(
    grpc.StatusCode.UNKNOWN, f"Exception calling application: {type(exc).__name__}: {exc}"
  )


class _ResponseStream:
  """A server-streaming call being iterated: the responses, `cancel()`, and gRPC's errors."""

  def __init__(
    self,
    responses: Iterator[Any],
    context: _Context,
    serialize: Callable | None,
    deserialize: Callable | None,
  ):
    self._responses = responses
    self._context = context
    self._serialize = serialize
    self._deserialize = deserialize
    self._closed = False

  def __iter__(self):
    return self

  def __next__(self):
    if self._closed:
      raise StopIteration
    ctx = self._context
    try:
      if ctx.cancelled:
        raise InProcessRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
      if ctx.expired():
        raise InProcessRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
      item = next(self._responses)
      return _carry(item, self._serialize, self._deserialize)
    except StopIteration:
      self._end()
      if ctx.cancelled:
        raise InProcessRpcError(
          grpc.StatusCode.CANCELLED, "Locally cancelled by application!"
        ) from None
      if ctx.expired():
        raise InProcessRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
      raise
    except Exception as e:
      self._end()
      raise _error(e) from None

  def cancel(self) -> bool:
    """Ends the call: the handler's generator is closed and its callbacks run."""
    if self._closed:
      return False
    self._context.cancel()
    self._end()
    return True

  def is_active(self) -> bool:
    return not self._closed and self._context.is_active()

  def time_remaining(self) -> float | None:
    return self._context.time_remaining()

  def add_callback(self, callback) -> bool:
    return self._context.add_callback(callback)

  def _end(self) -> None:
    if self._closed:
      return
    self._closed = True
    close = getattr(self._responses, "close", None)
    if close is not None:
      # Runs the handler's `finally` blocks, as gRPC does when a call ends. A generator running on
      # another thread (a cancel while it waits) cannot be closed: it sees `is_active()` turn false
      # and ends by itself.
      with contextlib.suppress(ValueError):
        close()
    self._context.finish()


class InProcessServer:
  """Method handlers served in this process; `channel()` connects a client to them.

  Args:
    handlers: {method path ("/package.Service/Method"): grpc.RpcMethodHandler}, as a server would
      register them.
    interceptors: server interceptors, applied in order as a `grpc.server` applies them.
  """

  def __init__(
    self,
    handlers: Mapping[str, grpc.RpcMethodHandler],
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
  ):
    self._handlers = dict(handlers)
    self._interceptors = tuple(interceptors)
    self._stopped = False

  def channel(self) -> "InProcessChannel":
    """A new channel to this server (closing it leaves the server and other channels alone)."""
    return InProcessChannel(self)

  def stop(self) -> None:
    """From now on every call fails UNAVAILABLE, as with a server that went away."""
    self._stopped = True

  def handler(self, method: str, metadata: Sequence[tuple[str, str]]) -> grpc.RpcMethodHandler:
    if self._stopped:
      raise InProcessRpcError(grpc.StatusCode.UNAVAILABLE, "The in-process server stopped.")
    details = _HandlerCallDetails(method, metadata)

    def lookup(d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
      return self._handlers.get(d.method)

    continuation = lookup
    for interceptor in reversed(self._interceptors):
      continuation = _chain(interceptor, continuation)
    handler = continuation(details)
    if handler is None:
      raise InProcessRpcError(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
    return handler


class InProcessChannel:
  """A `grpc.Channel` stand-in whose calls run `server`'s handlers on the calling thread."""

  def __init__(self, server: InProcessServer):
    self._server = server
    self._closed = False

  # -- grpc.Channel's call factories (the generated stubs and SyncerClient use these) -------------

  def unary_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
    del kwargs

    def call(request, timeout=None, metadata=None, **kwargs):
      del kwargs

      def invoke(handler, context):
        return handler.unary_unary(
          _carry(request, request_serializer, handler.request_deserializer), context
        )

      return self._answer(method, metadata, timeout, response_deserializer, invoke)

    return call

  def stream_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
    del kwargs

    def call(request_iterator, timeout=None, metadata=None, **kwargs):
      del kwargs

      def invoke(handler, context):
        requests = self._stream(
          request_iterator, request_serializer, handler.request_deserializer, context
        )
        return handler.stream_unary(requests, context)

      return self._answer(method, metadata, timeout, response_deserializer, invoke)

    return call

  def _answer(self, method: str, metadata, timeout, response_deserializer, invoke: Callable) -> Any:
    """Runs a call with one response: `invoke(handler, context)`, then the response's bytes."""
    handler, context = self._open(method, metadata, timeout)
    try:
      response = invoke(handler, context)
      if context.expired():
        raise InProcessRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
      return _carry(response, handler.response_serializer, response_deserializer)
    except Exception as e:
      raise _error(e) from None
    finally:
      context.finish()

  def unary_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
    del kwargs

    def call(request, timeout=None, metadata=None, **kwargs):
      del kwargs
      handler, context = self._open(method, metadata, timeout)
      try:
        request = _carry(request, request_serializer, handler.request_deserializer)
        responses = iter(handler.unary_stream(request, context))
      except Exception as e:
        context.finish()
        raise _error(e) from None
      return _ResponseStream(responses, context, handler.response_serializer, response_deserializer)

    return call

  def stream_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
    del method, request_serializer, response_deserializer, kwargs
    raise NotImplementedError("The in-process channel has no bidirectional streams.")

  def subscribe(self, callback, try_to_connect=False) -> None:
    del try_to_connect
    callback(grpc.ChannelConnectivity.READY)

  def unsubscribe(self, callback) -> None:
    del callback

  def close(self) -> None:
    self._closed = True

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def wait_ready(self, timeout_s: float) -> None:
    """Ready at once (no connection to make); a closed channel raises like gRPC's."""
    del timeout_s
    if self._closed:
      raise InProcessRpcError(grpc.StatusCode.CANCELLED, "Channel closed!")

  # -- plumbing -----------------------------------------------------------------------------------

  def _open(self, method: str, metadata, timeout) -> tuple[grpc.RpcMethodHandler, _Context]:
    if self._closed:
      raise InProcessRpcError(grpc.StatusCode.CANCELLED, "Channel closed!")
    metadata = tuple(metadata or ())
    return self._server.handler(method, metadata), _Context(metadata, timeout)

  @staticmethod
  def _stream(
    messages: Iterable[Any],
    serialize: Callable | None,
    deserialize: Callable | None,
    context: _Context,
  ) -> Iterator[Any]:
    for message in messages:
      if context.cancelled:
        return
      yield _carry(message, serialize, deserialize)


class InProcessData:
  """The data plane over an in-process channel, the simulated cluster's carrier of pushes and
  pulls (`client.DataCarrier`): their frames (transport/bulk_wire.py) joined back into whole chunk
  messages (`bulk_wire.messages_of`) for the syncer's data handlers (`server.serve_in_process`),
  behind the same token check as on the bulk port.

  Args:
    channel: an `InProcessChannel` to the syncer.
    metadata: the token's call metadata.
    chunk_bytes: the chunk size of its streams (the syncer's `max_chunk_bytes`).
  """

  def __init__(
    self, channel: "InProcessChannel", metadata: tuple[tuple[str, str], ...], chunk_bytes: int
  ):
    self.chunk_bytes = chunk_bytes
    self._md = metadata
    self._push = channel.stream_unary(bulk_wire.PUSH_METHOD)  # Raw bytes both ways.
    self._pull = channel.unary_stream(bulk_wire.PULL_METHOD)

  def push(self, pieces: Iterable[bytes | memoryview], session: str, timeout_s: float) -> bytes:
    failed: list[ValueError] = []

    def stream():
      try:
        yield from bulk_wire.messages_of(pieces)
      except ValueError as e:  # Read in the handler's reader thread: keep it for the caller.
        failed.append(e)

    try:
      body = self._push(stream(), timeout=timeout_s, metadata=self._metadata(session))
    except grpc.RpcError as e:
      if failed:  # The syncer refused the short stream; the report itself is bad.
        raise failed[0] from e
      raise
    if failed:  # The syncer cannot accept a short stream; should it, the report is still bad.
      raise failed[0]
    return body

  def pull(
    self, request: bytes, session: str, timeout_s: float, placement: Placement | None = None
  ) -> Iterator[bytearray]:
    del placement  # Nothing to receive in place without a socket.
    call = self._pull(request, timeout=timeout_s, metadata=self._metadata(session))
    try:
      yield from bulk_wire.messages_of(call)
    finally:
      call.cancel()  # A no-op once the stream is done.

  def _metadata(self, session: str) -> tuple[tuple[str, str], ...]:
    return self._md + auth.session_metadata(session)


def _chain(interceptor: grpc.ServerInterceptor, continuation: Callable) -> Callable:
  return lambda details: interceptor.intercept_service(continuation, details)
