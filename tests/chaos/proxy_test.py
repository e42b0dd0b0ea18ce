"""The loopback proxy with a real gRPC server behind it (health service + a bytes echo method).

Every test starts its own server(s) and proxy and stops them (pytest-timeout guards the sockets).
Latency bounds are lower bounds only: a unary call crosses the proxy once each way, so with 0.2 s of
one-way latency it cannot finish in under 0.4 s on any machine.
"""

import os
import socket
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.chaos.proxy import LoopbackProxy, parse_address
from ddiloco.chaos.proxy_process import ProxyProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MIB = 1 << 20
MSG_LIMIT = 64 * MIB
# Fast reconnects after a reset or a refused connection (gRPC's default first backoff is 1 s).
CHANNEL_OPTIONS = [
  ("grpc.initial_reconnect_backoff_ms", 100),
  ("grpc.min_reconnect_backoff_ms", 100),
  ("grpc.max_reconnect_backoff_ms", 300),
  ("grpc.max_receive_message_length", MSG_LIMIT),
  ("grpc.max_send_message_length", MSG_LIMIT),
]


def _server(status=health_pb2.HealthCheckResponse.SERVING, port: int = 0):
  """A gRPC server with the health service (reporting `status`) and /test.Echo/Echo on bytes."""
  server = grpc.server(
    futures.ThreadPoolExecutor(max_workers=4),
    options=[("grpc.max_receive_message_length", MSG_LIMIT)],
  )
  servicer = health.HealthServicer()
  servicer.set("", status)
  health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
  echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
  server.add_generic_rpc_handlers(
    (grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo}),)
  )
  bound = server.add_insecure_port(f"127.0.0.1:{port}")
  assert bound != 0
  server.start()
  return server, bound


@pytest.fixture
def backend():
  server, port = _server()
  yield port
  server.stop(0).wait(5)


@pytest.fixture(params=[LoopbackProxy, ProxyProcess], ids=["thread", "process"])
def proxy(request, backend):
  p = request.param(backend, control_timeout_s=10.0)
  p.start()
  yield p
  p.stop()


@pytest.fixture
def channel(proxy):
  ch = grpc.insecure_channel(proxy.address, options=CHANNEL_OPTIONS)
  yield ch
  ch.close()


def _check(channel, timeout=5.0, wait_for_ready=False):
  stub = health_pb2_grpc.HealthStub(channel)
  request = health_pb2.HealthCheckRequest(service="")
  return stub.Check(request, timeout=timeout, wait_for_ready=wait_for_ready).status


def _wait_reset_seen(channel, timeout_s: float = 5.0) -> None:
  """Waits until the channel has noticed its connection was reset (it leaves READY).

  An RPC sent in the instant between the proxy's RST and the client reading it fails UNAVAILABLE
  like any RPC in flight during a drop; the claim under test is that the *next* call reconnects.
  """
  left_ready = threading.Event()

  def on_change(state):
    if state != grpc.ChannelConnectivity.READY:
      left_ready.set()

  channel.subscribe(on_change)
  try:
    assert left_ready.wait(timeout_s), "the channel did not notice the reset"
  finally:
    channel.unsubscribe(on_change)


def test_parse_address():
  assert parse_address(8080) == ("127.0.0.1", 8080)
  assert parse_address("localhost:50051") == ("localhost", 50051)
  for bad in ("nohost", ":1", "h:0", "h:x", 70000):
    with pytest.raises(ValueError):
      parse_address(bad)


def test_call_through_proxy_counts_bytes(proxy, channel):
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
  stats = proxy.stats()
  assert (stats.connections, stats.active, stats.resets) == (1, 1, 0)
  # HTTP/2 preface + SETTINGS + HEADERS/DATA each way: more than the 24-byte preface alone.
  assert stats.bytes_up > 24 and stats.bytes_down > 0


def test_large_grpc_message_round_trips(proxy, channel):
  payload = np.random.default_rng(0).integers(0, 256, size=16 * MIB, dtype=np.uint8).tobytes()
  echo = channel.unary_unary("/test.Echo/Echo")
  assert echo(payload, timeout=30) == payload
  stats = proxy.stats()
  # 16 MiB each way plus framing (9-byte HTTP/2 frame headers, 5-byte gRPC prefix, headers).
  assert 16 * MIB < stats.bytes_up < 16 * MIB + MIB
  assert 16 * MIB < stats.bytes_down < 16 * MIB + MIB


def test_latency_delays_both_directions(proxy, channel):
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING  # Connected, no handshake below.
  proxy.set_latency(0.2)
  assert proxy.latency_s == 0.2
  t0 = time.monotonic()
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
  assert time.monotonic() - t0 >= 0.4  # Request 0.2 s up, response 0.2 s down.
  proxy.set_latency(0.0)


