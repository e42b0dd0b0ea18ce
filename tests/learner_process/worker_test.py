"""Learner crash and rejoin against a real in-process syncer (docs/algorithm.md §3, §6), reached over
gRPC on port 0 and over the in-process transport: the same test, the same protocol.

Fault injection at (learner 0, step 7): the worker trains 7 steps, saving every 3 (steps 3 and 6),
then is abandoned: no flush, no final save, no Leave, as after a SIGKILL. A new worker with the same
id and checkpoint directory must resume at step 6 (the last save <= 7), train batch 7 again (the one
batch between the checkpoint and the crash), report with weight 0 for each fragment until it has
received it again, and hold the syncer's exact global fragments after `connect`.

Model: one block, d=32, byte vocabulary; P = 2 fragments, H = 2, τ = 1; batches of 8 x 8 tokens, so
a step trains 64 tokens (8 fake CPU devices: one sequence each). Lock-step pacing (the syncer opens
round (p, t) once the learner's heartbeat reports step t; the learner waits for it, and for its merge
τ steps after answering), so that the rounds a life of a few fast steps answers do not depend on
timing.
"""

import dataclasses
import functools
import json
import os
import threading
import time

import jax
import numpy as np
import optax
import pytest

from ddiloco.checkpoint.learner import LearnerCheckpointConfig
from ddiloco.checkpoint.learner_params import read_params
from ddiloco.data import text as text_data
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import runtime
from ddiloco.launch.job import JobConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.learner_process.worker import LearnerWorker
from ddiloco.models import configs
from ddiloco.protocol import FragmentState, RoundRequest
from ddiloco.run_config import RunConfig
from ddiloco.service import server as server_lib
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import Report, SyncerConfig
from ddiloco.transport.client import SyncerClient, fragment_layouts

pytestmark = pytest.mark.timeout(120)  # Sockets and threads: a hang must fail the test.

P, L, B = 2, 8, 8
TOKENS_PER_STEP = B * L  # 64
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}
JOB = JobConfig(
  run=RunConfig(
    model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
    data=text_data.TextDataConfig(seq_len=L, batch_size=B),
    schedule=FragmentSchedule(num_fragments=P, period=2, overlap=1),
    syncer=SyncerConfig(
      use_grace=False, keep_versions=9, outer_optimizer=lambda: optax.sgd(0.7), clock="slowest"
    ),
    learner=LearnerConfig(blocking=True),
    inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
    service=ServiceConfig(
      uplink_codec="fp32", downlink_codec="fp32", heartbeat_interval_s=0.05, liveness_timeout_s=600
    ),
    num_learners=2,
    eval_batches=1,
  )
)


class _Recording:
  """The learner's grain shard, recording every batch it hands out (checkpointable like it)."""

  def __init__(self, learner_id: int):
    self._it = text_data.make_train_iterator(
      JOB.run.data, shard_index=learner_id % JOB.run.num_learners, num_shards=JOB.run.num_learners
    )
    self.batches: list[dict[str, np.ndarray]] = []

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._it)
    self.batches.append(batch)
    return batch

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state):
    self._it.set_state(state)


@pytest.fixture(params=[pytest.param("grpc", marks=pytest.mark.integration), "in_process"])
def syncer(request):
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
  if request.param == "grpc":
    srv = server_lib.serve(svc)
    yield svc, functools.partial(SyncerClient, f"127.0.0.1:{srv.port}")
    srv.stop(grace_s=0.5)
  else:
    srv = server_lib.serve_in_process(svc)
    yield svc, lambda **kw: SyncerClient(channel=srv.channel(), **kw)
    srv.stop()


def _worker(connect, tmp_path, learner_id=0, **checkpoint):
  checkpoint = {"directory": str(tmp_path / "ckpt"), "save_every_steps": 3, **checkpoint}
  client = connect(deadline_s=10.0)
  data = _Recording(learner_id)
  worker, writer = runtime.make_learner_worker(
    JOB,
    learner_id=learner_id,
    client=client,
    workdir=str(tmp_path / f"learner_{learner_id}"),
    connect_timeout_s=30.0,
    data=data,
    checkpoint=LearnerCheckpointConfig(**checkpoint),
  )
  return worker, data, writer, client


