"""Elastic scavenging, real processes (docs/algorithm.md §6): a learner joins a running job and leaves.

A `LocalCluster` runs a syncer and two learners (batch 8, one device each). While it runs, the
`ddiloco-fleet` command adds a third learner with another batch size (4) and device count (2); the
test waits until the syncer lists it alive and it trained a few fragment periods, removes it
through the same channel, and checks that it left the syncer's membership, that its pushes were
merged with weight > 0 (it had received the fragments at registration, docs/algorithm.md §3), and that the job
still finished ok with every join and leave in summary.json. No process is left behind.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddiloco.launch import fleet, local_cluster
from ddiloco.testing import runs

GIN = runs.config_path("local_tiny.gin")
FAST = runs.quick(steps=32)
SEQ_LEN = 64  # local_tiny.gin; the job's batch is 8.
ADDED_BATCH, ADDED_DEVICES = 4, 2
TRAINED_STEPS = 16  # The added learner's steps before it is removed (it logs every 8 steps).

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _fleet_cli(workdir, *args):
  """Runs `ddiloco-fleet --json` and returns its answer."""
  out = subprocess.run(
    [sys.executable, "-m", "ddiloco.launch.fleet_main", f"--workdir={workdir}", "--json", *args],
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  return json.loads(out.stdout)


def _wait(what, predicate, timeout_s=120.0):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(0.25)
  raise TimeoutError(f"timed out waiting for {what}")


def _drive(cluster, workdir, seen):
  """The operator: add a heterogeneous learner, watch it work, remove it (runs beside `run`)."""
  client = fleet.FleetClient(workdir, timeout_s=60, poll_s=0.1)
  launcher = os.path.join(fleet.control_dir(workdir), "launcher.json")
  try:
    _wait("the launcher", lambda: os.path.exists(launcher))
    seen["add"] = added = _fleet_cli(
      workdir, "add", f"--devices={ADDED_DEVICES}", f"--batch_size={ADDED_BATCH}", "--steps=100000"
    )
    i = added["learner_id"]
    with open(f"/proc/{cluster.learners[i].proc.pid}/environ", "rb") as f:
      seen["env"] = f.read().decode().split("\0")

    def trained():
      listed = client.list()
      me = next(m for m in listed["learners"] if m["learner_id"] == i)
      return (
        listed
        if i in (listed["syncer_alive"] or []) and (me["step"] or 0) >= TRAINED_STEPS
        else None
      )

    seen["before"] = _wait("the added learner to train", trained)
    seen["remove"] = client.remove(i, timeout_s=60)
  except Exception as e:  # Reported by the test; the scavenger must stop for the job to end.
    seen["error"] = repr(e)
    for child in list(cluster.learners.values())[2:]:  # Stop the scavenger so `run` returns.
      with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, signal.SIGTERM)


def test_add_and_remove_a_heterogeneous_learner(tmp_path):
  workdir = str(tmp_path)
  job = runs.parse_job(GIN, FAST)
  args = runs.gin_args(GIN, FAST)
  cluster = local_cluster.LocalCluster(workdir=workdir, gin_args=args, num_learners=2)
  seen = {}
  operator = threading.Thread(target=_drive, args=(cluster, workdir, seen), daemon=True)
  operator.start()
  try:
    summary = cluster.run(job, timeout_s=240, progress_every_s=5.0)
  finally:
    cluster.stop_all()
    operator.join(timeout=60)
  runs.assert_all_gone(cluster)
  assert "error" not in seen, seen["error"]

  # The new learner: id M = 2, its own devices and batch, data shard 2 mod M = 0.
  added = seen["add"]
  assert added == {**added, "learner_id": 2, "devices": 2, "batch_size": 4, "data_shard": 0}
  assert "--xla_force_host_platform_device_count=2" in " ".join(seen["env"])
  assert 2 in seen["before"]["syncer_alive"]

  # It left gracefully: SIGTERM, checkpoint, Leave, exit 0; the syncer no longer lists it.
  removed = seen["remove"]
  assert removed["graceful"] is True and removed["exit_code"] == 0 and removed["forced"] is False
  assert 2 not in removed["syncer_alive"]  # Asked right after it exited.
  assert removed["steps"] >= TRAINED_STEPS

  # Its pushes counted (weight > 0) and it received merged fragments.
  mine = summary["learners"]["2"]
  assert mine["steps"] == removed["steps"]
  assert mine["tokens"] == mine["steps"] * ADDED_BATCH * SEQ_LEN  # Half the job's batch.
  assert mine["push_status"]["accepted"] > mine["zero_weight_pushes"]
  assert mine["applies"] > 0
  with open(os.path.join(workdir, "syncer", "metrics.jsonl")) as f:
    merges = [e for e in map(json.loads, f) if e["kind"] == "merge"]
  weights = [w for e in merges for c, w in zip(e["contributors"], e["weights"]) if c == 2]
  assert weights and max(weights) > 0

  # The job finished ok; summary.json lists the joins and leaves.
  assert summary["ok"] is True and summary["digests_agree"] is True
  for i in ("0", "1"):
    assert summary["learners"][i]["steps"] == 32
    assert summary["learners"][i]["tokens"] == 32 * 8 * SEQ_LEN
  events = [(e["event"], e["learner_id"]) for e in summary["membership"]]
  assert events[:3] == [("join", 0), ("join", 1), ("join", 2)]
  assert sorted(events[3:]) == [("finish", 0), ("finish", 1), ("leave", 2)]
  join2 = summary["membership"][2]
  assert (join2["devices"], join2["batch_size"], join2["elastic"]) == (2, 4, True)
  leave2 = next(e for e in summary["membership"] if e["event"] == "leave")
  assert leave2["graceful"] is True and leave2["t"] > join2["t"]
  assert summary["syncer_alive_at_end"] == []
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["membership"] == summary["membership"]