def test_drop_resets_and_channel_reconnects(proxy, channel):
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
  assert proxy.drop() == 1
  stats = proxy.stats()
  assert (stats.resets, stats.active) == (1, 0)
  _wait_reset_seen(channel)
  assert _check(channel, wait_for_ready=True) == health_pb2.HealthCheckResponse.SERVING
  assert proxy.stats().connections == 2  # A new TCP connection through the proxy.


def test_hold_partition_times_out_then_heals(proxy, channel):
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
  proxy.partition(mode="hold")
  assert proxy.partitioned
  with pytest.raises(grpc.RpcError) as err:
    _check(channel, timeout=0.5)
  assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
  proxy.heal()
  assert not proxy.partitioned
  assert _check(channel, wait_for_ready=True) == health_pb2.HealthCheckResponse.SERVING
  assert proxy.stats().resets == 0  # Held, not cut: the same connection carried on.
  assert proxy.stats().connections == 1


def test_reset_partition_with_duration_heals_itself(proxy, channel):
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
  proxy.partition(1.0, mode="reset")
  assert proxy.stats().resets == 1  # The live connection was cut.
  with pytest.raises(grpc.RpcError) as err:
    _check(channel, timeout=0.5)
  assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
  deadline = time.monotonic() + 10
  while proxy.partitioned and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not proxy.partitioned
  assert _check(channel, timeout=10, wait_for_ready=True) == health_pb2.HealthCheckResponse.SERVING


def test_retarget_to_new_port(proxy, channel):
  assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
  other, other_port = _server(health_pb2.HealthCheckResponse.NOT_SERVING)
  try:
    proxy.set_upstream(f"127.0.0.1:{other_port}")
    assert proxy.upstream == f"127.0.0.1:{other_port}"
    assert proxy.stats().resets == 1
    _wait_reset_seen(channel)
    status = _check(channel, wait_for_ready=True)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # The new upstream answered.
  finally:
    other.stop(0).wait(5)


def test_upstream_restart_on_same_port():
  server, port = _server()
  with LoopbackProxy(port) as proxy:
    ch = grpc.insecure_channel(proxy.address, options=CHANNEL_OPTIONS)
    try:
      assert _check(ch) == health_pb2.HealthCheckResponse.SERVING
      server.stop(0).wait(5)
      _wait_reset_seen(ch)  # The proxy passed the dead syncer's close on to the client.
      with pytest.raises(grpc.RpcError) as err:
        _check(ch, timeout=2)
      assert err.value.code() == grpc.StatusCode.UNAVAILABLE
      assert proxy.stats().upstream_failures >= 1  # The proxy could not reach the dead syncer.
      server, _ = _server(health_pb2.HealthCheckResponse.NOT_SERVING, port=port)
      status = _check(ch, timeout=10, wait_for_ready=True)
      assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
      ch.close()
      server.stop(0).wait(5)


def _echo_server():
  """A raw TCP echo server (one connection); returns (port, thread, listening socket)."""
  lsock = socket.create_server(("127.0.0.1", 0))
  lsock.settimeout(10)

  def serve():
    conn, _ = lsock.accept()
    with conn:
      while data := conn.recv(MIB):
        conn.sendall(data)

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  return lsock.getsockname()[1], thread, lsock


@pytest.mark.parametrize("latency", [0.0, 0.02])
def test_raw_bytes_exact_and_in_order(latency):
  port, thread, lsock = _echo_server()
  data = np.random.default_rng(1).integers(0, 256, size=8 * MIB, dtype=np.uint8).tobytes()
  try:
    with LoopbackProxy(port, read_bytes=256 * 1024) as proxy:
      proxy.set_latency(latency)
      with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
        sender.start()
        got = bytearray()
        while len(got) < len(data):
          chunk = sock.recv(MIB)
          assert chunk, "connection closed early"
          got += chunk
        sender.join(10)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # The echo server's EOF came back through the proxy.
      assert bytes(got) == data  # Every byte, in order.
      stats = proxy.stats()
      assert (stats.bytes_up, stats.bytes_down) == (8 * MIB, 8 * MIB)
      assert (stats.connections, stats.resets, stats.upstream_failures) == (1, 0, 0)
  finally:
    thread.join(10)
    lsock.close()


def test_control_calls_need_a_started_proxy():
  proxy = LoopbackProxy(1234)
  with pytest.raises(RuntimeError):
    proxy.drop()
  proxy.stop()  # Stopping a proxy that never started is a no-op.
  with pytest.raises(ValueError):
    LoopbackProxy(1234, read_bytes=0)


