"""Tests of data/token_shards.py and data/token_corpus.py: pre-tokenized corpora and the rule for
learners that restart, join or leave, checked on a data ledger (the positions each learner read).

The corpus of most tests has windows whose every token is the window's example id (vocabulary
2**20, stored as uint32), so a batch says which examples it holds.
"""

import collections
import json
import os

import numpy as np
import pytest

from ddiloco.data import token_corpus, token_shards, tokenizers

N = 97  # Train examples: a prime, so no slot count divides it.
WINDOW = 5


def _corpus(path, n=N, n_eval=12, examples_per_file=10):
  windows = {
    "train": [np.full(WINDOW, i, np.int64) for i in range(n)],
    "eval": [np.full(WINDOW, 10_000 + i, np.int64) for i in range(n_eval)],
  }
  token_corpus.write_corpus(
    str(path), windows, vocab_size=2**20, tokenizer="ids", examples_per_file=examples_per_file
  )
  return token_shards.TokenShardDataConfig(path=str(path), batch_size=3, seed=7)


class Ledger:
  """Which positions each learner read (positions map to examples through the epoch order)."""

  def __init__(self):
    self.reads = collections.Counter()
    self.by_learner = collections.defaultdict(list)

  def book(self, learner, positions):
    self.reads.update(int(g) for g in positions)
    self.by_learner[learner].extend(int(g) for g in positions)

  def anomalies(self, below):
    """Positions under `below` read twice or never."""
    return {g for g in range(below) if self.reads[g] != 1}


def _read(ledger, learner, start, *, num_shards, batch_size, batches):
  """Learner `learner` reads `batches` batches from `start`; returns its next position."""
  for k in range(batches):
    ledger.book(learner, token_shards.slot_positions(start, num_shards, batch_size, k))
  return start + batches * batch_size * num_shards


def test_a_fixed_fleet_never_reads_a_position_twice_and_a_new_batch_size_skips_nothing():
  ledger = Ledger()
  rng = np.random.default_rng(0)
  m = 4
  position = {i: token_shards.resume_position(0, i, m) for i in range(m)}
  for _ in range(5):  # Heterogeneous learners: each its own batch size and pace; restarts keep M.
    for i in range(m):
      batch = int(rng.integers(1, 6))
      start = token_shards.resume_position(position[i], i, m)
      assert start == position[i]  # Same slot count: the position itself.
      position[i] = _read(
        ledger, i, start, num_shards=m, batch_size=batch, batches=int(rng.integers(0, 4))
      )
  assert max(ledger.reads.values()) == 1
  for i, read in ledger.by_learner.items():
    assert all(g % m == i for g in read) and read == sorted(read)
    # Its own residue from 0 to where it stands, without a gap: nothing skipped.
    assert read == list(range(i, position[i], m))


@pytest.mark.parametrize(
  "old_batches, new_slots, source",
  [
    # Learner 3 leaves: the three others restart as a fleet of 3, each from its own position.
    ([2, 2, 2, 2], 3, {0: 0, 1: 1, 2: 2}),
    # Learner 4 joins a fleet of 4, taking learner 0's position (a peer's).
    ([2, 2, 2, 2], 5, {0: 0, 1: 1, 2: 2, 3: 3, 4: 0}),
    # Heterogeneous paces, then a fleet of 6 from 4.
    ([1, 5, 3, 2], 6, {0: 0, 1: 1, 2: 2, 3: 3, 4: 1, 5: 2}),
    # A fleet of 2 from 4: learners 2 and 3 leave.
    ([3, 0, 4, 1], 2, {0: 0, 1: 1}),
  ],
)
def test_a_changed_fleet_repeats_or_skips_only_within_the_bound(old_batches, new_slots, source):
  ledger = Ledger()
  m, batch = len(old_batches), 3
  old = {
    i: _read(ledger, i, i, num_shards=m, batch_size=batch, batches=n)
    for i, n in enumerate(old_batches)
  }
  low, high = min(old.values()), max(old.values())
  new = {}
  for i in range(new_slots):
    start = token_shards.resume_position(old[source[i]], i, new_slots)
    assert old[source[i]] <= start < old[source[i]] + new_slots
    new[i] = _read(ledger, 100 + i, start, num_shards=new_slots, batch_size=4, batches=30)
  end = min(new.values())
  assert end > high + new_slots  # The new fleet read well past the change.
  bad = ledger.anomalies(end)
  assert bad <= set(range(low, high + new_slots))
  assert len(bad) <= high - low + new_slots
  if old_batches.count(old_batches[0]) == m:  # The same step and batch size: H - L < M.
    assert len(bad) <= m + new_slots - 1
  assert not ledger.anomalies(low)  # Before the change: each position once.


