"""A real syncer and two learner processes on 127.0.0.1 .

Starts `ddiloco.launch.syncer_main` and two `ddiloco.launch.learner_main` subprocesses through
`LocalCluster` (what `ddiloco-local` runs), trains a few dozen steps and checks that merges happened,
every learner holds exactly the syncer's bits after every apply, and the global model's loss fell.
Every test tears its processes down in a `finally`, and checks that none is left.
"""

import os
import signal
import time

import pytest

from ddiloco.launch import local_cluster
from ddiloco.testing import runs

GIN = runs.config_path("local_tiny.gin")
FAST = runs.quick(steps=48)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _cluster(tmp_path, bindings, num_learners=2):
  args = runs.gin_args(GIN, bindings)
  return local_cluster.LocalCluster(workdir=str(tmp_path), gin_args=args, num_learners=num_learners)


def test_two_learners_merge_agree_and_learn(tmp_path):
  job = runs.parse_job(GIN, FAST)
  cluster = _cluster(tmp_path, FAST)
  try:
    summary = cluster.run(job, timeout_s=240, progress_every_s=5.0)
  finally:
    cluster.stop_all()
  runs.assert_all_gone(cluster)
  assert summary["merges"] > 0
  assert summary["digests_agree"] is True
  assert summary["digest_checks"] > 0
  assert summary["final_eval_loss"] < summary["initial_eval_loss"]
  assert summary["budget_reached"] is True
  assert summary["tokens_trained"] == 2 * 48 * job.run.tokens_per_step()
  assert set(summary["learners"]) == {"0", "1"}
  assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
  assert summary["syncer"]["uplink_codec"] == "int4"
  assert os.path.exists(os.path.join(tmp_path, "loss.png"))
  for i in ("0", "1"):
    assert summary["learners"][i]["steps"] == 48
    assert summary["learners"][i]["applies"] > 0


def test_stop_all_leaves_no_process_behind(tmp_path):
  cluster = _cluster(tmp_path, [*FAST, "STEPS = 100000"])
  try:
    cluster.start_syncer()
    cluster.start_learner(0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Until the learner trains (it logs every 8 steps).
      cluster.learners[0].poll_metrics()
      if cluster.learners[0].last:
        break
      time.sleep(0.5)
    assert cluster.learners[0].last, local_cluster.LocalCluster.tail(cluster.learners[0])
  finally:
    cluster.stop_all(grace_s=20)
  runs.assert_all_gone(cluster)
  # SIGTERM is a graceful stop: the learner left and wrote its summary, the syncer its own.
  assert os.path.exists(os.path.join(tmp_path, "learner_0", "summary.json"))
  assert os.path.exists(os.path.join(tmp_path, "syncer", "summary.json"))


def test_learner_failure_stops_everything(tmp_path):
  job = runs.parse_job(GIN, [*FAST, "STEPS = 100000"])
  cluster = _cluster(tmp_path, [*FAST, "STEPS = 100000"])
  cluster.extra_learner_args = ["--gin_bindings=RunConfig.steps_per_learner = 100000"]

  def kill_learner(line):
    child = cluster.learners.get(1)
    if child is not None and child.last:
      os.killpg(child.proc.pid, signal.SIGKILL)

  try:
    with pytest.raises(RuntimeError, match="learner 1 exited with -9"):
      cluster.run(job, timeout_s=240, progress_every_s=1.0, progress=kill_learner)
  finally:
    cluster.stop_all()
  runs.assert_all_gone(cluster)
