"""Smoke test of scripts/bench_round_slices.py: a tiny group, one round of each shard count."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.integration  # Three shard processes in all, each a few seconds to start.
@pytest.mark.timeout(300)
def test_one_round_of_each_shard_count():
  cmd = [
    sys.executable,
    str(_ROOT / "scripts" / "bench_round_slices.py"),
    "--reps=1",
    "--learners=2",
    "--group_mib=0.25",
    "--leaves=2",
  ]
  env = dict(os.environ, PYTHONPATH=str(_ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(r"rep 0 S=2: round [\d.]+ s \(per shard [\d.]+ [\d.]+\)", proc.stdout)
  assert re.search(r"ratio S=2/S=1 [\d.]+", proc.stdout), proc.stdout
