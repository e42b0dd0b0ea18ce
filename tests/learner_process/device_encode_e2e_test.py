"""A learner whose devices encode its answers' δ (`LearnerConfig.device_encode`), driven end to end
through a real syncer: the training loop, the senders, the link, the client and the bulk port, as
on a GPU or TPU.

On CPU the learner turns device encoding off (learner/learner.py); the test turns it back on, with
the snapshot an on-device copy (`snapshot_by_reference = False`, the accelerators' path), and
checks that the syncer accepts and merges the device-encoded answers.

Model: one block, d=32, byte vocabulary; P = 2 fragments, H = 2; int4 uplink, fp32 downlink.
"""

import threading

import optax
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import runtime
from ddiloco.launch.job import JobConfig
from ddiloco.learner import snapshot
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service import server as server_lib
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import SyncerConfig
from ddiloco.transport.client import SyncerClient

pytestmark = [
  pytest.mark.integration,
  pytest.mark.timeout(120),
]  # Sockets and threads: a hang must fail the test.

L, B = 8, 8
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}


def _job() -> JobConfig:
  return JobConfig(
    run=RunConfig(
      model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
      data=text_data.TextDataConfig(seq_len=L, batch_size=B),
      schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
      syncer=SyncerConfig(
        use_grace=False, min_quorum=1, outer_optimizer=lambda: optax.sgd(0.7), clock="slowest"
      ),
      learner=LearnerConfig(blocking=True, device_encode=True),
      inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
      service=ServiceConfig(
        uplink_codec="int4",
        downlink_codec="fp32",
        heartbeat_interval_s=0.05,
        liveness_timeout_s=600,
      ),
      num_learners=1,
      eval_batches=1,
    )
  )


def test_device_encoded_answers_are_accepted_and_merged(tmp_path, monkeypatch):
  job = _job()
  encoded = []
  encode_delta = snapshot.FragmentSnapshot.encode_delta

  def recording(self, codec, anchor, block_size):
    result = encode_delta(self, codec, anchor, block_size)
    encoded.append(result is not None)
    return result

  monkeypatch.setattr(snapshot.FragmentSnapshot, "encode_delta", recording)
  factory = job.factory()
  svc = server_lib.make_syncer(
    fragment_keys=factory.layout.fragments,
    init_values=factory.global_init_values(),
    syncer_config=job.run.the_syncer(),
    schedule=job.run.the_schedule(),
    service_config=job.run.the_service(),
    layout_digest=factory.layout.digest,
    embedding_keys=factory.embedding_keys(),
  )
  srv = server_lib.serve(svc)
  client = SyncerClient(f"127.0.0.1:{srv.port}")
  try:
    worker, writer = runtime.make_learner_worker(
      job, learner_id=0, client=client, workdir=str(tmp_path / "learner"), connect_timeout_s=30.0
    )
    learner = worker.learner
    assert not learner.device.device_encode  # CPU: off, whatever the config says.
    learner.device.snapshot_by_reference = False  # The accelerators' path: an on-device copy...
    learner.device.device_encode = True  # ... whose δ the devices encode.
    worker.connect()
    assert client.bulk_port == srv.bulk.port
    # A blocking learner waits for merges: answers the syncer never files would hold it forever.
    summaries = []
    run = threading.Thread(target=lambda: summaries.append(worker.run(8)), daemon=True)
    run.start()
    run.join(60)
    if run.is_alive():
      worker.request_stop()
      run.join(30)
    summary = summaries[0]
    assert summary["steps"] == 8  # Not stopped by the watchdog above.
    writer.close()
    assert encoded and all(encoded), encoded  # Every answer went device-encoded.
    assert summary["push_status"].get("accepted", 0) == len(encoded), summary["push_status"]
    with svc.lock:
      merged = sum(svc.core.state(p).version for p in range(2))
    assert merged >= 2
    assert summary["digest_mismatches"] == 0
    assert srv.bulk.calls["Push"] == len(encoded)
  finally:
    client.close()
    srv.stop(grace_s=0.5)
