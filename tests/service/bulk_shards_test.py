"""A sharded syncer with a fixed bulk port (`ServiceConfig.bulk_port`): shard i serves it on
`bulk_port + i`, so shards on one host (`ddiloco-local`, or Ray's syncer node) all start, and a
learner's `ShardedClient` pushes and pulls each fragment over its owner's bulk port."""

import contextlib
import socket

import numpy as np
import pytest

from ddiloco.learner_process.shard_client import ShardedClient
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import SyncerConfig
from ddiloco.transport.client import SyncerClient, fragment_layouts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "tok"
S = 2
FRAGMENTS = [["a"], ["b"]]  # Fragment p is shard p's.
INIT = {"a": np.arange(256, dtype=np.float32), "b": -np.arange(256, dtype=np.float32)}
LAYOUTS = fragment_layouts(FRAGMENTS, INIT)


def _free_ports(n: int) -> int:
  """A port p with p .. p + n - 1 free now."""
  for _ in range(50):
    with contextlib.ExitStack() as stack:
      first = stack.enter_context(socket.socket())
      first.bind(("127.0.0.1", 0))
      base = first.getsockname()[1]
      try:
        for i in range(1, n):
          stack.enter_context(socket.socket()).bind(("127.0.0.1", base + i))
      except OSError:
        continue
      return base
  raise RuntimeError("no run of free ports")


def test_every_shard_serves_its_bulk_port_and_the_client_uses_each():
  grpc_base, bulk_base = _free_ports(S), _free_ports(S)
  addresses = [f"127.0.0.1:{grpc_base + i}" for i in range(S)]
  config = ServiceConfig(bulk_port=bulk_base, liveness_timeout_s=600)
  servers = []
  try:
    for shard in range(S):
      svc = make_syncer(
        fragment_keys=FRAGMENTS,
        init_values=INIT,
        syncer_config=SyncerConfig(),
        service_config=config,
        layout_digest="L",
        shard=shard,
        shard_addresses=addresses,
      )
      servers.append(serve(svc, address=addresses[shard], token=TOKEN))
    assert [srv.bulk.port for srv in servers] == [bulk_base + i for i in range(S)]

    def connect(address: str) -> SyncerClient:
      return SyncerClient(address, token=TOKEN, deadline_s=5.0)

    client = ShardedClient(connect(addresses[0]), connect)
    try:
      client.register(0, layout_digest="L", num_fragments=len(FRAGMENTS))
      for p, lay in enumerate(LAYOUTS):
        state = client.pull(
          0,
          p,
          -1,
          layout_keys=list(lay),
          shapes={k: s for k, (s, _) in lay.items()},
          dtypes={k: d for k, (_, d) in lay.items()},
        )
        np.testing.assert_array_equal(state.values[FRAGMENTS[p][0]], INIT[FRAGMENTS[p][0]])
      assert [srv.bulk.calls["Pull"] for srv in servers] == [1, 1]
    finally:
      client.close()
  finally:
    for srv in servers:
      srv.stop(grace_s=0.5)
