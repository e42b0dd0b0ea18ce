"""Tests of ddiloco/checkpoint/global_model.py: the syncer's global model read from its folders.

The folders are written as the syncer's runtime writes them (`testing.syncer_folders`): versions
published to the version log and the journal, a checkpoint of the core, later versions after it.
"""

import os

import numpy as np
import pytest

from ddiloco.checkpoint import global_model
from ddiloco.checkpoint.journal import JOURNAL_NAME
from ddiloco.checkpoint.version_log import VERSION_LOG_DIR
from ddiloco.fragments.layout import make_layout
from ddiloco.testing.syncer_folders import write_syncer_folder

SHAPES = {"a/kernel": (6, 3), "a/scale": (3,), "b/kernel": (3, 4), "c": (5,)}


def _layout(**kwargs):
  shapes = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
  return make_layout(shapes, **{"num_fragments": 2, **kwargs})


def _values(layout, p, fill):
  """Fragment p's values, every entry `fill` plus its position (so pieces are told apart)."""
  return {
    k: (fill + np.arange(np.prod(layout.shapes[k]))).reshape(layout.shapes[k]).astype(np.float32)
    for k in layout.fragments[p]
  }


def _init(layout):
  return {k: v for p in range(layout.num_fragments) for k, v in _values(layout, p, 0.0).items()}


def _expected(layout, fills):
  """Flat leaves of the model whose fragment p holds `_values(layout, p, fills[p])`."""
  keyed = {k: v for p, fill in fills.items() for k, v in _values(layout, p, fill).items()}
  return global_model.join_pieces(keyed)


def _assert_params(got, expected):
  assert sorted(got) == sorted(expected)
  for k, v in expected.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_newest_published_model_takes_the_merges_after_the_checkpoint_from_the_version_log(
  tmp_path,
):
  layout = _layout()
  folder = str(tmp_path / "syncer")
  write_syncer_folder(
    folder,
    layout,
    _init(layout),
    checkpointed={0: [_values(layout, 0, 10.0)], 1: [_values(layout, 1, 20.0)]},
    later={1: [_values(layout, 1, 30.0), _values(layout, 1, 40.0)]},
  )
  model = global_model.read_global_model(str(tmp_path))  # The run folder: syncer/ inside.
  assert model.versions == {0: 1, 1: 3}
  assert model.behind == {}
  assert model.steps == (1,) and model.folders == (folder,)
  _assert_params(model.params, _expected(layout, {0: 10.0, 1: 40.0}))
  # A checkpoint step: exactly what it holds, whatever was merged later.
  at_one = global_model.read_global_model(folder, step=1)
  assert at_one.versions == {0: 1, 1: 1}
  _assert_params(at_one.params, _expected(layout, {0: 10.0, 1: 20.0}))


def test_without_the_version_log_a_fragment_is_read_at_its_checkpoint_and_listed_behind(tmp_path):
  layout = _layout()
  write_syncer_folder(
    str(tmp_path),
    layout,
    _init(layout),
    checkpointed={0: [_values(layout, 0, 10.0)]},
    later={0: [_values(layout, 0, 50.0)]},
    version_log=False,
  )
  model = global_model.read_global_model(str(tmp_path))  # A syncer's own folder.
  assert model.versions == {0: 1, 1: 0}
  assert model.behind == {0: (1, 2)}
  _assert_params(model.params, _expected(layout, {0: 10.0, 1: 0.0}))


def test_reading_creates_and_removes_nothing(tmp_path):
  layout = _layout()
  write_syncer_folder(
    str(tmp_path), layout, _init(layout), checkpointed={0: [_values(layout, 0, 1.0)]}
  )
  # A save in flight (orbax's temporary folder) must survive a reader.
  partial = tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1"
  partial.mkdir()
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  global_model.read_global_model(str(tmp_path))
  after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  assert after == before


def test_sharded_syncer_folders_make_one_model_and_pieces_are_joined(tmp_path):
  layout = _layout(num_fragments=4, split_large=True)
  assert any("@" in k for keys in layout.fragments for k in keys)  # "a/kernel" is in pieces.
  fills = {p: 100.0 * (p + 1) for p in range(4)}
  init = _init(layout)
  for shard, name in enumerate(("syncer", "syncer_1")):
    owned = {p for p in range(4) if p % 2 == shard}
    write_syncer_folder(
      str(tmp_path / name),
      layout,
      {k: v for p in owned for k, v in _values(layout, p, 0.0).items()},
      checkpointed={p: [_values(layout, p, fills[p])] for p in owned},
      owned=owned,
    )
  model = global_model.read_global_model(str(tmp_path))
  assert model.versions == {0: 1, 1: 1, 2: 1, 3: 1}
  assert len(model.folders) == 2
  _assert_params(model.params, _expected(layout, fills))
  assert model.params["a/kernel"].shape == SHAPES["a/kernel"]
  assert init.keys() == {k for keys in layout.fragments for k in keys}
  with pytest.raises(ValueError, match="2 syncer shards"):
    global_model.read_global_model(str(tmp_path), step=1)


def test_tree_nests_the_leaves_as_flax_holds_them():
  tree = global_model.nest({"a/kernel": 1, "a/scale": 2, "c": 3})
  assert tree == {"a": {"kernel": 1, "scale": 2}, "c": 3}
  with pytest.raises(ValueError, match="is a leaf and a folder"):
    global_model.nest({"a": 1, "a/b": 2})


def test_pieces_with_a_gap_are_refused():
  with pytest.raises(ValueError, match="leave rows from 2 to 3 uncovered"):
    global_model.join_pieces({"x@0:2": np.zeros((2, 1)), "x@3:5": np.zeros((2, 1))})


@pytest.mark.parametrize(
  "make, error, message",
  [
    (lambda d: None, FileNotFoundError, "neither a run folder"),
    (lambda d: os.makedirs(os.path.join(d, "checkpoints")), FileNotFoundError, "no complete"),
    (
      lambda d: os.makedirs(os.path.join(d, "syncer_2")) or os.makedirs(os.path.join(d, "syncer")),
      FileNotFoundError,
      r"shards \[2\] beside syncer/",
    ),
  ],
)
def test_folders_without_a_model_are_named(tmp_path, make, error, message):
  make(str(tmp_path))
  with pytest.raises(error, match=message):
    global_model.read_global_model(str(tmp_path))


def test_an_unknown_step_lists_the_steps_there_are(tmp_path):
  layout = _layout()
  write_syncer_folder(
    str(tmp_path),
    layout,
    _init(layout),
    checkpointed={0: [_values(layout, 0, 1.0), _values(layout, 0, 2.0)]},
    checkpoints=2,
  )
  assert os.path.isfile(tmp_path / JOURNAL_NAME) and os.path.isdir(tmp_path / VERSION_LOG_DIR)
  with pytest.raises(ValueError, match=r"has no checkpoint 5; it has steps \[1, 2\]"):
    global_model.read_global_model(str(tmp_path), step=5)
  first = global_model.read_global_model(str(tmp_path), step=1)
  assert first.versions == {0: 1, 1: 0}
