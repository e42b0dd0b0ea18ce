"""The chaos smoke test: real processes, learner kills, a network drop, a syncer restart.

Slow (about two minutes here): `bash scripts/run_slow_tests.sh` runs it. It drives
`ddiloco.launch.chaos.ChaosRun` with gin_configs/chaos/smoke.gin and checks the invariants on the tape.
"""

import os

import pytest

from ddiloco.launch import local_cluster

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GIN = os.path.join(ROOT, "gin_configs", "chaos", "smoke.gin")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_chaos_smoke_keeps_every_invariant(tmp_path):
  from ddiloco.chaos.schedule import ChaosConfig
  from ddiloco.launch import configurables
  from ddiloco.launch.chaos import ChaosRun
  from ddiloco.launch.job import JobConfig

  search = [os.path.join(ROOT, "gin_configs"), os.path.join(ROOT, "gin_configs", "chaos")]
  configurables.parse([GIN], search_paths=search)
  try:
    job = configurables.configured(JobConfig)()
    chaos = configurables.configured(ChaosConfig)()
  finally:
    configurables.clear()
  args = [
    f"--gin_file={GIN}",
    f"--gin_search_paths={os.path.join(ROOT, 'gin_configs')}",
  ]
  cluster = local_cluster.LocalCluster(
    workdir=str(tmp_path / "chaos"), gin_args=args, num_learners=job.run.num_learners
  )
  run = ChaosRun(job, chaos, cluster)
  run.run(timeout_s=800)
  summary = run.summary()
  for child in cluster.children():
    assert child.proc.poll() is not None
  assert summary["syncer_kills"] == 1
  assert summary["learner_kills"] >= 1
  names = {r["name"]: r for r in summary["invariants"]}
  assert set(names) == {
    "max_merge_gap",
    "monotonic_versions",
    "digests_agree",
    "ledger_balances",
    "training_finished",
    "faults_on_time",
  }
  assert summary["ok"], summary["table"]
  assert summary["merges"] > 0
  # Some work reached the global model, and not all of it (kills, τ overwrites, a restart).
  assert 0.0 < summary["merged_fraction"] < 1.0
  assert all(0.0 < s["goodput"] <= s["time_fraction"] for s in summary["learners"].values())
