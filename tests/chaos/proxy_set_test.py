"""`ProxySet`: a proxy per port of every syncer shard, each forwarding to its own port, and faults
aimed at one shard's proxies or at all. In-process proxies (`LoopbackProxy`) in front of four gRPC
health servers, a "control" and a "bulk" port per shard, that answer differently, so each answer
says which shard it came from (the proxies forward bytes, whatever the protocol)."""

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.chaos.proxy import LoopbackProxy
from ddiloco.chaos.proxy_set import ProxySet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SERVING, NOT_SERVING = (
  health_pb2.HealthCheckResponse.SERVING,
  health_pb2.HealthCheckResponse.NOT_SERVING,
)
FAST_RECONNECT = [
  ("grpc.initial_reconnect_backoff_ms", 100),
  ("grpc.max_reconnect_backoff_ms", 300),
]


def _server(status):
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
  servicer = health.HealthServicer()
  servicer.set("", status)
  health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  return server, port


@pytest.fixture
def shards():
  """Two proxied 'shards' with two ports each: shard 0 answers SERVING, shard 1 NOT_SERVING.
  The channels: shard 0's and shard 1's control port, then their bulk ports."""
  servers = [_server(SERVING), _server(NOT_SERVING), _server(SERVING), _server(NOT_SERVING)]
  ports = [port for _, port in servers]
  proxies = ProxySet(
    ports[:2], ports[2:], make=lambda up, name: LoopbackProxy(up, control_timeout_s=10.0)
  )
  proxies.start()
  addresses = [*proxies.addresses, *(f"127.0.0.1:{p}" for p in proxies.bulk_ports)]
  channels = [grpc.insecure_channel(a, options=FAST_RECONNECT) for a in addresses]
  yield proxies, channels
  for ch in channels:
    ch.close()
  proxies.stop()
  for server, _ in servers:
    server.stop(0).wait(5)


def _check(channel, timeout=5.0, wait_for_ready=False):
  stub = health_pb2_grpc.HealthStub(channel)
  request = health_pb2.HealthCheckRequest(service="")
  return stub.Check(request, timeout=timeout, wait_for_ready=wait_for_ready).status


def _all(proxies: ProxySet) -> list:
  """Shard 0's and shard 1's control proxy, then their data proxies."""
  return [*proxies.proxies, *proxies.bulk]


def test_each_proxy_forwards_to_its_own_port(shards):
  proxies, channels = shards
  assert len(proxies) == 2 and proxies.address == proxies.addresses[0]
  assert len({*proxies.addresses, *(f"127.0.0.1:{p}" for p in proxies.bulk_ports)}) == 4
  assert [_check(ch) for ch in channels] == [SERVING, NOT_SERVING, SERVING, NOT_SERVING]


def test_a_fault_on_one_shard_hits_both_its_ports_and_spares_the_other(shards):
  proxies, channels = shards
  assert [_check(ch) for ch in channels] == [SERVING, NOT_SERVING, SERVING, NOT_SERVING]
  proxies.partition(mode="reset", shard=1)
  assert [p.partitioned for p in _all(proxies)] == [False, True, False, True]
  for channel in (channels[1], channels[3]):
    with pytest.raises(grpc.RpcError) as err:
      _check(channel, timeout=0.5)
    assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
  assert _check(channels[0]) == _check(channels[2]) == SERVING  # Shard 0's traffic flows.
  proxies.heal(shard=1)
  assert _check(channels[1], timeout=10, wait_for_ready=True) == NOT_SERVING
  assert _check(channels[3], timeout=10, wait_for_ready=True) == NOT_SERVING
  proxies.set_latency(0.05, shard=0)
  assert [p.latency_s for p in _all(proxies)] == [0.05, 0.0, 0.05, 0.0]


def test_a_fault_on_every_shard(shards):
  proxies, channels = shards
  assert [_check(ch) for ch in channels] == [SERVING, NOT_SERVING, SERVING, NOT_SERVING]
  assert proxies.drop() == 4  # One live connection through each proxy.
  proxies.set_latency(0.05)
  assert [p.latency_s for p in _all(proxies)] == [0.05] * 4
  proxies.partition(mode="hold")
  assert all(p.partitioned for p in _all(proxies))
  proxies.heal()
  assert not any(p.partitioned for p in _all(proxies))
  with pytest.raises(ValueError, match="No syncer shard 2"):
    proxies.drop(shard=2)


class _Fake:
  def __init__(self, fail):
    self.fail, self.stopped = fail, False

  def start(self):
    if self.fail:
      raise RuntimeError("no port")
    return 1

  def stop(self):
    self.stopped = True


def test_a_failed_start_stops_the_proxies_started():
  fakes = {"proxy": _Fake(False), "proxy_bulk": _Fake(True)}
  proxies = ProxySet([1], [2], make=lambda up, name: fakes[name])
  with pytest.raises(RuntimeError, match="no port"):
    proxies.start()
  assert fakes["proxy"].stopped
  with pytest.raises(ValueError):
    ProxySet([], [])
  with pytest.raises(ValueError, match="Every shard has a bulk port"):
    ProxySet([1, 2], [3])
