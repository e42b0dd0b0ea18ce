"""Tests for ddiloco.data.text: corpus, split, windows, shards, grain iterators."""

import json
import math

import numpy as np
import pytest

from ddiloco.data import text, tokenizers

BYTE = text.TextDataConfig()  # seq_len 128, batch 8, byte tokenizer, 5 % held out.
# Long windows keep the window count small (~1.2k train windows) for exhaustive shard checks.
LONG = text.TextDataConfig(seq_len=4095, batch_size=5)


def _window_lookup(config):
  """Maps a window's bytes to its train window id."""
  stream = text.token_stream(config, "train")
  n, w = text.num_windows(config, "train"), config.window_len
  windows = stream[: n * w].reshape(n, w)
  return {row.tobytes(): i for i, row in enumerate(windows)}


def _batch_window_ids(batch, lookup):
  windows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
  return [lookup[row.tobytes()] for row in windows]


def test_38_plays_sorted_and_cleaned():
  plays = text.shakespeare_plays()
  names = [name for name, _ in plays]
  assert len(plays) == 38
  assert names == sorted(names) and len(set(names)) == 38
  assert {"hamlet", "macbeth", "the-tempest", "edward-iii"} <= set(names)
  for name, body in plays:
    assert len(body) > 50_000, name  # The shortest play (The Comedy of Errors) is ~90 kB.
    assert "**" not in body and "_" not in body and "\\[" not in body, name
  hamlet = dict(plays)["hamlet"]
  assert hamlet.startswith("Hamlet\n")
  assert "HAMLET:\nTo be, or not to be: that is the question:\n" in hamlet
  plays.pop()  # The returned list is a copy; the cache is not affected.
  assert len(text.shakespeare_plays()) == 38


def test_clean_markdown_rules():
  md = "# Macbeth\n\n## ACT I\n\n\n\n_Enter \\[Aside]_  \n\n**First Witch**  \nWhen shall we  \n"
  assert text.clean_markdown(md) == (
    "Macbeth\n\nACT I\n\nEnter [Aside]\n\nFirst Witch:\nWhen shall we\n"
  )


@pytest.mark.parametrize(
  "kwargs",
  [
    {"seq_len": 0},
    {"batch_size": 0},
    {"tokenizer": "gpt2"},
    {"eval_fraction": 1.0},
    {"eval_fraction": -0.1},
    {"seed": -1},
    {"seed": 2**32},
    {"num_threads": -1},
  ],
)
def test_config_validation(kwargs):
  with pytest.raises(ValueError):
    text.TextDataConfig(**kwargs)


def test_config_is_gin_configurable():
  from ddiloco.launch import configurables

  try:
    configurables.parse([], ["ddiloco.TextDataConfig.seq_len = 64"])
    assert configurables.configured(text.TextDataConfig)().seq_len == 64
    assert text.TextDataConfig().seq_len == 128  # A direct call ignores gin.
  finally:
    configurables.clear()
  assert configurables.configured(text.TextDataConfig)().seq_len == 128


def test_spans_split_every_play_disjointly():
  spans = text.play_spans(BYTE)
  tok = tokenizers.ByteTokenizer()
  plays = text.shakespeare_plays()
  assert [s.name for s in spans] == [name for name, _ in plays]
  start = 0
  for span, (_, body) in zip(spans, plays):
    n = len(tok.encode(body))
    assert span.start == start and span.end == start + n  # Contiguous, covering the corpus.
    assert span.end - span.eval_start == math.ceil(0.05 * n)  # Held-out tail of this play.
    assert span.start < span.eval_start < span.end
    start = span.end
  train = text.token_stream(BYTE, "train")
  held_out = text.token_stream(BYTE, "eval")
  assert len(train) == sum(s.eval_start - s.start for s in spans)
  assert len(held_out) == sum(s.end - s.eval_start for s in spans)
  assert len(train) + len(held_out) == start
  # Content: each split is exactly its slices of the independently tokenized corpus.
  corpus = np.concatenate([tok.encode(body) for _, body in plays])
  np.testing.assert_array_equal(
    train, np.concatenate([corpus[s.start : s.eval_start] for s in spans])
  )
  np.testing.assert_array_equal(
    held_out, np.concatenate([corpus[s.eval_start : s.end] for s in spans])
  )
  assert not train.flags.writeable  # The cached stream cannot be corrupted by a caller.
  with pytest.raises(ValueError, match="split"):
    text.token_stream(BYTE, "test")