def _count(worker) -> int:
  return int(worker.learner.opt_state[1][2].count)  # optax schedule count = updates applied.


def _zero_weight_reports(svc) -> int:
  with svc.lock:
    return svc.core.stats()["zero_weight_reports"]


def _open_every_round(svc, client) -> list:
  """Moves the syncer's lock-step clock 2 steps on (a heartbeat): every fragment is due at one of
  them (H = 2), so each gets a round unless its previous one is still open. Returns them."""
  with svc.lock:
    step = svc.core.pacer.cadence_step() + 2
  client.heartbeat(0, step=step)
  deadline = time.monotonic() + 10.0
  while time.monotonic() < deadline:
    with svc.lock:
      opened = {r.fragment: r for r in svc.core.rounds.open_requests()}
    if len(opened) == P:
      return [opened[p] for p in range(P)]
    time.sleep(0.01)
  pytest.fail(f"the syncer opened rounds of {sorted(opened)} only")


def _close_rounds(svc, client, requests) -> None:
  """Another learner (id 1, then gone) answers the open rounds with weight > 0: they merge.

  A learner that joins with a round open answers it at once, with no step trained since it loaded
  the global model: weight 0, and a lone blocking learner would wait for that merge forever.
  """
  client.register(1, layout_digest=JOB.factory().layout.digest, num_fragments=P)
  with svc.lock:
    states = [svc.core.state(p) for p in range(P)]
  layouts = fragment_layouts(
    [list(st.values) for st in states], {k: v for st in states for k, v in st.values.items()}
  )
  for request in requests:
    p, lay = request.fragment, layouts[request.fragment]
    state = client.pull(
      1,
      p,
      -1,
      layout_keys=list(lay),
      shapes={k: v[0] for k, v in lay.items()},
      dtypes={k: v[1] for k, v in lay.items()},
    )
    assert state.version == request.base_version
    values = {k: v + np.asarray(0.01, v.dtype) for k, v in state.values.items()}
    report = Report(
      learner_id=1,
      fragment=p,
      values=values,
      tokens=TOKENS_PER_STEP,
      steps=1,
      anchor_version=state.version,
      step=request.round_step,
      round_step=request.round_step,
    )
    assert client.push(report, "fp32").round_version == request.base_version + 1
  deadline = time.monotonic() + 10.0
  while time.monotonic() < deadline:
    with svc.lock:
      if not svc.core.rounds.open_requests():
        break
    time.sleep(0.01)
  assert client.leave(1)
  with svc.lock:
    assert not svc.core.rounds.open_requests()


def _assert_same_batch(a, b):
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  np.testing.assert_array_equal(a["targets"], b["targets"])


