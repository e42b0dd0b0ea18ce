"""Tests of ddiloco.launch.runtime.SyncerRun's durability: journal before serving, halt, restart.

Fault injection: the merge journal's fsync raises ENOSPC at the third merge. The run must halt
(its loop returns), never serve nor checkpoint that version, write its summary, and a restart in the
same workdir must serve no fragment at a version below one served before.

Model: the tiny one-block transformer of tests/learner_process/worker_test.py; P = 2 fragments, K = 1, no
grace, so an answer filed in an open round merges at the merge thread's next poll.
"""

import dataclasses
import errno
import os
import threading
import time

import grpc
import numpy as np
import pytest

from ddiloco.checkpoint import journal as journal_lib
from ddiloco.checkpoint import syncer as ckpt_lib
from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import runtime
from ddiloco.launch.job import JobConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.metrics.writer import read_events, read_scalars
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import Report, SyncerConfig
from ddiloco.transport.client import SyncerClient

pytestmark = [
  pytest.mark.integration,
  pytest.mark.timeout(120),
]  # Sockets and threads: a hang must fail the test.

L, B = 8, 8
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}
JOB = JobConfig(
  run=RunConfig(
    model=configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK),
    data=text_data.TextDataConfig(seq_len=L, batch_size=B),
    schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
    syncer=SyncerConfig(use_grace=False, min_quorum=1),
    service=ServiceConfig(uplink_codec="fp32", downlink_codec="fp32", liveness_timeout_s=600),
    num_learners=1,
    eval_batches=1,
  )
)
# Saved only when the test says. Without the version log, so that the fallbacks (learners' hand-back,
# republishing) are what a restart uses; `test_a_restart_takes_lost_versions_back_from_its_log`
# turns it on.
CHECKPOINT = ckpt_lib.SyncerCheckpointConfig(every_s=3600.0, version_log=False)


def _merge(run: runtime.SyncerRun, p: int, step: int) -> None:
  """Learner 0 answers a new round of p; the merge thread merges it (K = 1, no grace)."""
  svc = run.service
  with svc.lock:
    if 0 not in svc.core.alive():
      svc.core.register(0)
    svc.core.mark_delivered(0, p, svc.core.version(p))
    request = svc.core.open_round(p, step)
    values = {k: v + np.float32(0.01) for k, v in svc.core.state(p).values.items()}
    report = Report(
      learner_id=0,
      fragment=p,
      values=values,
      tokens=64,
      steps=4,
      anchor_version=request.base_version,
      step=step + 1,
      round_step=step,
    )
    assert svc.core.report(report).status == "accepted"
    svc.lock.notify_all()
  deadline = time.monotonic() + 20
  while svc.core.version(p) == request.base_version:
    assert time.monotonic() < deadline, "the merge thread did not merge"
    time.sleep(0.01)


def test_the_syncer_paces_rounds_by_the_jobs_schedule(tmp_path):
  # H = 6 with P = 2, τ = 3: the syncer's step clock and its grace window use the job's schedule
  # (they once used P = H = the number of fragments), and learners are told its τ at Register.
  schedule = FragmentSchedule(num_fragments=2, period=6, overlap=3)
  job = dataclasses.replace(JOB, run=dataclasses.replace(JOB.run, schedule=schedule))
  run = runtime.SyncerRun(job, workdir=str(tmp_path / "syncer"), checkpoint=CHECKPOINT)
  run.serve("127.0.0.1:0")
  client = SyncerClient(f"127.0.0.1:{run.server.port}")
  try:
    assert run.service.core.schedule == job.run.the_schedule()
    layout = job.factory().layout
    resp = client.register(0, layout_digest=layout.digest, num_fragments=2)
    assert resp.overlap == 3
  finally:
    client.close()
    run.server.stop(flush=False)
    run._checkpointer.close()
    run._journal.close()


