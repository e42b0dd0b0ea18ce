"""Smoke test of scripts/bench_links.py: one codec unshaped and at one rate, 2 learners of 16 steps,
every figure present, and the namespaces gone after (and after `--cleanup`)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SCRIPT = str(_ROOT / "scripts" / "bench_links.py")


def _namespaces() -> str:
  return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@pytest.mark.e2e  # Two short runs of the main job, ~3 min on 2 cores.
@pytest.mark.timeout(900)
@pytest.mark.skipif(
  shutil.which("ip") is None or shutil.which("tc") is None or os.geteuid() != 0,
  reason="needs root, ip and tc",
)
def test_one_codec_unshaped_and_at_one_rate(tmp_path):
  out = tmp_path / "links.json"
  args = ["--rates_mbit=8", "--codecs=int4", "--steps=16", "--learners=2", "--timeout_s=400"]
  args += [f"--workdir={tmp_path / 'runs'}", f"--out={out}"]
  try:
    subprocess.run([sys.executable, _SCRIPT, *args], check=True, cwd=_ROOT, timeout=840)
  finally:
    subprocess.run([sys.executable, _SCRIPT, "--cleanup"], check=True, cwd=_ROOT, timeout=60)
  assert "ddl_" not in _namespaces()
  result = json.loads(out.read_text())
  assert {"commit", "date", "machine", "command"} <= result.keys()
  unshaped, shaped = result["rows"]
  assert (unshaped["link"], shaped["link"]) == ("unshaped", "8 Mbit/s")
  for row in (unshaped, shaped):
    for key in ("util_measured", "util_model", "control_p99_s", "merged_fraction", "mean_quorum"):
      assert row[key] is not None and row[key] >= 0, key
    assert row["digests_agree"] and row["merges"] > 0
  assert unshaped["util_measured"] == 1.0 and shaped["knee_mbit"] > 0
  assert abs(shaped["link_load"] - shaped["knee_mbit"] / 8) < 1e-3 and shaped["util_model"] == 1.0
  assert 0 < shaped["util_waiting_model"] <= 1
