"""`ddiloco-ray` with a sharded syncer (`JobConfig.syncer_shards = 2`) on a Ray instance started on
this machine: each shard is its own actor; shard 1's program is SIGKILLed mid-run and Ray restarts
it alone (it restores its checkpoint, journal and version log), while shard 0 and the learners go
on; every learner ends with each shard's bits and nothing is left running."""

import os
import re
import signal

import pytest

ray = pytest.importorskip("ray")

from ddiloco.launch import ray_cluster  # noqa: E402
from ddiloco.launch.ray_config import RayConfig  # noqa: E402
from ddiloco.testing import runs  # noqa: E402

GIN = runs.config_path("ray_tiny.gin")
BINDINGS = runs.quick(steps=100000, more=["JobConfig.syncer_shards = 2"])  # Until stopped.

pytestmark = [pytest.mark.timeout(420), pytest.mark.e2e]


def test_ray_restarts_one_shard_alone(tmp_path):
  job = runs.parse_job(GIN, BINDINGS)
  cluster = ray_cluster.make_cluster(
    workdir=str(tmp_path),
    gin_args=runs.gin_args(GIN, BINDINGS),
    num_learners=2,
    ray_config=RayConfig(local_num_cpus=4),
  )
  cluster.backend.connect()
  killed, seen = [], []  # Shard 0's merges at the kill; shard 1's merges as the lines show them.

  def kill_shard(line):
    merges = re.search(r"shards (\d+)\+(\d+|-)", line)
    shard = cluster.shards.get(1)
    if merges is None or shard is None:
      return
    seen.append(merges.group(2))
    if not killed and merges.group(2) != "-" and int(merges.group(2)) >= 4:
      killed.append(int(merges.group(1)))
      os.kill(shard.proc.pid, signal.SIGKILL)  # A crashed shard: Ray restarts its program.
    elif killed and "-" in seen and merges.group(2) != "-" and len(killed) == 1:
      killed.append(int(merges.group(1)))  # Shard 1 serves again: stop the learners gracefully.
      for i in list(cluster.learners):
        cluster.fleet.begin_remove(i)

  try:
    summary = cluster.run(job, timeout_s=360, progress_every_s=0.5, progress=kill_shard)
  finally:
    cluster.stop_all()
    cluster.backend.disconnect()
  assert not ray.is_initialized()
  assert runs.processes_mentioning(str(tmp_path)) == []
  assert len(killed) == 2 and killed[1] > killed[0]  # Shard 0 merged while shard 1 was down.
  restarts = [
    (e["program"], e["restarts"]) for e in summary["membership"] if e["event"] == "restart"
  ]
  assert restarts == [("syncer_1", 1)], restarts
  assert summary["digests_agree"] is True and summary["digest_checks"] > 0
  assert [s["restarted"] for s in summary["shards"]] == [False, True]
  assert all(s["digests_agree"] and s["ledger_balanced"] for s in summary["shards"])
  assert summary["shards"][1]["recovery"]["republished"] == []
  assert summary["final_eval_loss"] < summary["initial_eval_loss"]
  with open(os.path.join(tmp_path, "syncer_1", "log.txt")) as f:
    assert f.read().count("[ddiloco-ray] restarted") == 1
  with open(os.path.join(tmp_path, "syncer", "log.txt")) as f:
    assert "restarted" not in f.read()  # Shard 0 never stopped.
