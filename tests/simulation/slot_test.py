"""The data positions a simulated learner reads (simulation/slot.py), booked per life, and the
ledger of a simulated run on a pre-tokenized corpus (launch/run_summary.py `data_segments`).

The run test is in the integration tier: five tiny learners over a dozen steps each.
"""

import numpy as np
import pytest

from ddiloco.data import token_corpus, token_shards
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.factory import LearnerSpec
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.simulation.config import ClusterConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.simulation.slot import LearnerSlot
from ddiloco.syncer.core import SyncerConfig

WINDOW = 17  # seq_len 16.
BATCH = 4


def _corpus(path, n=500) -> token_shards.TokenShardDataConfig:
  """n train windows of random byte ids."""
  rng = np.random.default_rng(0)
  windows = {
    "train": list(rng.integers(0, 256, (n, WINDOW))),
    "eval": list(rng.integers(0, 256, (16, WINDOW))),
  }
  token_corpus.write_corpus(str(path), windows, vocab_size=256, tokenizer="byte")
  return token_shards.TokenShardDataConfig(path=str(path), batch_size=BATCH)


def test_a_slot_books_each_life_from_where_its_iterator_stands(tmp_path):
  config = _corpus(tmp_path / "corpus")
  slot = LearnerSlot(index=2, spec=LearnerSpec())
  slot.data = token_shards.make_train_iterator(config, shard_index=2, num_shards=5)
  slot.begin_life()
  for _ in range(3):
    next(slot.data)
  slot.end_life()  # A crash after 3 steps: positions 2, 7, ..., 57 read.
  slot.end_life()  # A second stop books nothing new.
  slot.begin_life()  # The restart reads on from 62.
  next(slot.data)
  assert slot.data_summary() == {
    "start": {"position": 2, "slot": 2, "slots": 5},
    "end": {"position": 2 + 4 * BATCH * 5, "slot": 2, "slots": 5},
    "lives": [[2, 62], [62, 82]],
  }


def test_a_stream_without_positions_books_nothing():
  slot = LearnerSlot(index=0, spec=LearnerSpec(), data=iter([]))
  slot.begin_life()
  slot.end_life()
  assert (slot.data_lives, slot.data_summary()) == ([], None)


def _run(tmp_path, corpus, *, data_slots: int) -> dict:
  """4 learners; learner 4 joins at t = 4, learner 1 leaves at t = 6.5, learner 2 crashes at
  t = 8.5 and restarts at t = 10.5; 12 steps a learner's worth of tokens."""
  run = RunConfig(
    model=configs.transformer_config("tiny", num_layers=1, d_model=32, head_dim=8, max_len=16),
    data=corpus,
    schedule=FragmentSchedule(num_fragments=2, period=4, overlap=1),
    syncer=SyncerConfig(min_quorum=1),
    inner_opt=train_step.InnerOptConfig(warmup_steps=1, decay_steps=24),
    num_learners=4,
    data_slots=data_slots,
    steps_per_learner=12,
    eval_batches=2,
    log_every=4,
  )
  fleet = ClusterConfig(faults=("join:4@4", "leave:1@6.5", "crash:2@8.5+2"))
  return simulate(workdir=str(tmp_path), run=run, fleet=fleet, tensorboard=False)


@pytest.mark.integration
def test_a_simulated_run_with_a_join_a_leave_and_a_restart_reads_no_position_twice(tmp_path):
  from ddiloco.launch.run_summary import data_segments  # Imports the launchers' modules.

  corpus = _corpus(tmp_path / "corpus")
  summary = _run(tmp_path / "run", corpus, data_slots=5)
  steps = {int(i): s["steps"] for i, s in summary["learners"].items()}
  assert steps[1] == 6 and steps[4] > 0 and summary["budget_reached"]
  rows = data_segments(str(tmp_path / "run"))
  # Learner 2's two lives meet where the crash left its iterator; every learner read its slot of
  # 5 from the slot's first position, B positions 5 apart a step.
  lives = [r for r in rows if r[0] == 2]
  assert len(lives) == 2 and lives[0][4] == lives[1][3]
  starts, ends = {}, {}
  for learner, slot, slots, start, end in rows:
    assert (slot, slots) == (learner, 5)
    starts.setdefault(learner, start)
    ends[learner] = end
  assert starts == {i: i for i in range(5)}
  assert ends == {i: i + steps[i] * BATCH * 5 for i in range(5)}

  ledger = token_shards.data_ledger([r[1:] for r in rows])
  furthest = max(ends.values())
  assert (ledger.end, ledger.read, ledger.repeated) == (furthest, BATCH * sum(steps.values()), 0)
  # Unread: the positions of slots 1 (left) and 4 (joined late, from its slot's start) between
  # their learner's end and the furthest read; the other slots were read to within a step of it.
  in_slot = {s: len(range(s, furthest, 5)) for s in range(5)}
  unread = {s: in_slot[s] - BATCH * steps[s] for s in range(5) if in_slot[s] > BATCH * steps[s]}
  assert ledger.unread == unread
  assert unread[1] > 0 and unread[4] > 0


@pytest.mark.integration
def test_a_learner_added_beyond_the_data_slots_rereads_a_running_learners_positions(tmp_path):
  from ddiloco.launch.run_summary import data_segments

  corpus = _corpus(tmp_path / "corpus")
  summary = _run(tmp_path / "run", corpus, data_slots=4)
  rows = data_segments(str(tmp_path / "run"))
  learner_4 = next(r for r in rows if r[0] == 4)
  assert learner_4[1:4] == (0, 4, 0)  # Slot 4 mod 4 = 0, learner 0's, from its start.
  ledger = token_shards.data_ledger([r[1:] for r in rows])
  assert ledger.repeated == BATCH * summary["learners"]["4"]["steps"]