def test_the_iterator_reads_the_ledgers_examples_and_resumes_by_the_rule(tmp_path):
  config = _corpus(tmp_path / "corpus")
  info = config.info()
  assert (info.window_len, info.dtype, info.examples) == (5, "uint32", {"train": 97, "eval": 12})
  assert len(info.files["train"]) == 10 and info.files["train"][0].endswith(
    "-00000-of-00010.array_record"
  )
  order = token_shards.EpochOrder(N, seed=7)
  it = token_shards.make_train_iterator(config, shard_index=1, num_shards=3)
  seen = []
  for _ in range(40):  # 120 positions of slot 1, up to 358: past the first epoch (97).
    positions = it.next_positions()
    batch = next(it)
    assert batch["inputs"].shape == (3, 4) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 0], order.examples(positions))
    np.testing.assert_array_equal(batch["targets"], batch["inputs"][:, :1].repeat(4, 1))
    seen.extend(positions)
  assert seen == list(range(1, 1 + 120 * 3, 3))
  # Each epoch is a permutation: the first N positions hold every example once.
  assert sorted(order.examples(np.arange(N))) == list(range(N))
  state = json.loads(json.dumps(it.get_state()))
  assert state["position"] == 1 + 120 * 3
  # The same slot with another batch size continues exactly there.
  other = token_shards.make_train_iterator(config, shard_index=1, num_shards=3, batch_size=5)
  other.set_state(state)
  assert other.position() == state["position"]
  # Slot 3 of 5 continues at the first of its positions after it.
  moved = token_shards.make_train_iterator(config, shard_index=3, num_shards=5)
  moved.set_state(state)
  assert moved.position() == token_shards.resume_position(state["position"], 3, 5) == 363
  np.testing.assert_array_equal(
    next(moved)["inputs"][:, 0], order.examples(np.array([363, 368, 373]))
  )


def test_a_state_of_another_corpus_or_seed_is_refused(tmp_path):
  config = _corpus(tmp_path / "a")
  state = token_shards.make_train_iterator(config, shard_index=0, num_shards=2).get_state()
  reseeded = token_shards.TokenShardDataConfig(path=config.path, seed=8)
  with pytest.raises(ValueError, match="does not match this stream"):
    token_shards.make_train_iterator(reseeded, shard_index=0, num_shards=2).set_state(state)
  other = _corpus(tmp_path / "b", n=50)
  with pytest.raises(ValueError, match="does not match this stream"):
    token_shards.make_train_iterator(other, shard_index=0, num_shards=2).set_state(state)


def test_eval_batches_are_fixed_and_spread_over_the_eval_split(tmp_path):
  config = _corpus(tmp_path / "corpus")
  batches = token_shards.eval_batches(config, num_batches=2, batch_size=3)
  ids = np.concatenate([b["inputs"][:, 0] for b in batches]) - 10_000
  np.testing.assert_array_equal(ids, [0, 2, 4, 6, 8, 10])
  with pytest.raises(ValueError, match="holds 12 windows; 4 x 4 = 16 requested"):
    token_shards.eval_batches(config, num_batches=4, batch_size=4)


