"""A syncer of two shards over real sockets, each fragment cut into two slices: three learners
train a short run, every shard merges a slice of every group's rounds, and every learner holds
each shard's exact bits (docs/architecture.md, "The sharded syncer")."""

import threading

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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

P, S, M, L, B = 3, 2, 3, 8, 8
JOB = JobConfig(
  run=RunConfig(
    model=configs.transformer_config(
      "tiny",
      vocab_size=256,
      max_len=L,
      num_layers=1,
      d_model=32,
      num_heads=2,
      head_dim=16,
      mlp_dim=64,
    ),
    data=text_data.TextDataConfig(seq_len=L, batch_size=B),
    schedule=FragmentSchedule(num_fragments=P, period=3, overlap=1),
    syncer=SyncerConfig(
      use_grace=False, keep_versions=4, outer_optimizer=lambda: optax.sgd(0.7), clock="slowest"
    ),
    learner=LearnerConfig(blocking=True),
    inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
    service=ServiceConfig(
      uplink_codec="fp32", downlink_codec="fp32", heartbeat_interval_s=0.05, liveness_timeout_s=600
    ),
    num_learners=M,
    eval_batches=1,
  ),
  syncer_shards=S,
)


def _serve(factory, shard, addresses):
  svc = server_lib.make_syncer(
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
  return server_lib.serve(svc, address=addresses[shard])


def _client(addresses):
  return ShardedClient(
    SyncerClient(addresses[0], deadline_s=10.0), lambda a: SyncerClient(a, deadline_s=10.0)
  )


def test_every_shard_merges_a_slice_of_every_group_and_digests_agree(tmp_path):
  factory = JOB.factory()
  layout, schedule = factory.layout, JOB.run.the_schedule()
  assert (schedule.slices, layout.num_fragments) == (S, P * S)
  addresses = tuple(f"127.0.0.1:{processes.free_port()}" for _ in range(S))
  servers = [_serve(factory, i, addresses) for i in range(S)]
  summaries = {}
  try:
    workers = []
    for i in range(M):
      worker, _ = runtime.make_learner_worker(
        JOB,
        learner_id=i,
        client=_client(addresses),
        workdir=str(tmp_path / f"learner_{i}"),
        connect_timeout_s=60.0,
      )
      worker.connect()
      workers.append(worker)
    threads = [
      threading.Thread(target=lambda i=i, w=w: summaries.__setitem__(i, w.run(9)))
      for i, w in enumerate(workers)
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=240)
    assert len(summaries) == M
    published = {}
    for i, srv in enumerate(servers):
      log = srv.service.merge_log()
      merged = {e.fragment for e in log}
      # Shard i merged only its slices, and a slice of every group.
      assert merged <= {f for f in range(P * S) if f % S == i}
      assert {schedule.group(f) for f in merged} == set(range(P)), (i, merged)
      published.update(
        {(f, v): d for (f, v), d in srv.service.published_digests().items() if f % S == i}
      )
    # Each shard holds about 1/S of the bytes: its slices of every group.
    owned = [sum(layout.fragment_bytes(f) for f in range(i, P * S, S)) for i in range(S)]
    assert max(owned) <= 1.5 * layout.total_bytes() / S, owned
    checks = 0
    for summary in summaries.values():
      assert summary["digest_mismatches"] == 0
      for f, v, d in summary["applies"]:
        assert published[(f, v)] == d
        checks += 1
    assert checks > 0
    applied = {f for s in summaries.values() for f, v, _ in s["applies"] if v > 0}
    assert applied == set(range(P * S))
  finally:
    for srv in servers:
      srv.stop(grace_s=0.1)
