"""The `carry` apply rule on the simulated cluster (learner/carry.py), against the default overwrite."""

import numpy as np
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.config import LearnerConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.simulation.config import ClusterConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.syncer.core import SyncerConfig

SEQ = 32
P = 4


def _summary(tmp_path, rule):
  return simulate(
    workdir=str(tmp_path / rule),
    run=RunConfig(
      model=configs.transformer_config("tiny", max_len=SEQ),
      data=text_data.TextDataConfig(seq_len=SEQ, batch_size=4),
      schedule=FragmentSchedule(num_fragments=P, period=4, overlap=1),
      syncer=SyncerConfig(min_quorum=1),
      learner=LearnerConfig(apply_rule=rule),
      inner_opt=train_step.InnerOptConfig(warmup_steps=2, decay_steps=100),
      num_learners=3,
      steps_per_learner=24,
      log_every=4,
    ),
    fleet=ClusterConfig(faults=("crash:1@5+8",)),
  )


def _learners_ledger(summary):
  """The learners' token-fragments: merged and dropped, summed; and whether each one balances."""
  merged = dropped = trained = 0
  balanced = True
  for s in summary["learners"].values():
    ledger = s["token_ledger"]
    balanced &= ledger["balanced"]
    merged += ledger["token_fragments"]["merged"]
    dropped += ledger["token_fragments"]["dropped"]
    trained += ledger["trained"] * P
  return merged, dropped, trained, balanced


@pytest.mark.e2e  # Two simulated runs, ~30 s; tests/learner/carry_test.py covers the rule itself.
def test_carry_keeps_the_overlap_and_its_books_agree_with_the_syncer(tmp_path):
  overwrite = _summary(tmp_path, "overwrite")
  carry = _summary(tmp_path, "carry")
  for summary in (overwrite, carry):
    # Each apply's read-back is compared with the syncer's digest: with carry, Θ_p before the carry.
    assert summary["digests_agree"] is True
    assert np.isfinite(summary["final_eval_loss"])
    merged, _, trained, balanced = _learners_ledger(summary)
    assert balanced
    book = summary["token_ledger"]
    # What the learners settled as merged is exactly what the syncer merged: carried tokens are
    # booked once, when the answer that holds them merges.
    assert merged == book["merged"] > 0
    assert book["received"] == book["merged"] + book["dropped"] + book["pending"]
  ow_merged, ow_dropped, trained, _ = _learners_ledger(overwrite)
  c_merged, c_dropped, c_trained, _ = _learners_ledger(carry)
  assert c_trained == trained  # The same token budget.
  carried = [s["carried_applies"] for s in carry["learners"].values()]
  assert all(n > 0 for n in carried)
  assert all(s["carried_applies"] == 0 for s in overwrite["learners"].values())
  # τ = 1 of every H = 4 steps is overwritten at each apply by overwrite, kept by carry.
  assert c_dropped < ow_dropped
  assert c_merged / c_trained > ow_merged / trained