def _corpus_positions(spans, split, stream_positions):
  """Maps positions in a split's stream to corpus positions, through the per-play pieces."""
  if split == "train":
    lo = np.array([s.start for s in spans])
    hi = np.array([s.eval_start for s in spans])
  else:
    lo = np.array([s.eval_start for s in spans])
    hi = np.array([s.end for s in spans])
  piece_start = np.concatenate([[0], np.cumsum(hi - lo)])
  piece = np.searchsorted(piece_start, stream_positions, side="right") - 1
  return lo[piece] + (stream_positions - piece_start[piece])


def test_eval_windows_never_touch_train_tokens():
  spans = text.play_spans(BYTE)
  w = BYTE.window_len
  in_train = np.zeros(spans[-1].end, bool)
  for s in spans:
    in_train[s.start : s.eval_start] = True
  eval_positions = np.arange(text.num_windows(BYTE, "eval") * w)
  train_positions = np.arange(text.num_windows(BYTE, "train") * w)
  assert not in_train[_corpus_positions(spans, "eval", eval_positions)].any()
  assert in_train[_corpus_positions(spans, "train", train_positions)].all()


def test_shards_partition_the_windows():
  n = text.num_windows(LONG, "train")
  assert n == len(text.token_stream(LONG, "train")) // 4096
  shards = [text.shard_window_ids(LONG, shard_index=s, num_shards=3) for s in range(3)]
  assert [len(ids) for ids in shards] == [len(range(s, n, 3)) for s in range(3)]
  assert all((ids % 3 == s).all() for s, ids in enumerate(shards))  # Rule: i % num_shards.
  np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n))
  with pytest.raises(ValueError, match="shard_index"):
    text.shard_window_ids(LONG, shard_index=3, num_shards=3)
  with pytest.raises(ValueError, match="holds no window"):
    text.shard_window_ids(LONG, shard_index=n, num_shards=n + 1)


def test_iterators_cover_each_shard_once_per_epoch():
  lookup = _window_lookup(LONG)
  seen = []
  for shard in range(3):
    ids = text.shard_window_ids(LONG, shard_index=shard, num_shards=3)
    it = text.make_train_iterator(LONG, shard_index=shard, num_shards=3)
    num_batches = 2 * math.ceil(len(ids) / 5) + 1  # Two epochs and a bit, in batches of 5.
    drawn = [i for _ in range(num_batches) for i in _batch_window_ids(next(it), lookup)]
    first, second = drawn[: len(ids)], drawn[len(ids) : 2 * len(ids)]
    np.testing.assert_array_equal(np.sort(first), ids)  # Epoch 1: every shard window once.
    np.testing.assert_array_equal(np.sort(second), ids)  # Epoch 2 too ...
    assert first != second  # ... in a fresh order (reshuffled per epoch).
    seen.extend(first)
  np.testing.assert_array_equal(np.sort(seen), np.arange(len(lookup)))