def test_bad_fault_arguments(proxy):
  with pytest.raises(ValueError):
    proxy.set_latency(-0.1)
  with pytest.raises(ValueError):
    proxy.partition(mode="blackhole")
  with pytest.raises(ValueError):
    proxy.partition(0.0)
  assert not proxy.partitioned and proxy.latency_s == 0.0


def test_syncer_service_through_a_proxy_on_each_port_survives_a_drop_and_a_partition():
  # The ddiloco syncer behind two proxies, one per port (as ddiloco-chaos puts them): control over
  # one, data over the other, whose port the syncer advertises. A learner pulls a 4 MiB fp32
  # fragment (1024 x 1024 values) through the data proxy with 20 ms of latency; the pull it makes
  # while the data path is partitioned fails UNAVAILABLE naming the proxy's port; once healed, and
  # after a drop of the control path, it pulls again on the same client.
  from ddiloco.service.server import make_syncer, serve
  from ddiloco.service.service_config import ServiceConfig
  from ddiloco.syncer.core import SyncerConfig
  from ddiloco.transport.client import SyncerClient, fragment_layouts

  init = {"w": np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)}
  config = ServiceConfig(uplink_codec="fp32", downlink_codec="fp32", liveness_timeout_s=600.0)
  svc = make_syncer(
    fragment_keys=[["w"]],
    init_values=init,
    syncer_config=SyncerConfig(),
    service_config=config,
    layout_digest="L",
  )
  srv = serve(svc)
  layout = fragment_layouts([["w"]], init)[0]
  kwargs = {
    "layout_keys": list(layout),
    "shapes": {k: s for k, (s, _) in layout.items()},
    "dtypes": {k: d for k, (_, d) in layout.items()},
  }
  try:
    with LoopbackProxy(srv.port) as control, LoopbackProxy(srv.bulk.port) as data:
      svc.advertise_bulk(data.port)
      client = SyncerClient(control.address, max_chunk_bytes=config.max_chunk_bytes)
      try:
        client.wait_ready(10)
        client.register(0, layout_digest="L", num_fragments=1)
        assert client.bulk_port == data.port
        data.set_latency(0.02)
        state = client.pull(0, 0, -1, **kwargs)
        np.testing.assert_array_equal(state.values["w"], init["w"])  # Bit-exact through the proxy.
        assert data.stats().bytes_down > 4 * MIB and control.stats().bytes_down < MIB
        deadline = time.monotonic() + 10
        while data.stats().active and time.monotonic() < deadline:  # The pull's, closing.
          time.sleep(0.01)
        data.partition(mode="reset")
        with pytest.raises(grpc.RpcError) as cut:
          client.pull(0, 0, -1, **kwargs)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"bulk port 127.0.0.1:{data.port}" in cut.value.details()
        data.heal()
        assert control.drop() == 1  # The control channel's connection; it reconnects.
        try:
          client.register(0, layout_digest="L", num_fragments=1)  # Reconnects on this call...
        except grpc.RpcError as e:  # ... unless it was sent before the client read the RST.
          assert e.code() == grpc.StatusCode.UNAVAILABLE
          client.register(0, layout_digest="L", num_fragments=1)
        state = client.pull(0, 0, -1, **kwargs)
        np.testing.assert_array_equal(state.values["w"], init["w"])
        stats = data.stats()
        assert (stats.connections, stats.resets) == (3, 1)
        assert stats.bytes_down > 8 * MIB
      finally:
        client.close()
  finally:
    srv.stop(grace_s=0.5)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_process_proxy_refusals_come_back_and_stop_ends_the_child(backend):
  proxy = ProxyProcess(backend)
  with pytest.raises(RuntimeError, match="not started"):
    proxy.drop()
  proxy.start()
  pid = proxy.pid
  try:
    assert os.getsid(pid) == pid  # Its own session: scheduled apart from this process.
    with pytest.raises(RuntimeError, match="unknown operation"):
      proxy._call("shutdown_everything")
    with pytest.raises(RuntimeError, match="ValueError"):
      proxy._call("set_upstream", "nohost")  # Checked again in the child.
    assert proxy.drop() == 0  # The child still serves after a refusal.
  finally:
    proxy.stop()
  assert not _alive(pid)
  with pytest.raises(RuntimeError, match="not started"):
    proxy.drop()


def test_process_proxy_exits_when_its_parent_closes_the_pipe(backend):
  """A driver killed with SIGKILL cannot stop its proxy: the closed stdin ends the child."""
  proxy = ProxyProcess(backend)
  proxy.start()
  proc = proxy._proc
  proc.stdin.close()  # What the kernel does to a dead parent's end of the pipe.
  assert proc.wait(10) == 0
  proxy._proc = None
