"""Tests for the simulator's fault executor, on a fake fleet (no learners, no syncer)."""

import dataclasses
import math

import pytest

from ddiloco.faults import parse_faults
from ddiloco.simulation.faults import SimulatedFaults


@dataclasses.dataclass
class _Slot:
  alive: bool = True
  left: bool = False
  slow_factor: float = 1.0
  restart_at: float = math.inf


class _Fleet:
  def __init__(self, n: int):
    self.now = 0.0
    self.slots = {i: _Slot() for i in range(n)}
    self.calls: list[tuple] = []
    self.logged: list[tuple] = []

  def start_learner(self, index, *, rejoin):
    self.calls.append(("start", index, rejoin))
    self.slots.setdefault(index, _Slot(alive=False)).alive = True

  def stop_learner(self, index, *, left):
    self.calls.append(("stop", index, left))
    self.slots[index].alive = False

  def log_fault(self, event):
    self.logged.append((event.t, event.kind, event.learner))


def _run(fleet: _Fleet, texts: list[str]) -> list[bool]:
  faults = SimulatedFaults(fleet)
  out = []
  for event in parse_faults(texts):
    fleet.now = event.t
    out.append(faults.execute(event))
  return out


def test_crash_and_restart():
  fleet = _Fleet(2)
  assert _run(fleet, ["crash:1@3+2"]) == [True, True]
  assert fleet.calls == [("stop", 1, False), ("start", 1, True)]
  assert fleet.logged == [(3.0, "kill_learner", 1), (5.0, "start_learner", 1)]


def test_a_crash_while_down_does_nothing_and_the_first_restart_stands():
  fleet = _Fleet(2)
  # The second crash finds learner 1 down: no kill, and its restart at 6 is not the one due.
  assert _run(fleet, ["crash:1@3+10", "crash:1@4+2"]) == [True, False, False, True]
  assert fleet.calls == [("stop", 1, False), ("start", 1, True)]
  assert fleet.logged[-1] == (13.0, "start_learner", 1)


def test_a_learner_added_back_and_killed_again_restarts_after_its_latest_kill():
  fleet = _Fleet(2)
  out = _run(fleet, ["crash:1@3+10", "join:1@5", "crash:1@8+10"])
  # kill@3, add@5, kill@8, start@13 (the first crash's: not due, the latest kill restarts at 18).
  assert out == [True, True, True, False, True]
  assert fleet.calls[-1] == ("start", 1, True) and fleet.logged[-1] == (18.0, "start_learner", 1)


def test_no_restart_after_a_leave_and_none_for_a_permanent_crash():
  fleet = _Fleet(3)
  assert _run(fleet, ["crash:1@3+10", "leave:1@5", "crash:2@4"]) == [True, True, True, False]
  assert ("start", 1, True) not in fleet.calls and fleet.slots[1].left


def test_slow_then_unslow_and_faults_on_learners_not_joined_are_skipped():
  fleet = _Fleet(2)
  faults = SimulatedFaults(fleet)
  events = parse_faults(["slow:0@1+2x3", "crash:7@1+1", "slow:7@1+1x2"])
  done = []
  for event in events:
    fleet.now = event.t
    done.append(faults.execute(event))
    if event.kind == "slow_learner" and event.learner == 0:
      assert fleet.slots[0].slow_factor == 3.0
  assert fleet.slots[0].slow_factor == 1.0
  assert sum(done) == 2  # Only learner 0's slow and unslow: learner 7 never joined.


def test_join_of_a_running_learner_is_refused():
  with pytest.raises(ValueError, match="already running"):
    _run(_Fleet(2), ["join:1@1"])
