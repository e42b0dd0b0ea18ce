"""Tests for ddiloco.data.vision: digits, split, shards, augmentation, checkpointable iterators."""

import json
import math

import numpy as np
import pytest

from ddiloco.data import vision

CFG = vision.VisionDataConfig(batch_size=16, noise_std=0.05)
# Images per class in scikit-learn's digits (np.bincount of the labels).
CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_digits_are_loaded_and_scaled():
  images, labels = vision.load_digits()
  assert images.shape == (1797, 8, 8, 1) and images.dtype == np.float32
  assert labels.shape == (1797,) and labels.dtype == np.int32
  assert images.min() == 0.0 and images.max() == 1.0  # Pixels 0..16 scaled by 1/16.
  assert np.bincount(labels).tolist() == CLASS_COUNTS
  assert not images.flags.writeable


def test_split_sizes_are_fixed_and_class_balanced():
  train, held = vision.split_ids(CFG)
  # ceil(0.2 * n_c) per class: 36+37+36+37+37+37+37+36+35+36 = 364 held out, 1,797 - 364 = 1,433.
  assert [math.ceil(0.2 * n) for n in CLASS_COUNTS] == [36, 37, 36, 37, 37, 37, 37, 36, 35, 36]
  assert (len(train), len(held)) == (1433, 364)
  assert not set(train) & set(held)
  assert sorted([*train, *held]) == list(range(1797))
  _, labels = vision.load_digits()
  assert np.bincount(labels[held]).tolist() == [36, 37, 36, 37, 37, 37, 37, 36, 35, 36]
  # The split ignores the seed: eval data never changes.
  other = vision.split_ids(vision.VisionDataConfig(seed=7))
  np.testing.assert_array_equal(other[1], held)


def test_shards_are_disjoint_and_cover_train():
  shards = [vision.shard_example_ids(CFG, shard_index=i, num_shards=4) for i in range(4)]
  assert [len(s) for s in shards] == [359, 358, 358, 358]  # 1,433 = 4 x 358 + 1.
  union = np.concatenate(shards)
  assert len(set(union.tolist())) == 1433
  np.testing.assert_array_equal(np.sort(union), vision.split_ids(CFG)[0])
  with pytest.raises(ValueError):
    vision.shard_example_ids(CFG, shard_index=4, num_shards=4)


def test_shift_augmentation_is_a_zero_filled_shift():
  image = np.zeros((1, 8, 8, 1), np.float32)
  image[0, 3, 4, 0] = 1.0
  for seed in range(10):
    out = vision.augment(image, np.random.default_rng(seed), max_shift=1, noise_std=0.0)
    (row,), (col,) = np.nonzero(out[0, :, :, 0])[0], np.nonzero(out[0, :, :, 0])[1]
    # Output (i, j) = input (i + dy, j + dx): the bright pixel moves by (-dy, -dx), |d| <= 1.
    assert abs(row - 3) <= 1 and abs(col - 4) <= 1
  shifted = [
    vision.augment(image, np.random.default_rng(s), max_shift=1, noise_std=0.0) for s in range(30)
  ]
  assert len({a.tobytes() for a in shifted}) > 1  # Not always the same offset.


def _batches(it, n):
  return [next(it) for _ in range(n)]


def test_batches_are_deterministic_and_differ_by_seed():
  make = lambda cfg: vision.make_train_iterator(cfg, shard_index=1, num_shards=2)  # noqa: E731
  a, b = _batches(make(CFG), 3), _batches(make(CFG), 3)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["targets"], y["targets"])
  c = _batches(make(vision.VisionDataConfig(batch_size=16, noise_std=0.05, seed=1)), 1)[0]
  assert not np.array_equal(a[0]["inputs"], c["inputs"])
  assert a[0]["inputs"].shape == (16, 8, 8, 1) and a[0]["targets"].dtype == np.int32
  shard = set(vision.shard_example_ids(CFG, shard_index=1, num_shards=2).tolist())
  images, _ = vision.load_digits()
  clean = _batches(make(vision.VisionDataConfig(batch_size=16, noise_std=0.0)), 1)[0]
  # Without augmentation every image of a batch is one of the shard's images, unchanged.
  for x in clean["inputs"]:
    assert set(np.flatnonzero((images == x).all(axis=(1, 2, 3))).tolist()) & shard


def test_augmentation_differs_across_epochs():
  """One batch = one epoch of shard 0 of 8 (180 images): epochs 0 and 1 hold the same images, and
  each image gets other noise the second time. The noise-free stream (same seed, same order)
  tells which image sits where.
  """
  n = len(vision.shard_example_ids(CFG, shard_index=0, num_shards=8))
  noisy_cfg = vision.VisionDataConfig(batch_size=n, noise_std=0.05)
  clean_cfg = vision.VisionDataConfig(batch_size=n, noise_std=0.0)
  noisy = _batches(vision.make_train_iterator(noisy_cfg, shard_index=0, num_shards=8), 2)
  clean = _batches(vision.make_train_iterator(clean_cfg, shard_index=0, num_shards=8), 2)
  keys = [[x.tobytes() for x in c["inputs"]] for c in clean]
  assert sorted(keys[0]) == sorted(keys[1]) and keys[0] != keys[1]  # Same images, reshuffled.
  for pos0, key in enumerate(keys[0][:20]):
    pos1 = keys[1].index(key)
    np.testing.assert_array_equal(clean[0]["inputs"][pos0], clean[1]["inputs"][pos1])
    assert not np.array_equal(noisy[0]["inputs"][pos0], noisy[1]["inputs"][pos1])


def test_state_round_trip():
  it = vision.make_train_iterator(CFG, shard_index=0, num_shards=3)
  _batches(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # JSON-serializable.
  assert state["next_index"] == 3
  expected = _batches(it, 2)
  restored = vision.make_train_iterator(CFG, shard_index=0, num_shards=3)
  restored.set_state(state)
  for x, y in zip(expected, _batches(restored, 2)):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["targets"], y["targets"])
  other = vision.make_train_iterator(CFG, shard_index=1, num_shards=3)
  with pytest.raises(ValueError, match="shard_index"):
    other.set_state(state)


def test_eval_batches_are_fixed_and_clean():
  batches = vision.eval_batches(CFG, num_batches=4)
  again = vision.eval_batches(vision.VisionDataConfig(batch_size=16, seed=5), num_batches=4)
  images, labels = vision.load_digits()
  held = vision.split_ids(CFG)[1]
  # 64 of 364 held-out images, at eval positions floor(j * 364 / 64).
  ids = held[np.arange(64) * 364 // 64]
  np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in batches]), images[ids])
  np.testing.assert_array_equal(np.concatenate([b["targets"] for b in batches]), labels[ids])
  for x, y in zip(batches, again):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
  with pytest.raises(ValueError, match="364"):
    vision.eval_batches(CFG, num_batches=23)  # 23 x 16 = 368 > 364.


def test_config_validation():
  with pytest.raises(ValueError):
    vision.VisionDataConfig(eval_fraction=0.0)
  with pytest.raises(ValueError):
    vision.VisionDataConfig(max_shift=8)
  with pytest.raises(ValueError):
    vision.VisionDataConfig(noise_std=-0.1)
