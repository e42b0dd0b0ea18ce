"""Tests for ddiloco.fragments.tree."""

import collections

import jax
import numpy as np
import pytest

from ddiloco.fragments.tree import flatten, path_str, unflatten

Point = collections.namedtuple("Point", ["x", "y"])


def _tree():
  return {
    "params": {
      "block_1": {"w": np.ones(2), "b": np.zeros(1)},
      "embed": [np.arange(3), (np.arange(2), np.ones(1))],
    },
    "pt": Point(x=np.float32(1), y=np.float32(2)),
  }


def test_flatten_names_and_order():
  flat = flatten(_tree())
  # Dict keys, list/tuple indices and namedtuple field names joined by "/", sorted by path.
  assert list(flat) == [
    "params/block_1/b",
    "params/block_1/w",
    "params/embed/0",
    "params/embed/1/0",
    "params/embed/1/1",
    "pt/x",
    "pt/y",
  ]
  np.testing.assert_array_equal(flat["params/embed/1/0"], np.arange(2))


def test_round_trip():
  tree = _tree()
  again = unflatten(flatten(tree), like=tree)
  assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(tree)
  for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(tree), strict=True):
    assert a is b


def test_path_str():
  (path, _), *_ = jax.tree_util.tree_flatten_with_path({"a": [{"b": 1}]})[0]
  assert path_str(path) == "a/0/b"
  assert path_str(()) == ""


def test_errors():
  with pytest.raises(ValueError, match="share the path 'a/b'"):
    flatten({"a/b": 1, "a": {"b": 2}})
  tree = _tree()
  flat = flatten(tree)
  missing = {k: v for k, v in flat.items() if k != "pt/x"}
  with pytest.raises(KeyError, match="Missing 1 leaves, first 'pt/x'"):
    unflatten(missing, like=tree)
  with pytest.raises(ValueError, match="Unknown leaves"):
    unflatten({**flat, "zzz": 1}, like=tree)