def test_a_full_disk_halts_the_syncer_and_a_restart_never_goes_back(tmp_path, monkeypatch):
  workdir = str(tmp_path / "syncer")
  run = runtime.SyncerRun(JOB, workdir=workdir, checkpoint=CHECKPOINT)
  run.serve("127.0.0.1:0")
  try:
    _merge(run, 0, 1)
    assert run.save_checkpoint(wait=True)  # Step 1: fragment 0 at version 1.
    _merge(run, 1, 2)  # Journaled, not checkpointed.
    published = run.service.published_digests()
    assert run.service.served_versions() == [1, 1]

    def no_space(fd):
      raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_lib.os, "fsync", no_space)
    _merge(run, 0, 3)
    monkeypatch.undo()
    stop = threading.Event()
    run.loop(stop, until=time.monotonic() + 60)  # Returns at once: the service halted.
    assert not stop.is_set()
    assert run.service.served_versions() == [1, 1]
    assert not run.save_checkpoint()  # Version 2 of fragment 0 was never served: never saved.
  finally:
    summary = run.shutdown()
  assert "No space left on device" in summary["halted"]
  assert summary["checkpoints_saved"] == 1
  assert summary["merges"] == 2 and "0:2" not in summary["digests"]

  # No waiting for learners to hand lost versions back: the restore republishes at once.
  at_once = dataclasses.replace(CHECKPOINT, recovery_window_s=0.0)
  restarted = runtime.SyncerRun(JOB, workdir=workdir, checkpoint=at_once)
  info = restarted.restored
  assert info.step == 1
  versions = restarted.service.served_versions()
  for (p, v), digest in published.items():
    assert versions[p] >= v
    if versions[p] == v:
      assert restarted.service.published_digests()[(p, v)] == digest
  # Fragment 1's version 1 (after the checkpoint) is lost: published again past it. Fragment 0's
  # version 2 reached the journal file before its fsync failed: it is skipped too.
  assert info.republished == {0: (1, 2, 3), 1: (0, 1, 2)}
  assert versions == [3, 2]
  restarted.shutdown()


def _kill(run: runtime.SyncerRun) -> None:
  """Stops a run as a kill would: no flush, no final checkpoint."""
  run.server.stop(flush=False)
  run._checkpointer.close()
  run._journal.close()


