"""The chaos smoke test: real processes, learner kills, a network drop, a syncer restart.

About two minutes here; in the e2e tier (`bash scripts/run_e2e_tests.sh`). It drives
`ddiloco.chaos.driver.ChaosRun` with gin_configs/chaos/smoke.gin and checks the invariants on the tape.
"""

import pytest

from ddiloco.testing import runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_chaos_smoke_keeps_every_invariant(tmp_path):
  run = runs.chaos_run(runs.config_path("chaos/smoke.gin"), str(tmp_path / "chaos"))
  cluster = run.cluster
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
  # The data plane went through its own proxy, with the same faults as the control plane's: every
  # push crossed it up and every pull down.
  traffic = summary["proxy_traffic"]
  assert set(traffic) == {"control_0", "data_0"}
  assert traffic["data_0"]["bytes_up"] > 0 and traffic["data_0"]["bytes_down"] > 0, traffic