def test_crash_at_step_7_resumes_at_6_with_weight_0_until_received(syncer, tmp_path):
  svc, connect = syncer
  a, a_data, a_writer, a_client = _worker(connect, tmp_path)
  a.connect()
  assert a.restored_from == "fresh"
  a.start()
  a.train(7)
  a.checkpointer.wait()  # The save of step 6 is on disk before the crash.
  a.abandon()  # Crash at (learner 0, step 7): no flush, no final save, no Leave.
  a_writer.close()
  a_client.close()
  assert a.checkpointer.saved_steps == [3, 6]
  assert len(a_data.batches) == 7

  b, b_data, b_writer, b_client = _worker(connect, tmp_path)
  assert b.restore() == "own:6"
  assert (b.learner.kernel.step, b.resumed_step, _count(b), b.loop.tokens_trained) == (
    6,
    6,
    6,
    6 * TOKENS_PER_STEP,
  )

  # Registered but nothing pulled yet: its answer to every fragment's open round weighs 0 (docs/algorithm.md
  # §3), so the rounds stay open.
  zero_before = _zero_weight_reports(svc)
  b.session.register()
  requests = _open_every_round(svc, b_client)
  for request in requests:
    b.learner.kernel.ask(request)
  assert b.learner.kernel.pending_rounds() == dict(enumerate(requests))
  for p in range(P):
    answer = b.learner.answer(p, host_copy=True)
    assert answer.round_step == requests[p].round_step
    result = b_client.push(answer.as_report(answer.theta()), "fp32")
    assert (result.status, result.weight) == ("accepted", 0.0)
    assert "has not received fragment" in result.reason
  assert _zero_weight_reports(svc) == zero_before + P
  _close_rounds(svc, b_client, requests)

  b.connect()  # Registers again, pulls every fragment; the restore is not repeated.
  assert b.learner.kernel.step == 6 and b.restored_from == "own:6"
  joined = _count(b)  # Its inner LR schedule continues from the fleet's step if that is further.
  with svc.lock:
    states = [svc.core.state(p) for p in range(P)]
  for p, state in enumerate(states):
    assert b.learner.kernel.anchor[p] == state.version
    assert b.learner.device.applied_digest[p] == state.digest  # Bit-identical global fragments.
  assert sum(s.version for s in states) > 0  # Learner 0's first life merged something.

  summary = b.run(11)  # Saves at 9, and at 11 when it stops (graceful).
  b_writer.close()
  b_client.close()
  _assert_same_batch(b_data.batches[0], a_data.batches[6])  # Batch 7 is trained again.
  assert len(b_data.batches) == 5  # Steps 7..11.
  assert summary["restored_from"] == "own:6" and summary["resumed_step"] == 6
  assert (summary["steps"], summary["tokens"]) == (11, 11 * TOKENS_PER_STEP)
  assert summary["checkpoint_steps"] == [9, 11]
  # After receiving, no answer weighs 0 any more. It joined at the fleet's step S (where the
  # heartbeat above moved the clock) and answered, waiting for each, a round at each of its
  # schedule steps S + 1 .. S + 4; the round of its last step only if it arrived in time.
  fleet = max(r.round_step for r in requests)
  answered = summary["push_status"].get("accepted", 0)
  assert summary["push_status"] == {"accepted": answered} and answered in (4, 5)
  assert answered <= summary["rounds_asked"] <= 5 and summary["blocked_s"] > 0
  assert summary["fleet_step"] >= fleet + 4
  assert summary["zero_weight_pushes"] == 0
  assert summary["digest_mismatches"] == 0  # At connect and at every apply.
  assert summary["applies"]
  assert _zero_weight_reports(svc) == zero_before + P
  with open(tmp_path / "learner_0" / "metrics.jsonl") as f:
    events = [json.loads(line) for line in f]
  restores = [(e["restored_from"], e["step"]) for e in events if e["kind"] == "restore"]
  assert restores == [("fresh", 0), ("own:6", 6)]
  connected = [e["fleet_step"] for e in events if e["kind"] == "connected"]
  assert len(connected) == 2 and joined == max(6, connected[1])
  saves = [e["step"] for e in events if e["kind"] == "checkpoint"]
  assert saves == [3, 6, 9, 11]

  # A graceful stop repeats nothing: the next life starts with the batch after step 11.
  c, c_data, c_writer, c_client = _worker(connect, tmp_path)
  assert c.restore() == "own:11"
  # The optimizer state of step 11 as saved: 5 updates after the schedule count b joined with.
  assert (c.learner.kernel.step, _count(c), c.loop.tokens_trained) == (
    11,
    joined + 5,
    11 * TOKENS_PER_STEP,
  )
  next(c_data)
  fresh = _Recording(0)
  for _ in range(12):
    next(fresh)
  _assert_same_batch(c_data.batches[0], fresh.batches[11])
  c.checkpointer.close()
  c_writer.close()
  c_client.close()