def test_a_restart_takes_lost_versions_back_from_a_learner(tmp_path):
  """Merges after the last checkpoint are not lost: a learner holding them hands them back."""
  workdir = str(tmp_path / "syncer")
  run = runtime.SyncerRun(JOB, workdir=workdir, checkpoint=CHECKPOINT)
  run.serve("127.0.0.1:0")
  try:
    _merge(run, 0, 1)
    assert run.save_checkpoint(wait=True)  # Step 1: fragment 0 at version 1.
    _merge(run, 1, 2)  # Journaled, not checkpointed: lost to a kill.
    _merge(run, 0, 3)
    held = {p: run.service.core.state(p) for p in range(2)}  # What the learner holds.
  finally:
    _kill(run)
  assert [held[p].version for p in range(2)] == [2, 1]

  restarted = runtime.SyncerRun(
    JOB, workdir=workdir, checkpoint=dataclasses.replace(CHECKPOINT, recovery_window_s=60.0)
  )
  server = restarted.serve("127.0.0.1:0")
  client = SyncerClient(f"127.0.0.1:{server.port}")
  try:
    assert restarted.restored.to_recover.keys() == {0, 1}
    assert restarted.service.served_versions() == [1, 0]  # The checkpoint's, until handed back.
    # A learner holding a different copy of version 2 of fragment 0 is not asked for it.
    resp = client.register(
      0,
      layout_digest=restarted.layout.digest,
      num_fragments=2,
      held={0: (2, "0" * 32), 1: (0, held[1].digest)},
    )
    assert list(resp.recover) == []
    resp = client.register(
      0,
      layout_digest=restarted.layout.digest,
      num_fragments=2,
      held={p: (st.version, st.digest) for p, st in held.items()},
    )
    assert list(resp.recover) == [0, 1]
    # Tampered values are refused (their digest is not the journal's); the true ones are taken.
    bad = {k: v + np.float32(1.0) for k, v in held[0].values.items()}
    with pytest.raises(grpc.RpcError) as e:
      client.recover(0, 0, 2, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for p in (0, 1):
      assert client.recover(0, p, held[p].version, held[p].values).adopted
    assert not client.recover(0, 0, 2, held[0].values).adopted  # Taken already.
    assert restarted.service.served_versions() == [2, 1]
    for p in (0, 1):
      assert restarted.service.core.state(p).digest == held[p].digest
    assert restarted.service.recovery() == {"waiting": [], "recovered": [0, 1], "republished": []}
    # Rounds of both fragments open again, and the next merge continues from the handed-back version.
    _merge(restarted, 0, 10)
    assert restarted.service.served_versions()[0] == 3
  finally:
    client.close()
    summary = restarted.shutdown()
  assert summary["recovery"]["recovered"] == [0, 1]


def test_a_restart_takes_lost_versions_back_from_its_log(tmp_path, monkeypatch):
  """With the version log, a kill loses no merge and the restart waits for no learner; a full disk
  under the log halts the syncer like one under the journal."""
  logged = dataclasses.replace(CHECKPOINT, version_log=True, recovery_window_s=60.0)
  workdir = str(tmp_path / "syncer")
  run = runtime.SyncerRun(JOB, workdir=workdir, checkpoint=logged)
  run.serve("127.0.0.1:0")
  try:
    _merge(run, 0, 1)
    assert run.save_checkpoint(wait=True)  # Step 1: fragment 0 at version 1.
    _merge(run, 1, 2)  # Journaled and logged, not checkpointed.
    _merge(run, 0, 3)
    served = {p: run.service.core.state(p) for p in range(2)}
  finally:
    _kill(run)

  restarted = runtime.SyncerRun(JOB, workdir=workdir, checkpoint=logged)
  restarted.serve("127.0.0.1:0")
  try:
    info = restarted.restored
    assert info.from_log == {0: (1, 2, 1), 1: (0, 1, 1)}
    assert info.lost_merges == 0 and info.to_recover == {} and info.republished == {}
    assert restarted.service.served_versions() == [2, 1]  # At once: nothing to wait for.
    assert restarted.service.recovery() == {"waiting": [], "recovered": [], "republished": []}
    for p in (0, 1):
      assert restarted.service.core.state(p).digest == served[p].digest
    _merge(restarted, 0, 10)
    assert restarted.service.served_versions() == [3, 1]

    def no_space(fd):
      raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_lib.VersionLog, "write", lambda *a, **k: no_space(0))
    _merge(restarted, 0, 20)
    monkeypatch.undo()
    assert restarted.service.served_versions() == [3, 1]  # Not durable: never served.
  finally:
    summary = restarted.shutdown()
  assert "No space left on device" in summary["halted"]
  assert summary["version_log_bytes"] > 0
  assert ckpt_lib.read_journal(os.path.join(workdir, ckpt_lib.JOURNAL_NAME)) == {0: 3, 1: 1}


def test_a_restart_republishes_what_no_learner_hands_back(tmp_path):
  workdir = str(tmp_path / "syncer")
  run = runtime.SyncerRun(JOB, workdir=workdir, checkpoint=CHECKPOINT)
  run.serve("127.0.0.1:0")
  try:
    _merge(run, 0, 1)
    assert run.save_checkpoint(wait=True)
    _merge(run, 0, 2)
  finally:
    _kill(run)
  restarted = runtime.SyncerRun(
    JOB, workdir=workdir, checkpoint=dataclasses.replace(CHECKPOINT, recovery_window_s=2.0)
  )
  assert restarted.restored.to_recover.keys() == {0}
  time.sleep(2.5)  # A slow start (restore, compiles) must not eat the learners' window.
  restarted.serve("127.0.0.1:0")
  try:
    assert restarted.service.recovery()["waiting"] == [0]  # The window starts with serving.
    deadline = time.monotonic() + 20
    while restarted.service.recovery()["waiting"] and time.monotonic() < deadline:
      time.sleep(0.05)
    assert restarted.service.recovery()["republished"] == [0]
    assert restarted.service.served_versions() == [3, 0]  # Past the journal's version 2.
  finally:
    restarted.shutdown()
  assert ckpt_lib.read_journal(os.path.join(workdir, ckpt_lib.JOURNAL_NAME))[0] == 3