def test_batch_shapes_and_shifted_targets():
  stream = text.token_stream(BYTE, "train")
  it = text.make_train_iterator(BYTE, shard_index=0, num_shards=8)
  lookup = _window_lookup(BYTE)
  for _ in range(3):
    batch = next(it)
    assert set(batch) == {"inputs", "targets"}
    assert batch["inputs"].shape == batch["targets"].shape == (8, 128)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    for row, i in enumerate(_batch_window_ids(batch, lookup)):
      assert i % 8 == 0  # Shard 0 of 8.
      np.testing.assert_array_equal(batch["inputs"][row], stream[i * 129 : i * 129 + 128])
      np.testing.assert_array_equal(batch["targets"][row], stream[i * 129 + 1 : i * 129 + 129])
    assert text.tokens_per_batch(batch) == 8 * 128
  wide = next(text.make_train_iterator(BYTE, shard_index=0, num_shards=8, batch_size=3))
  assert wide["inputs"].shape == (3, 128)  # Per-learner batch size overrides the config.
  with pytest.raises(ValueError, match="batch_size"):
    text.make_train_iterator(BYTE, shard_index=0, num_shards=8, batch_size=0)


def _take(it, k):
  return [next(it) for _ in range(k)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["targets"], y["targets"])


def test_determinism_across_iterators_shards_and_seeds():
  batches = _take(text.make_train_iterator(BYTE, shard_index=1, num_shards=4), 4)
  _assert_same(batches, _take(text.make_train_iterator(BYTE, shard_index=1, num_shards=4), 4))
  other_shard = _take(text.make_train_iterator(BYTE, shard_index=2, num_shards=4), 4)
  other_seed = _take(
    text.make_train_iterator(text.TextDataConfig(seed=1), shard_index=1, num_shards=4), 4
  )
  for other in (other_shard, other_seed):
    assert not any(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(batches, other))


@pytest.mark.parametrize("threads", [0, 2])
def test_checkpoint_resumes_exactly(threads):
  config = text.TextDataConfig(num_threads=threads, prefetch_buffer_size=4 * threads)
  it = text.make_train_iterator(config, shard_index=3, num_shards=4, batch_size=16)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # Must survive JSON (grain/orbax checkpoints).
  assert state["next_index"] == 3
  expected = _take(it, 2)
  fresh = text.make_train_iterator(config, shard_index=3, num_shards=4, batch_size=16)
  fresh.set_state(state)
  _assert_same(_take(fresh, 2), expected)
  assert fresh.get_state()["next_index"] == 5


def test_checkpoint_rejects_other_stream():
  state = text.make_train_iterator(BYTE, shard_index=0, num_shards=4).get_state()
  other = text.make_train_iterator(BYTE, shard_index=1, num_shards=4)
  with pytest.raises(ValueError, match="shard_index"):
    other.set_state(state)


def test_eval_batches_fixed_and_spread():
  batches = text.eval_batches(BYTE, num_batches=3, batch_size=4)
  _assert_same(batches, text.eval_batches(BYTE, num_batches=3, batch_size=4))
  held_out = text.token_stream(BYTE, "eval")
  n = text.num_windows(BYTE, "eval")
  ids = np.arange(12) * n // 12  # Evenly spread, distinct since n >= 12.
  assert len(set(ids.tolist())) == 12
  for b, batch in enumerate(batches):
    assert batch["inputs"].shape == (4, 128) and batch["inputs"].dtype == np.int32
    for row in range(4):
      start = ids[4 * b + row] * 129
      np.testing.assert_array_equal(batch["inputs"][row], held_out[start : start + 128])
      np.testing.assert_array_equal(batch["targets"][row], held_out[start + 1 : start + 129])
  with pytest.raises(ValueError, match="eval split holds"):
    text.eval_batches(BYTE, num_batches=n + 1, batch_size=1)


def test_bpe_pipeline():
  config = text.TextDataConfig(tokenizer="bpe", seq_len=32, batch_size=2)
  train = text.token_stream(config, "train")
  assert train.max() < tokenizers.BpeTokenizer().vocab_size
  # BPE packs ~3.7 bytes of English per token, so far fewer tokens than bytes.
  assert len(train) < len(text.token_stream(BYTE, "train")) / 3
  batch = next(text.make_train_iterator(config, shard_index=0, num_shards=2))
  assert batch["inputs"].shape == (2, 32)
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  assert len(text.eval_batches(config, num_batches=2)) == 2
