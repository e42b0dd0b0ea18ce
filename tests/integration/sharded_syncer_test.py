"""A syncer sharded over two processes under `LocalCluster` (what `ddiloco-local
--gin.JobConfig.syncer_shards=2` runs): both shards merge and every learner holds each shard's
exact bits; a shard SIGKILLed mid-run restarts alone while the other keeps merging, and takes the
versions the kill lost back from the learners (no merge lost)."""

import json
import os

import pytest

from ddiloco.launch import local_cluster
from ddiloco.testing import runs
from ddiloco.transport.client import SyncerClient

GIN = runs.config_path("local_tiny.gin")

pytestmark = [pytest.mark.timeout(600), pytest.mark.e2e]


def _run(tmp_path, bindings, progress=None, timeout_s=420):
  job = runs.parse_job(GIN, bindings)
  cluster = local_cluster.LocalCluster(
    workdir=str(tmp_path), gin_args=runs.gin_args(GIN, bindings), num_learners=2
  )
  try:
    summary = cluster.run(
      job, timeout_s=timeout_s, progress_every_s=1.0, progress=progress and progress(cluster)
    )
  finally:
    cluster.stop_all()
  runs.assert_all_gone(cluster)
  return job, summary


def _shard_summary(tmp_path, shard):
  folder = "syncer" if shard == 0 else f"syncer_{shard}"
  with open(os.path.join(tmp_path, folder, "summary.json")) as f:
    return json.load(f)


def test_two_shards_merge_and_digests_agree(tmp_path):
  job, summary = _run(tmp_path, runs.quick(steps=48, more=["JobConfig.syncer_shards = 2"]))
  assert summary["ok"] is True, summary
  assert summary["digests_agree"] is True and summary["digest_checks"] > 0
  assert summary["final_eval_loss"] < summary["initial_eval_loss"]
  assert len(summary["shards"]) == 2
  for shard, s in enumerate(summary["shards"]):
    assert s["merges"] > 0 and s["digests_agree"] and s["ledger_balanced"], s
    own = _shard_summary(tmp_path, shard)
    schedule = job.run.the_schedule()
    assert own["owned"] == list(range(shard, schedule.total_fragments, 2))
    assert {int(k.split(":")[0]) % 2 for k in own["digests"]} == {shard}
    # Every shard merged a slice of every group (fragment f is slice f mod 2 of group f // 2).
    merged = {int(k.split(":")[0]) for k in own["digests"] if int(k.split(":")[1]) > 0}
    assert {schedule.group(f) for f in merged} == set(range(schedule.num_fragments))
  assert summary["merges"] == sum(s["merges"] for s in summary["shards"])


class _KillShard:
  """A progress hook: SIGKILLs shard 1 once it has merged, restarts it at once on its port,
  records shard 0's merges meanwhile, and once the restarted shard merged again stops the learners
  (SIGTERM: each saves, leaves and writes its summary), which ends the run whatever the pace."""

  def __init__(self, cluster):
    self.cluster = cluster
    self.killed_at = None  # (shard 0's merges, shard 1's versions) at the kill.
    self.back_at = None  # Shard 0's merges when shard 1 serves again.
    self.stopped = False

  def _status(self, shard):
    port = self.cluster.shard_ports[shard]
    client = SyncerClient(f"127.0.0.1:{port}", token=self.cluster.token, deadline_s=2.0)
    try:
      return client.status()
    finally:
      client.close()

  def __call__(self, line):
    del line
    import grpc

    try:
      if self.killed_at is None:
        one = self._status(1)
        if one.merges >= 6:
          zero = self._status(0).merges
          self.cluster.kill(self.cluster.shards[1])
          self.killed_at = (zero, list(one.versions))
          self.cluster.spawn_syncer(shard=1)
      elif self.back_at is None:
        if self.cluster.syncer_ready(1):
          self.back_at = self._status(0).merges
      elif not self.stopped and self._status(1).merges >= 6:
        for i in list(self.cluster.learners):
          self.cluster.fleet.begin_remove(i)
        self.stopped = True
    except grpc.RpcError:
      pass


def test_a_killed_shard_restarts_alone_and_loses_no_merge(tmp_path):
  hooks = []

  def progress(cluster):
    hooks.append(_KillShard(cluster))
    return hooks[0]

  bindings = runs.quick(
    steps=100000,  # Until the hook stops the learners.
    more=[
      "JobConfig.syncer_shards = 2",
      # No version log and no checkpoint before the kill: the learners must hand back every
      # version the kill lost, through their client of the restarted shard.
      "SyncerCheckpointConfig.version_log = False",
      "SyncerCheckpointConfig.every_s = 3600.0",
      "SyncerCheckpointConfig.recovery_window_s = 60.0",
    ],
  )
  _, summary = _run(tmp_path, bindings, progress)
  hook = hooks[0]
  assert hook.killed_at is not None and hook.back_at is not None and hook.stopped
  # Shard 0 kept merging while shard 1 was down and restarting.
  assert hook.back_at > hook.killed_at[0]
  restarted = _shard_summary(tmp_path, 1)
  assert restarted["restored"] is not None and restarted["restored"]["lost_merges"] > 0
  # Every version the kill lost was handed back by a learner: none republished, none lost.
  assert restarted["recovery"]["republished"] == [] and restarted["recovery"]["waiting"] == []
  assert restarted["recovery"]["recovered"]
  assert restarted["restored"]["republished"] == {}
  before = hook.killed_at[1]
  after = restarted["stats"]["versions"]
  assert all(after[p] >= before[p] for p in range(1, len(before), 2))
  assert summary["digests_agree"] is True and summary["digest_checks"] > 0
  assert [s["digests_agree"] for s in summary["shards"]] == [True, True]
  assert [s["restarted"] for s in summary["shards"]] == [False, True]
  assert all(s["ledger_balanced"] for s in summary["shards"])
  assert summary["final_eval_loss"] < summary["initial_eval_loss"]