def test_syncer_and_learner_write_tensorboard_scalars_on_tokens(tmp_path):
  """A SyncerRun and one learner in this process: both workdirs hold TensorBoard runs whose scalars
  (loss, step rate, staleness; merges, quorum sizes, grace windows, late reports, bytes, eval) are
  against tokens, read back with TensorBoard's own reader; a second run gets its own folder. Their
  summaries split the answers' latency into its parts."""
  # Blocking, on the slowest learner's clock (as tests/learner_process/worker_test.py): every round merges.
  run_config = dataclasses.replace(
    JOB.run,
    log_every=2,
    syncer=SyncerConfig(use_grace=False, min_quorum=1, clock="slowest"),
    learner=LearnerConfig(blocking=True),
    service=dataclasses.replace(JOB.run.service, heartbeat_interval_s=0.05),
  )
  job = dataclasses.replace(JOB, run=run_config)
  run = runtime.SyncerRun(job, workdir=str(tmp_path / "syncer"))
  server = run.serve("127.0.0.1:0")
  client = SyncerClient(f"127.0.0.1:{server.port}", deadline_s=10.0)
  worker, writer = runtime.make_learner_worker(
    job, learner_id=0, client=client, workdir=str(tmp_path / "learner_0"), connect_timeout_s=30.0
  )
  try:
    worker.connect()
    summary = worker.run(8)
  finally:
    writer.close()
    client.close()
    syncer_summary = run.shutdown()
  learner = read_scalars(str(tmp_path / "learner_0"))
  tokens = summary["tokens"]
  assert tokens == 8 * B * L
  assert [x for x, _ in learner["learner_0/loss"]] == [2 * B * L, 4 * B * L, 6 * B * L, tokens]
  assert [x for x, _ in learner["steps/learner_0/loss"]] == [2, 4, 6, 8]
  for tag in ("step_rate", "staleness_steps", "late_reports", "bytes_up", "merged_fraction"):
    assert f"learner_0/{tag}" in learner, tag
  assert learner["learner_0/bytes_up"][-1][1] > 0 and learner["learner_0/bytes_down"][-1][1] > 0
  syncer = read_scalars(str(tmp_path / "syncer"))
  assert syncer_summary["merges"] > 0
  assert syncer["syncer/merges"][-1][1] == syncer_summary["merges"]
  assert {v for _, v in syncer["syncer/quorum_size"]} == {1.0}
  assert {"syncer/grace_window_s", "syncer/late_reports", "traffic/bytes_up"} <= set(syncer)
  evals = syncer["eval/loss"]
  assert len(evals) == 2 and evals[0][0] == 0  # Version 0 before any report; the final one.
  assert 0 < evals[-1][0] <= tokens  # The tokens the learner reported by then.
  assert evals[-1][1] == pytest.approx(syncer_summary["final_eval_loss"])
  # Where answers spent their time: the learner's split of `to_reply`, the syncer's of a push.
  latency = summary["answer_latency_s"]
  assert {"to_snapshot", "to_reply", "queued", "host_copy", "push"} <= set(latency)
  assert all(0 <= q["p50"] <= q["p90"] for q in latency.values())
  assert set(syncer_summary["push_latency_s"]) == {"read", "lock_wait", "file"}
  # The outer steps were compiled before serving (`SyncerRun.warm_up`).
  (warm,) = read_events(str(tmp_path / "syncer"), "warm_up")
  assert warm["seconds"] > 0
  again = runtime.SyncerRun(job, workdir=str(tmp_path / "syncer"))
  again.shutdown()
  assert sorted(os.listdir(tmp_path / "syncer" / "tb")) == ["run_000", "run_001"]
