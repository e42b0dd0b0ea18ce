"""Tests of the compression study's pure pieces: codec entries, paired ratios, verdicts, the table."""

import math
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)  # The study helpers live with the experiments, out of the library.

from experiments.studylib import codec_study as cq  # noqa: E402

# t_{0.975, 2} = 4.302653; with s = 0.001 over 3 seeds the half-width is 4.302653 · 0.001 / √3.
HW_S1 = 4.302653 * 0.001 / math.sqrt(3)  # 0.00248414


def _bf16():
  return {0: 2.0, 1: 2.0, 2: 2.0}


def test_parse_codec_entries():
  assert cq.parse_codec("int4") == ("int4", "int4", None)
  assert cq.parse_codec("int4/bf16") == ("int4", "bf16", None)
  assert cq.parse_codec("int4@32") == ("int4", "int4", 32)
  assert cq.parse_codec("bf16/int4@128") == ("bf16", "int4", 128)
  with pytest.raises(ValueError, match="Unknown codec 'int2'"):
    cq.parse_codec("int2")
  with pytest.raises(ValueError, match="Unknown codec 'in4'"):
    cq.parse_codec("int4/in4")
  for bad in ("int4@0", "int4@x", "int4@-3"):
    with pytest.raises(ValueError, match="positive integer"):
      cq.parse_codec(bad)


def test_codec_system_bindings_in_order():
  s = cq.codec_system("int4/bf16@32", run_file="runs/sim_small.gin", bindings=["STEPS=96"])
  assert s.name == "int4/bf16@32"
  assert s.gin_files == ("runs/sim_small.gin",)
  assert s.all_bindings(5) == [
    "STEPS=96",
    "ServiceConfig.uplink_codec = 'int4'",
    "ServiceConfig.downlink_codec = 'bf16'",
    "ServiceConfig.block_size = 32",
    "RunConfig.seed = 5",
    "ClusterConfig.seed = 5",
    "TextDataConfig.seed = 5",
  ]
  # No block size binding unless asked: the run keeps ServiceConfig's.
  assert not any(
    "block" in b for b in cq.codec_system("bf16", run_file="r.gin", bindings=()).bindings
  )


def test_gin_relative(tmp_path):
  root = tmp_path / "gin_configs"
  assert cq.gin_relative(str(root / "runs" / "a.gin"), str(root)) == os.path.join("runs", "a.gin")
  outside = str(tmp_path / "elsewhere.gin")
  assert cq.gin_relative(outside, str(root)) == outside


def test_paired_ratio_by_hand_and_common_seeds_only():
  # Ratios 2.002 / 2, 2.004 / 2, 2.006 / 2 = 1.001, 1.002, 1.003 (seed 7 has no bf16 run):
  # mean 1.002, s = 0.001.
  r = cq.paired_ratio({0: 2.002, 1: 2.004, 2: 2.006, 7: 9.0}, _bf16())
  assert r.n == 3
  assert r.mean == pytest.approx(1.002, abs=1e-12)
  assert r.half_width == pytest.approx(HW_S1, abs=1e-8)


def test_verdicts():
  # [1.002 ± 0.00248] = [0.99952, 1.00448]: upper end <= 1.005.
  assert cq.verdict(cq.paired_ratio({0: 2.002, 1: 2.004, 2: 2.006}, _bf16())) == "met"
  # Ratios 1.010, 1.012, 1.014: s = 0.002, [1.012 ± 0.00497] = [1.00703, 1.01697]: lower > 1.005.
  assert cq.verdict(cq.paired_ratio({0: 2.020, 1: 2.024, 2: 2.028}, _bf16())) == "not met"
  # Ratios 1.004, 1.006, 1.008: [1.006 ± 0.00497] = [1.00103, 1.01097] straddles 1.005.
  inconclusive = cq.paired_ratio({0: 2.008, 1: 2.012, 2: 2.016}, _bf16())
  assert cq.verdict(inconclusive) == "inconclusive at 3 seeds"
  # Session 4's single seed (1.008) says nothing alone, and an empty pairing is "not run".
  assert cq.verdict(cq.paired_ratio({0: 2.5198}, {0: 2.4998})) == "inconclusive at 1 seed"
  assert cq.verdict(cq.paired_ratio({0: 2.5}, {1: 2.5})) == "not run"
  # The goal is a parameter: the same interval is met against 1.011.
  assert cq.verdict(inconclusive, goal=1.011) == "met"


