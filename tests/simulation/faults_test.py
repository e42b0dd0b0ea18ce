"""Tests for the fault-string grammar."""

import math

import pytest

from ddiloco.simulation import faults


def test_parse_crash_with_recovery():
  f = faults.parse_fault("crash:1@30+20")
  assert f == faults.Fault(kind="crash", learner=1, time_s=30.0, duration_s=20.0)


def test_parse_permanent_crash_and_slow():
  assert math.isinf(faults.parse_fault("crash:2@5").duration_s)
  slow = faults.parse_fault("slow:3@10+40x2.5")
  assert (slow.kind, slow.learner, slow.time_s, slow.duration_s, slow.factor) == (
    "slow",
    3,
    10.0,
    40.0,
    2.5,
  )


def test_schedule_sorted_by_time():
  out = faults.parse_faults(["leave:0@9", "join:4@1", "crash:1@5+1"])
  assert [f.time_s for f in out] == [1.0, 5.0, 9.0]


@pytest.mark.parametrize("text", ["crash1@3", "boom:1@3", "crash:-1@3", "slow:1@3", "crash:1@x"])
def test_bad_faults_raise(text):
  with pytest.raises(ValueError):
    faults.parse_fault(text)