def test_text_files_become_a_corpus_of_their_tokens(tmp_path):
  docs = [tmp_path / "a.txt", tmp_path / "b.txt"]
  docs[0].write_text("To be, or not to be, that is the question. " * 8)
  docs[1].write_text("Whether 'tis nobler in the mind to suffer. " * 8)
  info = token_corpus.write_text_corpus(
    str(tmp_path / "bytes"), [str(d) for d in docs], tokenizer="byte", seq_len=15,
    eval_fraction=0.25, examples_per_file=4,
  )  # fmt: skip
  assert (info.window_len, info.vocab_size, info.dtype, info.tokenizer) == (
    16,
    256,
    "uint16",
    "byte",
  )
  train_bytes = sum(len(d.read_bytes()) - int(np.ceil(0.25 * len(d.read_bytes()))) for d in docs)
  assert info.examples["train"] == train_bytes // 16
  config = token_shards.TokenShardDataConfig(path=info.path, batch_size=2, seq_len=15)
  batch = token_shards.eval_batches(config, num_batches=1)[0]
  data = [d.read_bytes() for d in docs]
  held_out = b"".join(b[len(b) - int(np.ceil(0.25 * len(b))) :] for b in data)
  assert tokenizers.ByteTokenizer().decode(batch["inputs"][0]) == held_out[:15].decode()
  bpe = token_corpus.write_text_corpus(
    str(tmp_path / "bpe"), [str(d) for d in docs], tokenizer="bpe", seq_len=7
  )
  assert (bpe.vocab_size, bpe.dtype) == (tokenizers.BpeTokenizer().vocab_size, "uint32")


def test_a_folder_that_is_no_corpus_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"holds no tokens\.json"):
    token_shards.TokenShardDataConfig(path=str(tmp_path))
  config = _corpus(tmp_path / "corpus")
  os.remove(os.path.join(config.path, "train-00003-of-00010.array_record"))
  with pytest.raises(FileNotFoundError, match=r"lacks \['train-00003-of-00010.array_record'\]"):
    token_shards.TokenShardDataConfig(path=config.path)


def test_config_checks_its_window_length_and_writes_refuse_bad_windows(tmp_path):
  config = _corpus(tmp_path / "corpus")
  with pytest.raises(ValueError, match="holds windows of 5 tokens"):
    token_shards.TokenShardDataConfig(path=config.path, seq_len=8)
  with pytest.raises(FileExistsError, match="is not an empty folder"):
    _corpus(tmp_path / "corpus")
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(ValueError, match=r"ids outside \[0, 10\)"):
    token_corpus.write_corpus(
      str(tmp_path / "bad"), {"train": [np.arange(9)] * 3, "eval": [np.arange(12)]},
      vocab_size=10, tokenizer="x",
    )  # fmt: skip
  with pytest.raises(ValueError, match="No eval windows"):
    token_corpus.write_corpus(
      str(tmp_path / "bad"), {"train": [np.arange(9)] * 3, "eval": []}, vocab_size=10, tokenizer="x"
    )
  assert sorted(os.listdir(tmp_path)) == before  # The train files of both went with the stage.


def test_the_ledger_of_a_run_counts_repeats_and_unread_positions_by_slot():
  # Slots of 3: learner 0 reads 0, 3, 6, 9; learner 1 reads 1, 4 then leaves; learner 2 joins
  # late but reads its slot from the start: 2, 5, 8, 11; a learner sharing slot 0 reads 6, 9.
  ledger = token_shards.data_ledger([(0, 3, 0, 12), (1, 3, 0, 6), (2, 3, 2, 12), (0, 3, 5, 11)])
  assert ledger == token_shards.DataLedger(end=12, read=10, repeated=2, unread={1: 2})
  with pytest.raises(ValueError, match="Not a data segment"):
    token_shards.data_ledger([(3, 3, 0, 4)])
