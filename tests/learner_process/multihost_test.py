"""MultihostWorker in one process (it is then its own leader) against a real in-process syncer.

The two-process learner is tests/integration/multiprocess_learner_test.py (slow). Here: the gated
queues, the follower's client, the factory that initialises on this process's devices, and that the
shared-step worker trains, applies the syncer's exact bits and stops at a shared step.

Model: one block, d=32, byte vocabulary; P = 2 fragments, H = 2, τ = 1 (fragment 1 is due at odd
steps, fragment 0 at even ones); batches of 8 x 8 tokens.
"""

import dataclasses
import queue

import optax
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import learner_workers
from ddiloco.launch.job import JobConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.learner_process import multihost
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service import server as server_lib
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import SyncerConfig
from ddiloco.transport.client import SyncerClient

pytestmark = pytest.mark.timeout(120)  # Sockets and threads: a hang must fail the test.

L, B = 8, 8
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}
JOB = JobConfig(
  run=RunConfig(
    model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
    data=text_data.TextDataConfig(seq_len=L, batch_size=B),
    schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
    syncer=SyncerConfig(use_grace=False, outer_optimizer=lambda: optax.sgd(0.7)),
    inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
    service=ServiceConfig(
      uplink_codec="fp32", downlink_codec="fp32", heartbeat_interval_s=0.05, liveness_timeout_s=600
    ),
    num_learners=1,
    eval_batches=1,
  )
)


def test_gated_queue_hides_items_until_released():
  q = multihost._GatedQueue()
  q.put("a")
  q.put("b")
  with pytest.raises(queue.Empty):
    q.get_nowait()  # Put, not yet shared.
  taken = q.take_incoming()
  q.put("c")  # Arrives while "a", "b" are being shared: not released with them.
  q.release(taken)
  assert [q.get_nowait(), q.get_nowait()] == ["a", "b"]
  with pytest.raises(queue.Empty):
    q.get_nowait()
  assert q.take_incoming() == ["c"]


def test_followers_client_refuses_every_call():
  client = multihost.NoSyncer()
  assert (client.bytes_up, client.bytes_down) == (0, 0)
  with pytest.raises(RuntimeError, match="only process 0"):
    client.register(0)


@pytest.fixture
def syncer():
  factory = JOB.factory()
  svc = server_lib.make_syncer(
    fragment_keys=factory.layout.fragments,
    init_values=factory.global_init_values(),
    syncer_config=JOB.run.the_syncer(),
    schedule=JOB.run.the_schedule(),
    service_config=JOB.run.the_service(),
    layout_digest=factory.layout.digest,
    embedding_keys=factory.embedding_keys(),
  )
  srv = server_lib.serve(svc)
  yield svc, f"127.0.0.1:{srv.port}"
  srv.stop(grace_s=0.5)


def test_process_zero_needs_the_client(tmp_path):
  with pytest.raises(ValueError, match="only process 0"):
    learner_workers.make_multihost_worker(JOB, learner_id=0, client=None, workdir=str(tmp_path))


# Lock-step (the synchronous baselines' pacing): the syncer opens round (p, t) once the learner's
# heartbeat reports step t, and the learner waits for it, then at t + τ for its merge. So every
# step has its round and every merge is applied at the step after its answer, whatever the timing.
LOCK_STEP = dataclasses.replace(
  JOB,
  run=dataclasses.replace(
    JOB.run,
    syncer=dataclasses.replace(JOB.run.syncer, clock="slowest"),
    learner=LearnerConfig(blocking=True),
  ),
)


@pytest.mark.integration
def test_one_process_trains_applies_exact_bits_and_digests_params(tmp_path):
  factory = LOCK_STEP.factory()
  svc = server_lib.make_syncer(
    fragment_keys=factory.layout.fragments,
    init_values=factory.global_init_values(),
    syncer_config=LOCK_STEP.run.the_syncer(),
    schedule=LOCK_STEP.run.the_schedule(),
    service_config=LOCK_STEP.run.the_service(),
    layout_digest=factory.layout.digest,
    embedding_keys=factory.embedding_keys(),
  )
  srv = server_lib.serve(svc)
  try:
    client = SyncerClient(f"127.0.0.1:{srv.port}", deadline_s=10.0)
    worker, writer = learner_workers.make_multihost_worker(
      LOCK_STEP, learner_id=0, client=client, workdir=str(tmp_path), connect_timeout_s=30.0
    )
    worker.connect()
    summary = worker.run(12)
    writer.close()
    client.close()
  finally:
    srv.stop(grace_s=0.5)
  assert (summary["steps"], summary["process_index"], summary["num_processes"]) == (12, 0, 1)
  assert summary["tokens"] == 12 * B * L
  assert summary["digest_mismatches"] == 0
  # Before each of steps 2..12 the learner waited for round (p, t) of the step t it had reached,
  # answered it, and (from t = 2) for the merge of the round it answered at t - 1, which it
  # applied: fragment 1's versions 1..5 at steps 2, 4, .., 10 and fragment 0's at 3, 5, .., 11.
  # After step 12 it does not wait: it answers round (0, 12) and applies version 6 of fragment 1
  # only if they arrived by then.
  answered = summary["push_status"].get("accepted", 0)
  assert summary["push_status"] == {"accepted": answered} and answered in (11, 12)
  assert answered <= summary["rounds_asked"] <= 12 and summary["blocked_s"] > 0
  applied = [(p, version) for p, version, _ in summary["applies"]]
  assert applied[:10] == [(p, v) for v in range(1, 6) for p in (1, 0)]
  assert applied[10:] in ([], [(1, 6)])
  published = svc.published_digests()
  for p, version, digest in summary["applies"]:
    assert published[(p, version)] == digest
  expected = multihost.hashlib.sha256(
    ",".join(worker.learner.device.digest(p) for p in range(2)).encode()
  ).hexdigest()
  assert summary["params_digest"] == expected


@pytest.mark.integration
def test_a_stop_request_takes_effect_at_the_next_shared_step(syncer, tmp_path):
  _, address = syncer
  client = SyncerClient(address, deadline_s=10.0)
  worker, writer = learner_workers.make_multihost_worker(
    JOB, learner_id=0, client=client, workdir=str(tmp_path), connect_timeout_s=30.0
  )
  worker.connect()
  worker.request_stop()  # As SIGTERM would: nothing stops until the request is shared.
  assert not worker.stop_requested
  summary = worker.run(100)
  writer.close()
  client.close()
  # Shared at the first step's share (before step 1); the loop checks it after step 1.
  assert summary["steps"] == 1