def test_ratio_row_formats_the_interval():
  row = cq.ratio_row("int4 / bf16", {0: 2.002, 1: 2.004, 2: 2.006}, _bf16())
  # 1.002 ± 0.0025, interval 1.002 ∓ 0.00248414 = [0.99952, 1.00448].
  assert row == ["int4 / bf16", "1.0020 ± 0.0025", "[0.9995, 1.0045]", 3, "met"]
  assert cq.ratio_row("x", {0: 2.5}, {0: 2.5}) == [
    "x",
    "1.0000 (1 seed)",
    "–",
    1,
    "inconclusive at 1 seed",
  ]
  assert cq.ratio_row("x", {}, _bf16()) == ["x", "–", "–", 0, "not run"]


def _run(loss, merges=99, elapsed=300.0, agree=True):
  return {"final_eval_loss": loss, "merges": merges, "elapsed_s": elapsed, "digests_agree": agree}


def test_codec_row():
  runs = {1: _run(2.004, 98, 310.0), 0: _run(2.002, 99, 290.0)}
  # [2.002, 2.004]: mean 2.003, s = 0.0014142, t_{0.975, 1} = 12.706205, half-width
  # 12.706205 · 0.0014142 / √2 = 0.0127; rows in seed order; wall mean (290 + 310) / 2 = 300.
  assert cq.codec_row("int4", runs) == [
    "int4",
    "int4",
    "2.0030 ± 0.0127",
    2,
    "0: 2.0020, 1: 2.0040",
    "99 / 98",
    True,
    "300",
  ]
  row = cq.codec_row("int4/bf16@32", {0: _run(2.0, agree=False)})
  assert row[1] == "int4 up / bf16 down, blocks of 32"
  assert row[2:4] == ["2.0000 (1 seed)", 1] and row[6] is False
  assert cq.codec_row("int8", {}) == ["int8", "int8", "not run", 0, "–", "–", "–", "–"]


def test_report_markdown_rows_and_extra_entries():
  runs = {
    "bf16": {s: _run(v) for s, v in _bf16().items()},
    "int4": {0: _run(2.002), 1: _run(2.004), 2: _run(2.006)},
    "fp32": {},
    "int4/bf16": {0: _run(2.020), 1: _run(2.024), 2: _run(2.028)},
  }
  text = cq.report_markdown(runs, command="python x.py", setup="Setup line.")
  assert "| int4 / bf16 | 1.0020 ± 0.0025 | [0.9995, 1.0045] | 3 | met |" in text
  assert "| bf16 / fp32 | – | – | 0 | not run |" in text
  # The one-direction entry is compared with bf16 too; int8 has no runs, so no int8 ratio rows.
  assert "| int4/bf16 / bf16 | 1.0120 ± 0.0050 | [1.0070, 1.0170] | 3 | not met |" in text
  assert "int8 / bf16" not in text
  assert "| fp32 | fp32 | not run | 0 |" in text
  assert "    python x.py" in text and "Setup line." in text
  assert text.endswith("![eval loss per codec](compression.png)")  # No history on the page.


def test_plan_for_tiers():
  specs = ["fp32", "bf16", "int8", "int4", "int4/bf16"]
  assert cq.plan_for(specs, "headline") == ["bf16", "int4"]
  assert cq.plan_for(specs, "quick") == ["bf16", "int4"]
  assert cq.plan_for(specs, "extra") == ["fp32", "int8"]
  assert cq.plan_for(specs, "all") == ["bf16", "int4", "fp32", "int8", "int4/bf16"]
  assert cq.plan_for(specs, "report") == []
  # Only what --codecs lists.
  assert cq.plan_for(["int4"], "all") == ["int4"]


def test_ratio_figure_shows_only_pairs_with_runs():
  import matplotlib.pyplot as plt

  loss = {"bf16": _bf16(), "int4": {0: 2.002, 1: 2.004, 2: 2.006}, "fp32": {}}
  fig = cq.ratio_figure(loss)
  left, right = fig.axes
  assert [t.get_text() for t in left.get_xticklabels()] == ["bf16", "int4", "fp32"]
  # fp32 has no runs, so of RATIOS only int4 / bf16 is drawn.
  assert [t.get_text() for t in right.get_xticklabels()] == ["int4/bf16"]
  plt.close(fig)
