"""TokenLedger: every trained token ends in exactly one fate, derived by hand step by step."""

import pytest

from ddiloco.learner.ledger import TokenLedger


def _fates(ledger):
  return ledger.fates()


def test_a_merged_report_and_the_overwritten_overlap():
  """P = 2, 10 tokens a step. p = 0 is sent after step 2, merged, applied after step 3."""
  ledger = TokenLedger(2)
  ledger.train(10)
  ledger.train(10)
  assert ledger.send(0, step=2) == 20  # Both steps' tokens ride on the report of p = 0.
  ledger.train(10)  # Step 3: τ = 1 step between send and apply.
  ledger.answered(0, 2, "accepted", 1.0, round_version=1)
  assert _fates(ledger) == {
    "unsent": 10 + 30,
    "awaiting": 0,
    "pending": 20,
    "merged": 0,
    "dropped": 0,
  }
  # The heartbeat says version 1 of p = 0 holds the report at step 2.
  assert ledger.settle([1, 0], [2, -1]) == 1
  assert ledger.overwritten(0) == 10  # The apply overwrites step 3's progress on p = 0.
  assert _fates(ledger) == {"unsent": 30, "awaiting": 0, "pending": 0, "merged": 20, "dropped": 10}
  totals = ledger.totals()
  assert totals["trained"] == 30 and totals["balanced"]
  assert totals["merged"] == 10.0 and totals["in_flight"] == 15.0  # Per fragment: 20/2, 30/2.
  assert totals["merged_fraction"] == pytest.approx(20 / 60)


@pytest.mark.parametrize("status,weight", [("late", 0.0), ("duplicate", 0.0), ("accepted", 0.0)])
def test_reports_no_round_took_are_dropped(status, weight):
  ledger = TokenLedger(1)
  ledger.train(7)
  ledger.send(0, step=1)
  ledger.answered(0, 1, status, weight, round_version=-1)
  assert _fates(ledger)["dropped"] == 7 and ledger.totals()["balanced"]


def test_a_round_lost_in_a_restart_drops_its_reports():
  """Taken for version 5; the restarted syncer republished past 5 without merging it."""
  ledger = TokenLedger(1)
  ledger.train(4)
  ledger.send(0, step=3)
  ledger.answered(0, 3, "accepted", 2.0, round_version=5)
  assert ledger.settle([4], [-1]) == 0  # Version 4: the round has not published yet.
  assert _fates(ledger)["pending"] == 4
  assert ledger.settle([6], [1]) == 1  # Version 6, newest merged report at step 1 < 3: lost.
  assert _fates(ledger) == {"unsent": 0, "awaiting": 0, "pending": 0, "merged": 0, "dropped": 4}


def test_a_superseded_report_is_merged_through_the_newer_one():
  ledger = TokenLedger(1)
  ledger.train(5)
  ledger.send(0, step=1)
  ledger.answered(0, 1, "accepted", 1.0, round_version=2)
  ledger.train(5)
  ledger.send(0, step=2)
  ledger.answered(0, 2, "superseded", 1.0, round_version=2)
  ledger.settle([2], [2])  # Version 2 merged the step-2 report, which held step 1's progress.
  assert _fates(ledger)["merged"] == 10


def test_fold_moves_a_replaced_reports_tokens():
  ledger = TokenLedger(1)
  ledger.train(3)
  ledger.send(0, step=1)
  ledger.train(4)
  ledger.send(0, step=2)
  assert ledger.fold(0, 1, 2) == 3
  ledger.answered(0, 2, "accepted", 1.0, round_version=1)
  assert _fates(ledger)["pending"] == 7 and _fates(ledger)["awaiting"] == 0
  assert ledger.fold(0, 1, 2) == 0  # Nothing left to move.


def test_unsettled_awaiting_reports_settle_after_a_restore():
  ledger = TokenLedger(2)
  ledger.train(6)
  ledger.send(0, step=1)
  ledger.send(1, step=1)
  state = ledger.state()
  back = TokenLedger(2)
  back.load_state(state)
  assert back.fates() == ledger.fates() and back.trained == 6
  back.restored()  # The dead process may have had them answered: the next heartbeat decides.
  assert back.fates()["pending"] == 12
  back.settle([3, 3], [1, 0])  # p = 0's step-1 report was merged, p = 1's was not.
  assert back.fates() == {"unsent": 0, "awaiting": 0, "pending": 0, "merged": 6, "dropped": 6}


def test_bad_input():
  with pytest.raises(ValueError):
    TokenLedger(0)
  with pytest.raises(ValueError):
    TokenLedger(1).train(-1)
  with pytest.raises(ValueError, match="fragments"):
    TokenLedger(2).load_state(TokenLedger(3).state())
  ledger = TokenLedger(2)
  assert ledger.settle([1], [1]) == 0  # A heartbeat without ledger fields teaches nothing.
