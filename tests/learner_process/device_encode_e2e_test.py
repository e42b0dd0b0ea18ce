"""A learner whose devices encode its answers' δ (`LearnerConfig.device_encode = "always"`, the
accelerators' default path forced on CPU), driven end to end through a real syncer: the training
loop, the senders, the link, the client and the data carrier, over every transport (the bulk port
over TCP and over TLS, and the in-process carrier), in the uplink codecs a run uses.

The syncer decodes what it receives: the answers are accepted and merged, and every adopted
version's digest agrees on both sides.

Model: one block, d=32, byte vocabulary; P = 2 fragments, H = 2; fp32 downlink.
"""

import dataclasses
import functools
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
from ddiloco.testing import runs
from ddiloco.transport.client import SyncerClient

pytestmark = pytest.mark.timeout(120)  # Threads (and sockets): a hang must fail the test.

L, B = 8, 8
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}


def _job(codec: str) -> JobConfig:
  return JobConfig(
    run=RunConfig(
      model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
      data=text_data.TextDataConfig(seq_len=L, batch_size=B),
      schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
      syncer=SyncerConfig(
        use_grace=False, min_quorum=1, outer_optimizer=lambda: optax.sgd(0.7), clock="slowest"
      ),
      learner=LearnerConfig(blocking=True, device_encode="always"),
      inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
      service=ServiceConfig(
        uplink_codec=codec,
        downlink_codec="fp32",
        heartbeat_interval_s=0.05,
        liveness_timeout_s=600,
      ),
      num_learners=1,
      eval_batches=1,
    )
  )


@pytest.fixture
def serve(tmp_path, request):
  """(transport) -> (the server, a client factory); everything stopped at the end."""
  stops = []

  def start(svc, transport):
    if transport == "in_process":
      srv = server_lib.serve_in_process(svc)
      stops.append(srv.stop)
      return srv, lambda: SyncerClient(channel=srv.channel(), deadline_s=10.0)
    tls, trust = None, None
    if transport == "tls":
      tls = runs.self_signed_certificate(str(tmp_path), san="IP:127.0.0.1")
      trust = tls[0]
    srv = server_lib.serve(svc, tls=tls)
    stops.append(functools.partial(srv.stop, grace_s=0.5))
    return srv, lambda: SyncerClient(f"127.0.0.1:{srv.port}", tls_ca_file=trust, deadline_s=10.0)

  yield start
  for stop in stops:
    stop()


TRANSPORTS = [
  "in_process",
  pytest.param("tcp", marks=pytest.mark.integration),
  pytest.param("tls", marks=pytest.mark.integration),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("codec", ["int4", "bf16"])
def test_device_encoded_answers_are_accepted_and_merged(
  tmp_path, monkeypatch, serve, transport, codec
):
  job = _job(codec)
  encoded = []
  encode_delta = snapshot.FragmentSnapshot.encode_delta

  def recording(self, codec, anchor, block_size):
    result = encode_delta(self, codec, anchor, block_size)
    encoded.append(None if result is None else result.codec)
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
  srv, connect = serve(svc, transport)
  client = connect()
  try:
    worker, writer = runtime.make_learner_worker(
      job, learner_id=0, client=client, workdir=str(tmp_path / "learner"), connect_timeout_s=30.0
    )
    assert worker.learner.device.device_encode  # Forced on, on CPU.
    worker.connect()
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
    assert encoded and encoded == [codec] * len(encoded), encoded  # All device-encoded.
    assert summary["push_status"].get("accepted", 0) == len(encoded), summary["push_status"]
    with svc.lock:
      merged = sum(svc.core.state(p).version for p in range(2))
    assert merged >= 2
    assert summary["digest_mismatches"] == 0
    if transport != "in_process":
      assert srv.bulk.calls["Push"] == len(encoded)
  finally:
    client.close()


def test_the_learner_config_refuses_an_unknown_mode():
  with pytest.raises(ValueError, match="device_encode must be one of"):
    LearnerConfig(device_encode="sometimes")
  assert dataclasses.replace(LearnerConfig(), device_encode="never").device_encode == "never"
