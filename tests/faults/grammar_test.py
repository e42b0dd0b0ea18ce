"""Tests for the fault-string grammar."""

import pytest

from ddiloco.faults import FaultEvent, parse_fault, parse_faults


def test_parse_crash_with_recovery_is_a_kill_and_its_restart():
  assert parse_fault("crash:1@30+20") == [
    FaultEvent(30.0, "kill_learner", 1, {"restart_delay_s": 20.0}),
    FaultEvent(50.0, "start_learner", 1),
  ]


def test_parse_permanent_crash_leave_join_and_slow():
  assert parse_fault("crash:2@5") == [FaultEvent(5.0, "kill_learner", 2)]
  assert parse_fault("leave:0@9") == [FaultEvent(9.0, "remove_learner", 0)]
  assert parse_fault("join:4@1.5") == [FaultEvent(1.5, "add_learner", 4)]
  assert parse_fault("slow:3@10+40x2.5") == [
    FaultEvent(10.0, "slow_learner", 3, {"factor": 2.5, "duration_s": 40.0}),
    FaultEvent(50.0, "unslow_learner", 3),
  ]


def test_schedule_sorted_by_time_with_completions_first_at_equal_times():
  out = parse_faults(["leave:0@9", "join:4@1", "crash:1@5+4", "slow:2@9+1x2"])
  assert [(e.t, e.kind) for e in out] == [
    (1.0, "add_learner"),
    (5.0, "kill_learner"),
    (9.0, "start_learner"),  # A completion before the new faults at the same time.
    (9.0, "remove_learner"),
    (9.0, "slow_learner"),
    (10.0, "unslow_learner"),
  ]


@pytest.mark.parametrize(
  "text",
  ["crash1@3", "boom:1@3", "crash:-1@3", "slow:1@3", "slow:1@3+inf", "slow:1@3+2x0", "crash:1@x"],
)
def test_bad_faults_raise(text):
  with pytest.raises(ValueError, match=r"fault|slow"):
    parse_fault(text)
