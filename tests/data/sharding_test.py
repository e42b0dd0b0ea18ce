"""Tests for ddiloco.data.sharding: the shared shard-stream grain source of the text and image data."""

import threading

import grain
import numpy as np
import pytest

from ddiloco.data import text, vision
from ddiloco.data.sharding import ShardBatchIds

IDS = np.array([10, 20, 30, 40, 50], dtype=np.int64)  # n = 5.
KEY = (7, 3, 1)  # (seed, num_shards, shard_index), as both pipelines build it.


def _perm(epoch):
  """The documented epoch permutation, computed independently of the class."""
  return IDS[np.random.default_rng([*KEY, epoch]).permutation(IDS.size)]


def test_batches_follow_the_documented_stream():
  # B = 2, n = 5: batch 0 = positions 0-1, batch 1 = 2-3, batch 2 = position 4 of epoch 0 and
  # position 0 of epoch 1 (a straddling batch), batch 7 = positions 14-15 = epoch 2 pos 4, epoch 3 pos 0.
  source = ShardBatchIds(IDS, batch_size=2, seed_key=KEY)
  p0, p1, p2, p3 = (_perm(e) for e in range(4))
  np.testing.assert_array_equal(source[0], p0[0:2])
  np.testing.assert_array_equal(source[1], p0[2:4])
  np.testing.assert_array_equal(source[2], [p0[4], p1[0]])
  np.testing.assert_array_equal(source[7], [p2[4], p3[0]])
  assert source[0].dtype == np.int64 and source[0].shape == (2,)
  assert len(source) > 2**62  # Endless.


def test_every_epoch_is_a_permutation_and_epochs_differ():
  source = ShardBatchIds(IDS, batch_size=5, seed_key=KEY)  # B = n: batch k is epoch k exactly.
  epochs = [source[k] for k in range(6)]
  for e in epochs:
    assert sorted(e.tolist()) == IDS.tolist()
  # 6 shuffles of 5 ids: all equal would have probability (1/120)^5; they are seeded, so fixed.
  assert len({tuple(e) for e in epochs}) > 1


def test_batch_larger_than_the_shard_spans_three_epochs():
  # B = 12, n = 5: batch 0 = epoch 0 (5 ids), epoch 1 (5 ids), epoch 2 positions 0-1.
  source = ShardBatchIds(IDS, batch_size=12, seed_key=KEY)
  np.testing.assert_array_equal(source[0], np.concatenate([_perm(0), _perm(1), _perm(2)[:2]]))


def test_random_access_is_pure_in_any_order():
  forward = ShardBatchIds(IDS, batch_size=3, seed_key=KEY)
  backward = ShardBatchIds(IDS, batch_size=3, seed_key=KEY)
  want = [forward[k].copy() for k in range(12)]
  got = {k: backward[k] for k in reversed(range(12))}  # Evicts and rebuilds cached epochs.
  for k in range(12):
    np.testing.assert_array_equal(got[k], want[k])
  np.testing.assert_array_equal(forward[0], want[0])  # Epoch 0 was evicted; rebuilt identically.


def test_only_two_epochs_are_cached():
  source = ShardBatchIds(IDS, batch_size=5, seed_key=KEY)
  for k in range(4):
    source[k]
  assert sorted(source._perms) == [2, 3]


def test_seed_key_selects_the_stream():
  a = ShardBatchIds(np.arange(100), batch_size=100, seed_key=(0, 2, 0))
  b = ShardBatchIds(np.arange(100), batch_size=100, seed_key=(0, 2, 1))
  assert not np.array_equal(a[0], b[0])  # 100! orders: a collision would be a seeding bug.
  np.testing.assert_array_equal(
    a[0], ShardBatchIds(np.arange(100), batch_size=100, seed_key=[0, 2, 0])[0]
  )


def test_threaded_reads_agree():
  source = ShardBatchIds(np.arange(97), batch_size=10, seed_key=KEY)
  want = [ShardBatchIds(np.arange(97), batch_size=10, seed_key=KEY)[k] for k in range(40)]
  got = [None] * 40

  def read(start):
    for k in range(start, 40, 4):
      got[k] = source[k]

  threads = [threading.Thread(target=read, args=(s,)) for s in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for k in range(40):
    np.testing.assert_array_equal(got[k], want[k])


def test_grain_iterator_state_is_the_batch_index():
  it = iter(
    grain.MapDataset.source(ShardBatchIds(IDS, batch_size=2, seed_key=KEY)).to_iter_dataset()
  )
  for _ in range(3):
    next(it)
  state = it.get_state()
  rest = [next(it) for _ in range(4)]
  it.set_state(state)
  for want in rest:
    np.testing.assert_array_equal(next(it), want)


@pytest.mark.parametrize(
  "ids, batch_size, match",
  [
    (np.array([], dtype=np.int64), 2, "non-empty 1-D"),
    (np.zeros((2, 2), dtype=np.int64), 2, "non-empty 1-D"),
    (IDS, 0, "batch_size must be >= 1"),
  ],
)
def test_rejects_bad_arguments(ids, batch_size, match):
  with pytest.raises(ValueError, match=match):
    ShardBatchIds(ids, batch_size=batch_size, seed_key=KEY)


def test_both_pipelines_draw_their_batches_from_it():
  # Text: batch 0 of shard 1 of 3 is windows source[0] of that shard's ids, keyed (seed, 3, 1).
  cfg = text.TextDataConfig(seq_len=32, batch_size=4)
  ids = text.shard_window_ids(cfg, shard_index=1, num_shards=3)
  window_ids = ShardBatchIds(ids, batch_size=4, seed_key=(cfg.seed, 3, 1))[0]
  stream = text.token_stream(cfg, "train")
  batch = next(text.make_train_iterator(cfg, shard_index=1, num_shards=3))
  for row, w in enumerate(window_ids):
    np.testing.assert_array_equal(batch["inputs"][row], stream[w * 33 : w * 33 + 32])
  # Vision: the labels of batch 0 are the labels of the source's example ids.
  vcfg = vision.VisionDataConfig(batch_size=16)
  vids = vision.shard_example_ids(vcfg, shard_index=0, num_shards=2)
  example_ids = ShardBatchIds(vids, batch_size=16, seed_key=(vcfg.seed, 2, 0))[0]
  vbatch = next(vision.make_train_iterator(vcfg, shard_index=0, num_shards=2))
  np.testing.assert_array_equal(vbatch["targets"], vision.load_digits()[1][example_ids])
