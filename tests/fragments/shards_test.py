"""Tests of the fragment → syncer shard rule."""

import pytest

from ddiloco.fragments import shards


@pytest.mark.parametrize("num_shards,num_fragments", [(1, 1), (1, 7), (2, 7), (3, 9), (4, 4)])
def test_shards_partition_the_fragments(num_shards, num_fragments):
  parts = [shards.owned(s, num_shards, num_fragments) for s in range(num_shards)]
  assert set().union(*parts) == set(range(num_fragments))
  assert sum(len(p) for p in parts) == num_fragments  # Disjoint.
  assert all(parts), "every shard owns a fragment"
  assert max(map(len, parts)) - min(map(len, parts)) <= 1  # Balanced.
  for s, part in enumerate(parts):
    assert all(shards.shard_of(p, num_shards) == s for p in part)


def test_one_shard_owns_everything():
  assert shards.owned(0, 1, 5) == frozenset(range(5))


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda: shards.owned(0, 0, 4), ">= 1"),
    (lambda: shards.owned(0, 5, 4), "exceeds the 4 fragments"),
    (lambda: shards.owned(2, 2, 4), "out of range"),
    (lambda: shards.owned(-1, 2, 4), "out of range"),
    (lambda: shards.shard_of(-1, 2), ">= 0"),
    (lambda: shards.shard_of(3, 0), ">= 1"),
  ],
)
def test_bad_shards_are_refused(call, match):
  with pytest.raises(ValueError, match=match):
    call()
