"""The chaos driver on a syncer sharded over two processes: shard 1 alone is killed mid-run and
restarted; every invariant holds per shard and the restart loses no merge.

A few minutes on 2 loaded cores; in the e2e tier (`bash scripts/run_e2e_tests.sh`). It drives
`ddiloco.chaos.driver.ChaosRun` with gin_configs/chaos/sharded.gin.
"""

import itertools
import re

import pytest

from ddiloco.chaos.tape import read_tape
from ddiloco.testing import runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_a_shard_killed_alone_loses_no_merge_and_every_invariant_holds(tmp_path):
  run = runs.chaos_run(runs.config_path("chaos/sharded.gin"), str(tmp_path / "chaos"))
  cluster = run.cluster
  assert run.job.syncer_shards == 2 and run.chaos.syncer_kill_shards == (1,)
  run.run(timeout_s=800)
  runs.assert_all_gone(cluster)
  summary = run.summary()
  assert summary["ok"], summary["table"]
  names = {r["name"] for r in summary["invariants"]}
  assert {"max_merge_gap", "digests_agree", "ledger_balances", "monotonic_versions"} <= names
  tape = read_tape(run.tape_path)
  down = [r for r in tape if r["kind"] == "syncer_down"]
  assert [r["shard"] for r in down] == [1]  # Shard 1 alone went down, once.
  killed_at = down[0]["t"]
  back_at = next(r["t"] for r in tape if r["kind"] == "syncer_up" and r["t"] > killed_at)
  merges = {s: [r["t"] for r in tape if r["kind"] == "merge" and r["shard"] == s] for s in (0, 1)}
  assert any(t > back_at for t in merges[1])  # Shard 1 merged again after its restart,
  # and shard 0 merged on meanwhile, never stalled: its answers do not wait behind shard 1's
  # (the learners' senders back off per shard).
  during = [killed_at, *(t for t in merges[0] if killed_at < t < back_at), back_at]
  assert len(during) > 2 and max(b - a for a, b in itertools.pairwise(during)) < 5.0, during
  # Shard 1 was killed mid-run, after it had merged (its metrics lines of before the kill may have
  # died unflushed with it, so the restore says so): the restart had no checkpoint, took every
  # merge back from its version log, and lost none.
  restores = [r for r in tape if r["kind"] == "syncer_restore"]
  assert [r["shard"] for r in restores] == [1]
  assert restores[0]["from_log"] and restores[0]["lost_merges"] == 0
  assert {int(p) % 2 for p in restores[0]["from_log"]} == {1}  # Shard 1's own fragments.
  assert all(v[1] > v[0] for v in restores[0]["from_log"].values())  # Versions past the restored.
  assert summary["shards"][1]["merges_lost_at_restarts"] == [0]
  assert summary["shards"][0]["merges_lost_at_restarts"] == []
  assert summary["merges_lost_at_restarts"] == [0]
  assert all(s["merges"] > 0 for s in summary["shards"])
  assert summary["syncer_kills"] == 1 and summary["learner_kills"] >= 1
  # The learners reached each port of each shard through its proxy (the shard map held the
  # control proxies, each shard advertised its data proxy's port): each proxy's last log line has
  # its counters, and every push and pull crossed a data proxy.
  for name in ("proxy.log", "proxy_1.log", "proxy_bulk.log", "proxy_bulk_1.log"):
    stats = re.findall(r"connections=(\d+)", (tmp_path / "chaos" / name).read_text())
    assert stats and int(stats[-1]) > 0, name
  traffic = summary["proxy_traffic"]
  assert all(traffic[f"data_{s}"]["bytes_up"] > 0 for s in (0, 1)), traffic  # Pushes.
  assert all(traffic[f"data_{s}"]["bytes_down"] > 0 for s in (0, 1)), traffic  # Pulls.
