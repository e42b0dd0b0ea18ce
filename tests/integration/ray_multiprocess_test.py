"""`ddiloco-ray` with learners of two JAX processes each (a multi-host slice, here two actors in a
placement group on this machine): one process SIGKILLed mid-run takes its learner down, and the
launcher starts both of its processes again (a fresh reservation and coordinator). The learner
restores its own checkpoint and finishes; the other learner and the syncer never stop. Slow: four
jax.distributed processes on 2 cores."""

import json
import os
import signal

import pytest

ray = pytest.importorskip("ray")

from ddiloco.launch import ray_cluster  # noqa: E402
from ddiloco.launch.ray_config import RayConfig  # noqa: E402
from ddiloco.testing import runs  # noqa: E402

GIN = runs.config_path("ray_tiny.gin")
FAST = runs.quick(
  steps=64,
  more=["JobConfig.processes_per_learner = 2", "LearnerCheckpointConfig.save_every_steps = 8"],
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_a_multi_process_learner_restarts_as_a_whole(tmp_path):
  job = runs.parse_job(GIN, FAST)
  cluster = ray_cluster.make_cluster(
    workdir=str(tmp_path),
    gin_args=runs.gin_args(GIN, FAST),
    num_learners=2,
    processes_per_learner=2,
    ray_config=RayConfig(local_num_cpus=6),
  )
  cluster.backend.connect()
  session = ray._private.worker._global_node.get_session_dir_path()
  killed = {}

  def chaos(line):
    l1 = cluster.learners.get(1)
    if l1 is not None and not killed and l1.last.get("step", 0) >= 16:
      second = l1.proc.procs[1]
      if second.pid is not None:
        killed["pid"] = second.pid
        os.kill(second.pid, signal.SIGKILL)  # One host of the slice fails.

  try:
    summary = cluster.run(job, timeout_s=540, progress_every_s=1.0, progress=chaos)
  finally:
    cluster.stop_all()
    cluster.backend.disconnect()
  assert killed
  restarts = [e for e in summary["membership"] if e["event"] == "restart"]
  assert [(e["learner_id"], e["restarts"]) for e in restarts] == [(1, 1)], restarts
  assert summary["ok"] is True and summary["digests_agree"] is True
  for i in ("0", "1"):
    assert summary["learners"][i]["steps"] == 64
  with open(tmp_path / "learner_1" / "summary.json") as f:
    restored = json.load(f)["restored_from"]
  assert restored.startswith("own"), restored
  assert runs.processes_mentioning(str(tmp_path)) == []
  assert runs.processes_mentioning(session) == []
