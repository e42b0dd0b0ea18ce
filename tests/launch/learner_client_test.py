"""A learner process's client (`runtime.learner_client`, what `ddiloco-learner` talks through) is
set by the run's `ServiceConfig` as the syncer is: a push or pull the syncer allows
`stream_deadline_s` is not cut sooner by the learner, chunks are bounded alike, and its pulls go
over the syncer's bulk port."""

import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import runtime
from ddiloco.launch.job import JobConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service import server as server_lib
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import SyncerConfig
from ddiloco.transport.client import fragment_layouts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

L, B = 8, 8
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}
SERVICE = ServiceConfig(
  uplink_codec="fp32",
  downlink_codec="fp32",
  max_chunk_bytes=2 << 20,
  stream_deadline_s=900.0,
  liveness_timeout_s=600,
)
JOB = JobConfig(
  run=RunConfig(
    model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
    data=text_data.TextDataConfig(seq_len=L, batch_size=B),
    schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
    syncer=SyncerConfig(use_grace=False, min_quorum=1),
    service=SERVICE,
    num_learners=1,
    eval_batches=1,
  )
)


def test_the_learners_client_takes_the_services_deadline_and_chunk_bound():
  client = runtime.learner_client(JOB, "127.0.0.1:1", token="t")
  try:
    assert client.transfer_deadline_s == SERVICE.stream_deadline_s
    assert client.max_chunk_bytes == SERVICE.max_chunk_bytes
  finally:
    client.close()


def test_the_learners_client_pulls_over_the_bulk_port():
  factory = JOB.factory()
  svc = server_lib.make_syncer(
    fragment_keys=factory.layout.fragments,
    init_values=factory.global_init_values(),
    syncer_config=JOB.run.the_syncer(),
    service_config=SERVICE,
    layout_digest=factory.layout.digest,
  )
  srv = server_lib.serve(svc, token="t")
  client = runtime.learner_client(JOB, f"127.0.0.1:{srv.port}", token="t")
  try:
    client.register(0, layout_digest=factory.layout.digest, num_fragments=2)
    with svc.lock:
      values = svc.core.state(0).values
    lay = fragment_layouts([list(values)], values)[0]
    state = client.pull(
      0,
      0,
      -1,
      layout_keys=list(lay),
      shapes={k: s for k, (s, _) in lay.items()},
      dtypes={k: d for k, (_, d) in lay.items()},
    )
    assert state.version == 0
    assert srv.bulk.calls["Pull"] == 1
  finally:
    client.close()
    srv.stop(grace_s=0.5)
