"""Tests for the goodput table's wording (ddiloco.goodput.report)."""

from ddiloco.goodput import fleet as goodput
from ddiloco.goodput import model as goodput_model
from ddiloco.goodput import report as goodput_report


def _result(system: str, chips: int, g: float, up: float) -> goodput.Result:
  return goodput.Result(
    system=system,
    learners=1,
    chips=chips,
    goodput=g,
    uptime=up,
    useful_chip_hours=1e6,
    failures=0,
    reconfigurations=0,
  )


def test_table_header_says_what_the_brackets_hold():
  name, _, row = goodput_model.PAPER_GOODPUT[0]
  chips = goodput_model.PAPER_CHIPS[0]
  results = [_result(name, chips, 0.5, 0.75), _result("not-in-paper", chips, 0.25, 0.5)]
  plain = goodput_report.format_table(results).splitlines()
  assert plain[0].startswith("goodput % (uptime %)")
  assert "50.0 ( 75.0)" in plain[1]
  paper = goodput_report.format_table(results, compare_with_paper=True).splitlines()
  assert paper[0].startswith("goodput % [paper %]")
  assert f"50.0 [{row[0]:3.0f}]" in paper[1]
  assert (
    "(" not in paper[2]
  )  # No paper figure: goodput alone, never an uptime under a paper header.
  assert paper[3] == "[n] = the paper's goodput (docs/algorithm.md §7); uptime is in goodput.json."
