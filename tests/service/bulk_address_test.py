"""The bulk port listens where gRPC does: a syncer served on every interface as "[::]:port"
(`ddiloco-syncer --host=::`) is reached over IPv4 and IPv6 on both ports, so learners that reach it
by an IPv4 address push and pull over the bulk port, not over gRPC."""

import socket

import numpy as np
import pytest

from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import SyncerConfig
from ddiloco.transport.client import SyncerClient, fragment_layouts

pytestmark = [
  pytest.mark.integration,
  pytest.mark.timeout(60),
  pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="needs a dual-stack IPv6 host"),
]

TOKEN = "tok"
FRAGMENTS = [["a/w"]]
INIT = {"a/w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}
LAYOUT = fragment_layouts(FRAGMENTS, INIT)[0]


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_a_syncer_on_every_interface_serves_the_bulk_port_over_ipv4_and_ipv6(host):
  svc = make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=SyncerConfig(),
    service_config=ServiceConfig(liveness_timeout_s=600),
    layout_digest="L",
  )
  srv = serve(svc, address="[::]:0", token=TOKEN)
  client = SyncerClient(f"{host}:{srv.port}", token=TOKEN, deadline_s=5.0)
  try:
    client.register(0, layout_digest="L", num_fragments=1)
    state = client.pull(
      0,
      0,
      -1,
      layout_keys=list(LAYOUT),
      shapes={k: s for k, (s, _) in LAYOUT.items()},
      dtypes={k: d for k, (_, d) in LAYOUT.items()},
    )
    np.testing.assert_array_equal(state.values["a/w"], INIT["a/w"])
    assert client.bulk_port == srv.bulk.port
    assert srv.bulk.calls["Pull"] == 1  # The pull came over the bulk port.
  finally:
    client.close()
    srv.stop(grace_s=0.5)
