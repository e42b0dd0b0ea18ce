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


def test_parse_syncer_faults_of_every_shard_or_one():
  assert parse_fault("syncer@60+5") == [
    FaultEvent(60.0, "kill_syncer", params={"restart_delay_s": 5.0}),
    FaultEvent(65.0, "start_syncer"),
  ]
  assert parse_fault("syncer:1@60+5") == [
    FaultEvent(60.0, "kill_syncer", params={"restart_delay_s": 5.0}, shard=1),
    FaultEvent(65.0, "start_syncer", shard=1),
  ]
  assert parse_fault("syncer:0@7") == [FaultEvent(7.0, "kill_syncer", shard=0)]


def test_syncer_and_learner_faults_sort_together():
  out = parse_faults(["crash:1@5+5", "syncer:1@10+2", "syncer@10+1", "crash:0@10"])
  assert [(e.t, e.kind, e.learner, e.shard) for e in out] == [
    (5.0, "kill_learner", 1, None),
    (10.0, "start_learner", 1, None),  # Completions first at equal times.
    (10.0, "kill_syncer", None, None),  # Then syncer events (every shard before one shard).
    (10.0, "kill_syncer", None, 1),
    (10.0, "kill_learner", 0, None),
    (11.0, "start_syncer", None, None),
    (12.0, "start_syncer", None, 1),
  ]


@pytest.mark.parametrize(
  "text",
  [
    "crash1@3",
    "crash@3",
    "syncer:1@3x2",
    "syncer:-1@3",
    "boom:1@3",
    "crash:-1@3",
    "slow:1@3",
    "slow:1@3+inf",
    "slow:1@3+2x0",
    "crash:1@x",
  ],
)
def test_bad_faults_raise(text):
  with pytest.raises(ValueError, match=r"fault|slow"):
    parse_fault(text)
