"""The in-process transport keeps gRPC's call semantics: serializers, status codes, deadlines,
cancellation, callbacks and interceptors (transport/in_process.py).

The syncer's own tests run over it too: tests/service/service_door_test.py and worker_test.py
are parametrized over gRPC and the in-process transport.
"""

import threading
import time

import grpc
import pytest

from ddiloco.transport import auth
from ddiloco.transport.in_process import InProcessRpcError, InProcessServer

pytestmark = pytest.mark.timeout(60)

SERVICE = "/test.Echo/"


class _Log:
  def __init__(self):
    self.calls: list[str] = []
    self.finished: list[str] = []
    self.seen: list = []


def _server(log: _Log, **kwargs) -> InProcessServer:
  def upper(request: str, context) -> str:
    log.calls.append("Upper")
    context.add_callback(lambda: log.finished.append("Upper"))
    log.seen.append(dict(context.invocation_metadata()))
    if request == "abort":
      context.abort(grpc.StatusCode.FAILED_PRECONDITION, "asked to abort")
    if request == "raise":
      raise RuntimeError("a bug")
    if request == "slow":
      time.sleep(0.2)
    return request.upper()

  def count(request: str, context):
    context.add_callback(lambda: log.finished.append("Count"))
    try:
      for i in range(int(request)):
        yield str(i)
      while context.is_active():  # Then waits for more, like the syncer's Rounds stream.
        time.sleep(0.01)
    finally:
      log.finished.append("Count generator closed")

  def join(requests, context) -> str:
    del context
    return "+".join(requests)

  encode, decode = (lambda s: s.encode()), (lambda b: b.decode())
  handlers = {
    SERVICE + "Upper": grpc.unary_unary_rpc_method_handler(
      upper, request_deserializer=decode, response_serializer=encode
    ),
    SERVICE + "Count": grpc.unary_stream_rpc_method_handler(
      count, request_deserializer=decode, response_serializer=encode
    ),
    SERVICE + "Join": grpc.stream_unary_rpc_method_handler(
      join, request_deserializer=decode, response_serializer=encode
    ),
  }
  return InProcessServer(handlers, **kwargs)


def _calls(channel):
  encode, decode = (lambda s: s.encode()), (lambda b: b.decode())
  return (
    channel.unary_unary(SERVICE + "Upper", request_serializer=encode, response_deserializer=decode),
    channel.unary_stream(
      SERVICE + "Count", request_serializer=encode, response_deserializer=decode
    ),
    channel.stream_unary(SERVICE + "Join", request_serializer=encode, response_deserializer=decode),
  )


def _code(excinfo) -> grpc.StatusCode:
  assert isinstance(excinfo.value, grpc.RpcError)
  return excinfo.value.code()


def test_messages_cross_through_both_sides_serializers():
  log = _Log()
  upper, count, join = _calls(_server(log).channel())
  assert upper("abc", metadata=(("k", "v"),)) == "ABC"
  assert log.seen == [{"k": "v"}]
  assert log.finished == ["Upper"]
  assert join(iter(["a", "b", "c"])) == "a+b+c"
  stream = count("3", timeout=5.0)
  assert [next(stream) for _ in range(3)] == ["0", "1", "2"]
  assert stream.cancel()


def test_handler_failures_are_rpc_errors_with_grpc_codes():
  log = _Log()
  upper, _, _ = _calls(_server(log).channel())
  with pytest.raises(grpc.RpcError) as e:
    upper("abort")
  assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
  assert e.value.details() == "asked to abort"
  with pytest.raises(grpc.RpcError) as e:
    upper("raise")
  assert _code(e) == grpc.StatusCode.UNKNOWN and "a bug" in e.value.details()
  assert log.finished == ["Upper", "Upper"]  # Callbacks run however the call ends.
  missing = _server(log).channel().unary_unary(SERVICE + "Nope")
  with pytest.raises(grpc.RpcError) as e:
    missing(b"")
  assert _code(e) == grpc.StatusCode.UNIMPLEMENTED


def test_deadlines():
  log = _Log()
  upper, count, _ = _calls(_server(log).channel())
  with pytest.raises(grpc.RpcError) as e:
    upper("slow", timeout=0.05)
  assert _code(e) == grpc.StatusCode.DEADLINE_EXCEEDED
  stream = count("1", timeout=0.3)
  assert next(stream) == "0"
  t0 = time.monotonic()
  with pytest.raises(grpc.RpcError) as e:
    next(stream)  # The handler waits while the call is active: its deadline ends it.
  assert _code(e) == grpc.StatusCode.DEADLINE_EXCEEDED
  assert time.monotonic() - t0 < 2.0
  assert "Count generator closed" in log.finished and "Count" in log.finished


def test_cancel_from_another_thread_ends_a_waiting_stream():
  log = _Log()
  _, count, _ = _calls(_server(log).channel())
  stream = count("0", timeout=30.0)
  errors = []

  def read():
    try:
      for _ in stream:
        pass
    except grpc.RpcError as e:
      errors.append(e.code())

  reader = threading.Thread(target=read)
  reader.start()
  time.sleep(0.1)
  stream.cancel()
  reader.join(timeout=5)
  assert not reader.is_alive()
  assert errors == [grpc.StatusCode.CANCELLED]
  assert "Count" in log.finished


def test_a_stopped_server_is_unavailable_and_a_closed_channel_cancelled():
  log = _Log()
  server = _server(log)
  a, b = server.channel(), server.channel()
  upper_a, _, _ = _calls(a)
  upper_b, _, _ = _calls(b)
  a.close()
  with pytest.raises(grpc.RpcError) as e:
    upper_a("x")
  assert _code(e) == grpc.StatusCode.CANCELLED
  assert upper_b("x") == "X"  # Closing one client's channel leaves the others.
  server.stop()
  with pytest.raises(grpc.RpcError) as e:
    upper_b("x")
  assert _code(e) == grpc.StatusCode.UNAVAILABLE
  assert isinstance(e.value, InProcessRpcError)


def test_server_interceptors_run_as_on_a_grpc_server():
  refused = []
  log = _Log()
  server = _server(
    log, interceptors=[auth.TokenInterceptor("s3cret", lambda *a: refused.append(a))]
  )
  upper, _, _ = _calls(server.channel())
  with pytest.raises(grpc.RpcError) as e:
    upper("x")
  assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
  assert refused == [(grpc.StatusCode.UNAUTHENTICATED, SERVICE + "Upper")]
  assert upper("x", metadata=auth.token_metadata("s3cret")) == "X"
  assert log.calls == ["Upper"]  # The refused call never reached the handler.


def test_a_client_takes_an_address_or_a_channel():
  from ddiloco.transport.client import SyncerClient

  channel = _server(_Log()).channel()
  with pytest.raises(ValueError, match="address or a channel"):
    SyncerClient()
  with pytest.raises(ValueError, match="address or a channel"):
    SyncerClient("127.0.0.1:1", channel=channel)
  with pytest.raises(ValueError, match="TLS"):
    SyncerClient(channel=channel, tls=True)
  client = SyncerClient(channel=channel)
  client.wait_ready(0.1)  # Nothing to connect.
  assert client.address == "in-process"
  client.close()
  with pytest.raises(grpc.RpcError):
    client.wait_ready(0.1)
