"""A syncer sharded over two services, learners reaching both through one `ShardedClient`, over the
in-process transport and over real sockets: ownership at the door, every shard merging a slice of
every group with digests agreeing, and a shard that restarts alone while the other keeps merging,
losing no merge (docs/architecture.md, "The sharded syncer")."""

import threading
import time

import grpc
import optax
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import processes, runtime
from ddiloco.launch.job import JobConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.learner_process.shard_client import ShardedClient
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service import server as server_lib
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import SyncerConfig
from ddiloco.transport.client import SyncerClient

pytestmark = pytest.mark.timeout(240)  # Threads: a hang must fail the test.

P, L, B, S = 4, 8, 8, 2
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}
JOB = JobConfig(
  run=RunConfig(
    model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
    data=text_data.TextDataConfig(seq_len=L, batch_size=B),
    schedule=FragmentSchedule(num_fragments=P, period=4, overlap=1),
    syncer=SyncerConfig(
      use_grace=False, keep_versions=4, outer_optimizer=lambda: optax.sgd(0.7), clock="slowest"
    ),
    learner=LearnerConfig(blocking=True),
    inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
    service=ServiceConfig(
      uplink_codec="fp32", downlink_codec="fp32", heartbeat_interval_s=0.05, liveness_timeout_s=600
    ),
    num_learners=2,
    eval_batches=1,
  ),
  syncer_shards=S,
)
N = P * S  # Fragment ids: slice s of group g is fragment g·S + s, owned by shard s.
ADDRESSES = tuple(f"shard-{i}" for i in range(S))  # Names the test's `connect` resolves.


def _syncer(factory, shard: int, addresses: tuple[str, ...]):
  """Shard `shard` of the job's syncer, as `ddiloco-syncer --shard` makes it."""
  return server_lib.make_syncer(
    fragment_keys=factory.layout.fragments,
    init_values=factory.global_init_values(),
    syncer_config=JOB.run.the_syncer(),
    schedule=JOB.run.the_schedule(),
    service_config=JOB.run.the_service(),
    layout_digest=factory.layout.digest,
    embedding_keys=factory.embedding_keys(),
    shard=shard,
    shard_addresses=addresses,
  )


class Shards:
  """S in-process syncer services, one per shard, and clients that reach them by name."""

  def __init__(self):
    self.factory = JOB.factory()
    self.servers = [self._serve(i) for i in range(S)]

  def _serve(self, shard: int) -> server_lib.InProcessSyncer:
    return server_lib.serve_in_process(_syncer(self.factory, shard, ADDRESSES))

  def connect(self, address: str) -> SyncerClient:
    return SyncerClient(channel=self.servers[ADDRESSES.index(address)].channel(), deadline_s=10.0)

  def client(self) -> ShardedClient:
    return ShardedClient(self.connect(ADDRESSES[0]), self.connect)

  def stop(self):
    for srv in self.servers:
      srv.stop()


@pytest.fixture
def shards():
  s = Shards()
  yield s
  s.stop()


def test_a_shard_refuses_fragments_it_does_not_own(shards):
  client = shards.connect(ADDRESSES[0])
  resp = client.register(7, layout_digest=shards.factory.layout.digest, num_fragments=N)
  assert resp.shard == 0 and list(resp.shard_addresses) == list(ADDRESSES)
  layout = shards.factory.layout
  keys = list(layout.fragments[1])
  values = shards.factory.global_init_values()
  with pytest.raises(grpc.RpcError) as e:
    client.pull(
      7,
      1,
      -1,
      layout_keys=keys,
      shapes={k: values[k].shape for k in keys},
      dtypes={k: values[k].dtype for k in keys},
    )
  assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
  assert "another syncer shard" in e.value.details()
  svc = shards.servers[0].service
  assert svc.refused().get("OUT_OF_RANGE") == 1
  status = client.status()
  assert (status.shard, status.num_shards) == (0, S)
  assert shards.servers[1].service.status().shard == 1


def _run_workers(client, tmp_path, steps, during=None, learners=2):
  """Trains `learners` learners `steps` steps against the shards, each through its `client()`;
  `during(workers)` runs while they train."""
  workers, summaries = [], {}
  for i in range(learners):
    worker, _ = runtime.make_learner_worker(
      JOB,
      learner_id=i,
      client=client(),
      workdir=str(tmp_path / f"learner_{i}"),
      connect_timeout_s=30.0,
    )
    worker.connect()
    workers.append(worker)
  threads = [
    threading.Thread(target=lambda i=i, w=w: summaries.__setitem__(i, w.run(steps)))
    for i, w in enumerate(workers)
  ]
  for t in threads:
    t.start()
  if during is not None:
    during(workers)
  for t in threads:
    t.join(timeout=200)
  assert len(summaries) == learners
  return summaries


def _published(servers) -> dict[tuple[int, int], str]:
  out = {}
  for i, srv in enumerate(servers):
    for (p, v), d in srv.service.published_digests().items():
      if p % S == i:
        out[(p, v)] = d
  return out


