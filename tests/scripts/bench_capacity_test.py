"""Smoke test of scripts/bench_capacity.py: tiny shards and fleet, every figure present, no leftovers."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _processes_naming(text: str) -> list[int]:
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
          if text.encode() in f.read():
            pids.append(int(entry))
      except OSError:
        pass  # Gone meanwhile.
  return pids


@pytest.mark.e2e  # Two ramps of real shards, ~20 s; the test below runs the script too.
@pytest.mark.timeout(300)
def test_two_shard_counts_side_by_side(tmp_path):
  out = tmp_path / "capacity.json"
  cmd = [
    sys.executable,
    str(_ROOT / "scripts" / "bench_capacity.py"),
    "--shards=1,2",
    "--learners=2",
    "--fragments=4",
    "--fragment_mib=0.0625",
    "--ramp_gbps=0.001",
    "--window_s=1",
    "--windows=2",
    "--warmup_s=1",
    "--fleet_procs=1",
    f"--json={out}",
  ]
  env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(_ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ingest(S=2)/ingest(S=1) =" in proc.stdout
  assert not _processes_naming(str(tmp_path))  # Every shard and fleet process is gone.
  figures = json.loads(out.read_text())
  assert figures["complete"] and figures["date"] and "cpus" in figures["machine"]
  assert "dirty" in figures and "--shards=1,2" in figures["command"]
  # The machine's speed beside the figures: a copy's GB/s on every CPU, before and after.
  cpus = {str(c) for c in os.sched_getaffinity(0)}
  for when in ("before", "after"):
    assert set(figures["memcpy_gbps"][when]) == cpus
    assert all(g > 0 for g in figures["memcpy_gbps"][when].values())
  runs = {r["shards"]: r for r in figures["runs"]}
  assert sorted(runs) == [1, 2]
  for s, run in runs.items():
    (level,) = run["levels"]
    assert len(level["shards"]) == s
    assert level["offered_gbps"] == pytest.approx(0.001, rel=1e-6)
    assert len(level["windows"]) == 2  # Medians over two windows, each with its own figures.
    assert 0 <= level["kept_windows"] <= 2
    lo, hi = level["gbps_range"]
    assert lo <= level["gbps"] <= hi
    assert all(n > 0 for n in level["bulk_pushes"])  # The fleet pushed over the bulk port.
    assert len(level["overrun_rounds"]) == len(level["clock_lag_steps"]) == s
    for shard in level["shards"]:
      assert shard["merges"] > 0 and shard["fragments_per_s"] > 0
      # Pushed over the bulk port (the default fleet wire), every answer filed.
      assert shard["push_status"].get("accepted", 0) > 0
      assert set(shard["push_status"]) == {"accepted"}
      assert shard["rss_mib"] > 0 and shard["cores"] >= 0
    assert run["per_core"]["shard_gbps_per_core"] > 0
  assert "ratio" in figures and len(figures["cpu_bound_gbps"]) == 2


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_sendfile_fleet_and_round_timeline(tmp_path):
  """The fleet's sendfile pushes are the same bytes (every answer filed), and `--timeline` gives
  each merged round's phases in order; with `--slices` each shard takes a slice of every round."""
  out = tmp_path / "capacity.json"
  cmd = [
    sys.executable,
    str(_ROOT / "scripts" / "bench_capacity.py"),
    "--shards=2",
    "--learners=2",
    "--fragments=4",
    "--fragment_mib=1",
    "--ramp_gbps=0.0025",
    "--ramp_per_shard",
    "--slices",
    "--window_s=2",
    "--windows=1",
    "--warmup_s=1",
    "--fleet_procs=1",
    "--fleet_send=sendfile",
    "--timeline",
    f"--json={out}",
  ]
  env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(_ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "median ms: last_asked=" in proc.stdout
  assert not _processes_naming(str(tmp_path))
  figures = json.loads(out.read_text())
  assert figures["complete"]
  (run,) = figures["runs"]
  (level,) = run["levels"]
  assert level["point"]["slices"] == 2 and level["point"]["fragments"] == 4
  assert level["offered_gbps"] == pytest.approx(0.005, rel=1e-6)  # 0.0025 per shard.
  # Each step's group has a slice on each shard: both open rounds and merge them.
  assert all(s["opened_rounds"] > 0 and s["merges"] > 0 for s in level["shards"])
  rows = []
  for shard in level["windows"][0]["shards"]:
    assert set(shard["push_status"]) == {"accepted"}
    rows += shard["timeline"]
  assert rows
  for r in rows:
    assert r["answers"] == 2
    assert 0 <= r["first_filed"] <= r["last_filed"] <= r["merge_start"] < r["published"]
    assert r["merge"] > 0 and 0 <= r["adopt"] <= r["merge"] and r["round_cpu"] > 0
