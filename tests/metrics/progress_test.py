"""Tests for metrics/progress.py: the fields of the progress lines, `-` for what is not known."""

import math

import pytest

from ddiloco.metrics import progress


@pytest.mark.parametrize(
  ("value", "expected"), [(2.0864, "2.086"), (None, "-"), (math.nan, "-"), (math.inf, "-")]
)
def test_number(value, expected):
  assert progress.number(value) == expected


@pytest.mark.parametrize(
  ("value", "expected"),
  [(0.5, "0.5"), (15.04, "15"), (812.4, "812"), (7400.0, "7.4k"), (12_345.0, "12.3k"),
   (2.5e6, "2.5M"), (None, "-"), (math.nan, "-"), (-1.0, "-")],
)  # fmt: skip
def test_rate(value, expected):
  assert progress.rate(value) == expected


@pytest.mark.parametrize(
  ("seconds", "expected"),
  [(0.0, "0s"), (44.6, "45s"), (65.0, "1m05s"), (3599.0, "59m59s"), (7500.0, "2h05m"),
   (None, "-"), (math.inf, "-"), (-3.0, "-")],
)  # fmt: skip
def test_duration(seconds, expected):
  assert progress.duration(seconds) == expected


def test_throughput_and_learner():
  assert progress.throughput(3.2, 820.0, 65.0) == "3.2 steps/s 820 tok/s eta 1m05s"
  assert progress.throughput(None, None, None) == "- steps/s - tok/s eta -"
  assert progress.learner(2, "up", 40, 2.11349) == "L2:up step 40 loss 2.113"
  assert progress.learner(0, "up", 0, None) == "L0:up step 0 loss -"
  assert "nan" not in progress.learner(0, "down", None, math.nan)