def test_a_learner_saves_its_theta_for_export_when_asked(syncer, tmp_path):
  _, connect = syncer
  a, _, a_writer, a_client = _worker(connect, tmp_path, save_every_steps=100, save_params=True)
  a.connect()
  a.start()
  a.train(4)
  assert a.save_checkpoint()  # As a graceful stop does.
  a.checkpointer.wait()
  theta = read_params(a.checkpointer.directory)
  assert (theta.learner_id, theta.step) == (0, 4)
  held = tree.flatten(jax.device_get(a.learner.params))
  assert theta.params.keys() == held.keys()
  for k, v in held.items():
    np.testing.assert_array_equal(theta.params[k], v, err_msg=k)
  a.abandon()
  a.checkpointer.close()
  a_writer.close()
  a_client.close()
  b, _, b_writer, b_client = _worker(connect, tmp_path, save_params=True)
  assert b.restore() == "own:4"  # The step and optimizer state, as without θ.
  b.checkpointer.close()
  b_writer.close()
  b_client.close()


def test_checkpointing_needs_a_checkpointable_iterator():
  with pytest.raises(ValueError, match="get_state/set_state"):
    LearnerWorker(
      learner=None,
      data=iter([]),
      client=None,
      layout_digest="",
      layouts=[],
      checkpointer=object(),
    )


def test_without_checkpointer_restore_is_fresh(syncer, tmp_path):
  _, connect = syncer
  client = connect()
  worker, writer = runtime.make_learner_worker(
    JOB, learner_id=1, client=client, workdir=str(tmp_path / "w")
  )
  assert worker.checkpointer is None
  assert worker.restore() == "fresh"
  assert worker.save_checkpoint() is False
  writer.close()
  client.close()
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_the_senders_come_from_the_job(syncer, tmp_path):
  _, connect = syncer
  client = connect()
  worker, writer = runtime.make_learner_worker(
    dataclasses.replace(JOB, senders=3), learner_id=1, client=client, workdir=str(tmp_path / "w")
  )
  assert worker.senders.count == 3
  writer.close()
  client.close()
  with pytest.raises(ValueError, match="senders=0"):
    dataclasses.replace(JOB, senders=0)


class _SlowStep:
  """A step's loss that is ready only when the test says so (`jax.block_until_ready` calls it)."""

  def __init__(self):
    self.done = threading.Event()

  def block_until_ready(self):
    self.done.wait(20)
    return self


def test_a_round_asked_while_a_step_runs_is_answered_before_the_step_ends(tmp_path):
  """docs/algorithm.md §3: the training thread answers at once, with θ of the last step, instead
  of waiting for the step in flight (which made the main job's answers late)."""

  class _NoSyncer:
    address = "nowhere"

  # Decoupled DiLoCo: never blocks.
  job = dataclasses.replace(JOB, run=dataclasses.replace(JOB.run, learner=LearnerConfig()))
  worker, writer = runtime.make_learner_worker(
    job, learner_id=0, client=_NoSyncer(), workdir=str(tmp_path / "w")
  )
  factory = JOB.factory()
  init = factory.global_init_values()
  learner = worker.learner
  learner.load_global([FragmentState(p, 0, factory.layout.select(init, p), "") for p in range(P)])
  batches = _Recording(0)
  learner.train_step(next(batches))
  theta = learner.device.read(1)
  learner.start_step(next(batches))
  step = _SlowStep()
  waiting = threading.Thread(target=worker.loop._await_step, args=(step,))
  waiting.start()
  try:
    deadline = time.monotonic() + 10
    while worker.loop._step_waiter is None and time.monotonic() < deadline:
      time.sleep(0.005)
    worker.inbox.requests.put((RoundRequest(1, 2, 0), time.monotonic()))
    worker.loop.poke()  # As the rounds thread does.
    while 1 not in worker.senders._jobs and time.monotonic() < deadline:
      time.sleep(0.005)
    assert waiting.is_alive()  # The step is still running...
    job = worker.senders._jobs[1]  # ... and the answer is queued for the sender.
    assert (job.answer.step, job.answer.round_step, job.answer.steps) == (1, 2, 1)
  finally:
    step.done.set()
    waiting.join(10)
  learner.end_step()
  assert learner.kernel.step == 2
  values = job.answer.theta()
  assert all(np.array_equal(values[k], theta[k]) for k in theta)
  worker.loop.close()
  writer.close()
