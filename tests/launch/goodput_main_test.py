"""Tests for `ddiloco-goodput`: every shipped gin config runs (shrunk), and outputs are complete."""

import json
import pathlib
import subprocess
import sys

import pytest

from ddiloco.goodput import model as goodput_model
from ddiloco.goodput import report as goodput_report
from ddiloco.launch import configurables

pytestmark = pytest.mark.integration  # Runs the command in a child interpreter.

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_CONFIGS = sorted((_ROOT / "gin_configs" / "goodput").glob("*.gin"))
_TINY = ["--gin.goodput.GoodputStudy.chips=[8192, 16384]", "--gin.goodput.Fleet.horizon_hours=12"]
# Overrides that shrink each shipped config to a few seconds.
_SHRINK = {
  "paper_table.gin": _TINY,
  "heterogeneous.gin": _TINY,
  "scavenging.gin": [*_TINY, "--gin.goodput.Scavenging.start_hours=2"],
  "bandwidth.gin": [],
  "syncer_capacity.gin": [],
}


def _run(workdir: pathlib.Path, config: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
  cmd = [
    sys.executable,
    "-m",
    "ddiloco.launch.goodput_main",
    f"--workdir={workdir}",
    f"--gin_file={config}",
    *extra,
  ]
  return subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=180, check=False)


def test_every_config_is_covered():
  assert sorted(c.name for c in _CONFIGS) == sorted(_SHRINK)


@pytest.mark.parametrize("config", _CONFIGS, ids=lambda p: p.name)
def test_shipped_config_runs(config, tmp_path):
  proc = _run(tmp_path, config, *_SHRINK[config.name])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / "config.gin").stat().st_size > 0
  if config.name == "bandwidth.gin":
    out = json.loads((tmp_path / "bandwidth.json").read_text())
    # docs/algorithm.md §7: 104, 1.7 and 0.43 Gbit/s.
    assert round(out["data_parallel"]["gbps"]) == 104
    assert [round(d["gbps"], 2) for d in out["diloco"][:2]] == [1.67, 0.43]
    assert (tmp_path / "bandwidth.png").stat().st_size > 0
    return
  if config.name == "syncer_capacity.gin":
    out = json.loads((tmp_path / "capacity.json").read_text())
    fleets = {f["fleet"]: f for f in out["fleets"]}
    assert sorted(fleets) == ["2B, 8 learners", "5B, 8 learners", "9B, 8 learners"]
    # 8 learners · 2e9 bf16 values / 24 per 1 s step into one shard.
    assert round(fleets["2B, 8 learners"]["given"]["ingest_gbps"], 2) == 1.33
    assert "9B, 8 learners" in proc.stdout  # the printed table
    return
  records = json.loads((tmp_path / "goodput.json").read_text())
  config_text = (tmp_path / "config.gin").read_text()
  systems = {r["system"] for r in records}
  assert len(records) == 2 * len(systems)  # one record per system and chip count
  for r in records:
    assert {"system", "learners", "chips", "goodput", "uptime"} <= r.keys()
    assert r["chips"] in (8192, 16384)
    assert 0.0 < r["goodput"] <= 1.0 and 0.0 < r["uptime"] <= 1.0
  assert "horizon_hours = 12" in config_text
  assert (tmp_path / "goodput.png").stat().st_size > 0
  for name in systems:
    assert name in proc.stdout  # the printed table


def test_paper_config_matches_the_fitted_python_defaults():
  try:
    configurables.parse([str(_ROOT / "gin_configs" / "goodput" / "paper_table.gin")])
    study, bw, _ = configurables.configured(goodput_report.experiment)()
  finally:
    configurables.clear()
  assert bw is None
  assert study.fleet == goodput_model.Fleet()
  assert study.costs == goodput_model.Costs()
  assert study.systems == goodput_model.paper_systems()
  assert study.chips == goodput_model.PAPER_CHIPS


def test_missing_study_is_an_error(tmp_path):
  empty = tmp_path / "empty.gin"
  empty.write_text("goodput.GoodputStudy.seed = 1\n")
  proc = _run(tmp_path / "out", empty)
  assert proc.returncode != 0
  assert "goodput.experiment" in proc.stderr