def _check_slices_merged_and_applied(servers, summaries) -> None:
  """Every shard merged a slice of every group, and every learner applied each shard's exact
  bits of every fragment."""
  merges = [len(srv.service.merge_log()) for srv in servers]
  assert all(m > 0 for m in merges), merges
  for i, srv in enumerate(servers):
    merged = {e.fragment for e in srv.service.merge_log()}
    assert merged <= {p for p in range(N) if p % S == i}
    # Every shard took a slice of every group's rounds: shard i merged slice i of each group.
    assert {JOB.run.the_schedule().group(p) for p in merged} == set(range(P)), (i, merged)
  published = _published(servers)
  checks = 0
  for summary in summaries.values():
    assert summary["digest_mismatches"] == 0
    for p, v, d in summary["applies"]:
      assert published[(p, v)] == d
      checks += 1
  assert checks > 0
  # Every fragment merged on its own shard: the learners applied versions > 0 of each.
  assert {p for s in summaries.values() for p, v, _ in s["applies"] if v > 0} == set(range(N))


def test_learners_train_against_two_shards_and_digests_agree(shards, tmp_path):
  summaries = _run_workers(shards.client, tmp_path, steps=12)
  _check_slices_merged_and_applied(shards.servers, summaries)
  # Memory: a shard holds only its fragments' values.
  for i, srv in enumerate(shards.servers):
    for p in range(N):
      assert bool(srv.service.core.state(p).values) == (p % S == i)


def _grpc_shard(factory, shard, addresses):
  return server_lib.serve(_syncer(factory, shard, addresses), address=addresses[shard])


def _sockets_client(addresses) -> ShardedClient:
  return ShardedClient(
    SyncerClient(addresses[0], deadline_s=10.0), lambda a: SyncerClient(a, deadline_s=10.0)
  )


@pytest.mark.integration
def test_three_learners_over_real_sockets_get_every_shards_exact_bits(tmp_path):
  factory = JOB.factory()
  layout = factory.layout
  assert (JOB.run.the_schedule().slices, layout.num_fragments) == (S, N)
  addresses = tuple(f"127.0.0.1:{processes.free_port()}" for _ in range(S))
  servers = [_grpc_shard(factory, i, addresses) for i in range(S)]
  try:
    summaries = _run_workers(lambda: _sockets_client(addresses), tmp_path, steps=9, learners=3)
    _check_slices_merged_and_applied(servers, summaries)
    # Each shard holds about 1/S of the bytes: its slices of every group.
    owned = [sum(layout.fragment_bytes(f) for f in range(i, N, S)) for i in range(S)]
    assert max(owned) <= 1.5 * layout.total_bytes() / S, owned
  finally:
    for srv in servers:
      srv.stop(grace_s=0.1)


@pytest.mark.integration
def test_a_shard_that_is_down_or_restarted_leaves_the_others_alone():
  factory = JOB.factory()
  ports = [processes.free_port() for _ in range(S)]
  addresses = tuple(f"127.0.0.1:{p}" for p in ports)
  servers = [_grpc_shard(factory, i, addresses) for i in range(S)]
  client = ShardedClient(
    SyncerClient(addresses[0], deadline_s=5.0), lambda a: SyncerClient(a, deadline_s=5.0)
  )
  lay = factory.layout
  values = factory.global_init_values()

  def pull(p):
    keys = list(lay.fragments[p])
    return client.pull(
      5,
      p,
      -1,
      layout_keys=keys,
      shapes={k: values[k].shape for k in keys},
      dtypes={k: values[k].dtype for k in keys},
    )

  try:
    client.register(5, layout_digest=lay.digest, num_fragments=N)
    assert client.num_shards == S
    session0 = client.session(5)
    assert pull(0).version == 0 and pull(1).version == 0  # Each from its owner.
    servers[1].stop(grace_s=0.1, flush=False)  # Shard 1 dies.
    hb = client.heartbeat(5, step=3)
    assert hb.registered and list(hb.versions) == [0] * N  # Shard 0 answered alone.
    assert pull(2).version == 0  # Shard 0 still serves.
    with pytest.raises(grpc.RpcError) as e:
      pull(1)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    servers[1] = _grpc_shard(factory, 1, addresses)  # Back, without this learner.
    deadline = time.monotonic() + 30.0
    while client.heartbeat(5, step=4).registered:  # Until the client finds it forgot us.
      assert time.monotonic() < deadline
      time.sleep(0.2)
    client.register(5, layout_digest=lay.digest, num_fragments=N)
    assert client.session(5) == session0  # Shard 0 was not registered with again.
    assert 5 in servers[1].service.core.alive() and 5 in servers[0].service.core.alive()
    assert client.heartbeat(5, step=5).registered
    assert pull(3).version == 0
  finally:
    client.close()
    for srv in servers:
      srv.stop(grace_s=0.1)
