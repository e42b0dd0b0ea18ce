"""`ProxySet`: one proxy per syncer shard, each forwarding to its own shard, and faults aimed at one
shard's proxy or at all. In-process proxies (`LoopbackProxy`) in front of two gRPC health servers
that answer differently, so each answer says which shard it came from."""

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
  """Two proxied 'shards': shard 0 answers SERVING, shard 1 NOT_SERVING."""
  servers = [_server(SERVING), _server(NOT_SERVING)]
  proxies = ProxySet(
    [port for _, port in servers], make=lambda up, i: LoopbackProxy(up, control_timeout_s=10.0)
  )
  proxies.start()
  channels = [grpc.insecure_channel(a, options=FAST_RECONNECT) for a in proxies.addresses]
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


def test_each_proxy_forwards_to_its_own_shard(shards):
  proxies, channels = shards
  assert len(proxies) == 2 and proxies.address == proxies.addresses[0]
  assert len(set(proxies.addresses)) == 2
  assert [_check(ch) for ch in channels] == [SERVING, NOT_SERVING]


def test_a_fault_on_one_shard_spares_the_other(shards):
  proxies, channels = shards
  assert [_check(ch) for ch in channels] == [SERVING, NOT_SERVING]
  proxies.partition(mode="reset", shard=1)
  assert [p.partitioned for p in proxies.proxies] == [False, True]
  with pytest.raises(grpc.RpcError) as err:
    _check(channels[1], timeout=0.5)
  assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
  assert _check(channels[0]) == SERVING  # Shard 0's traffic flows meanwhile.
  proxies.heal(shard=1)
  assert _check(channels[1], timeout=10, wait_for_ready=True) == NOT_SERVING
  proxies.set_latency(0.05, shard=0)
  assert [p.latency_s for p in proxies.proxies] == [0.05, 0.0]


def test_a_fault_on_every_shard(shards):
  proxies, channels = shards
  assert [_check(ch) for ch in channels] == [SERVING, NOT_SERVING]
  assert proxies.drop() == 2  # One live connection through each proxy.
  proxies.set_latency(0.05)
  assert [p.latency_s for p in proxies.proxies] == [0.05, 0.05]
  proxies.partition(mode="hold")
  assert all(p.partitioned for p in proxies.proxies)
  proxies.heal()
  assert not any(p.partitioned for p in proxies.proxies)
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
  fakes = [_Fake(False), _Fake(True)]
  proxies = ProxySet([1, 2], make=lambda up, i: fakes[i])
  with pytest.raises(RuntimeError, match="no port"):
    proxies.start()
  assert fakes[0].stopped
  with pytest.raises(ValueError):
    ProxySet([])
