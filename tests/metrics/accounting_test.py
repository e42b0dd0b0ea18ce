"""Tests for goodput and global-downtime accounting, by hand-computed timelines."""

import pytest

from ddiloco.metrics.accounting import BLOCKED, BUSY, DOWN, TimeLedger


def test_goodput_and_downtime_two_learners():
  ledger = TimeLedger()
  ledger.set_state(0, BUSY, 0.0)
  ledger.set_state(1, BUSY, 0.0)
  ledger.set_state(1, DOWN, 4.0)  # learner 1 down 4..6
  ledger.set_state(0, BLOCKED, 5.0)  # learner 0 blocked 5..7: nobody busy during 5..6
  ledger.set_state(1, BUSY, 6.0)
  ledger.set_state(0, BUSY, 7.0)
  ledger.close(10.0)
  # Busy: learner 0: 5 + 3 = 8; learner 1: 4 + 4 = 8. Provisioned: 10 each.
  assert ledger.goodput() == pytest.approx(16 / 20)
  assert ledger.global_downtime_s == pytest.approx(1.0)
  assert ledger.totals(1) == pytest.approx({BUSY: 8.0, DOWN: 2.0})


def test_no_downtime_while_someone_busy():
  ledger = TimeLedger()
  ledger.set_state(0, BUSY, 0.0)
  ledger.set_state(1, BUSY, 0.0)
  ledger.set_state(1, DOWN, 1.0)
  ledger.close(3.0)
  assert ledger.global_downtime_s == 0.0
  assert ledger.goodput() == pytest.approx(4 / 6)


def test_unknown_state_rejected():
  with pytest.raises(ValueError):
    TimeLedger().set_state(0, "sleeping", 0.0)


def test_trailing_idle_time_is_downtime():
  ledger = TimeLedger()
  ledger.set_state(0, BUSY, 0.0)
  ledger.set_state(0, BLOCKED, 2.0)  # Blocked until the run is closed at t = 9.
  ledger.close(9.0)
  assert ledger.global_downtime_s == pytest.approx(7.0)
  assert ledger.goodput() == pytest.approx(2 / 9)
