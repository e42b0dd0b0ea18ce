"""Smoke test of scripts/bench_learner_overhead.py: a tiny learner against two real syncer shards."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # Two shard processes and a learner's compile: about a minute on 2 cores.
@pytest.mark.timeout(600)
def test_a_learner_syncs_with_two_shards(tmp_path):
  out = tmp_path / "learner_sync.json"
  cmd = [
    sys.executable,
    str(_ROOT / "scripts" / "bench_learner_overhead.py"),
    "--size=tiny",
    "--devices=2",
    "--shards=2",
    "--steps=12",
    "--skip=16",
    "--rounds=1",
    "--bare=bare,bare_async",
    f"--json={out}",
  ]
  env = dict(os.environ, PYTHONPATH=str(_ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580, env=env, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(r"worker/bare +=", proc.stdout), proc.stdout
  assert "2 syncer shard(s)" in proc.stdout
  record = json.loads(out.read_text())
  assert record["partial"] is False
  assert record["config"]["shards"] == 2
  assert set(record["rates"]) == {"worker", "bare", "bare_async"}
  assert record["ratios"]["worker/bare"] > 0
  (window,) = record["windows"]
  assert {"syncer_cpu_0", "syncer_cpu_1"} <= set(window)
  (summary,) = record["summaries"]
  # Every slice's push reached its shard and merged: nothing refused, no digest mismatch.
  assert set(summary["push_status"]) == {"accepted"}
  assert summary["digest_mismatches"] == 0
  assert summary["applies"] > 0
