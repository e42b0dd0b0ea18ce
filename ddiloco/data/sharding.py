"""One shard's endless, per-epoch-shuffled stream of example ids, as a random-access grain source.

Shared by the text pipeline (ids are token windows) and the image pipeline (ids are images). docs/algorithm.md §1:
every learner owns its data shard; the shard is reshuffled every epoch with a permutation seeded by
(*seed_key, epoch), repeated forever, and batches run on across epoch boundaries. Because the source
is random access (batch k is a pure function of k), grain's iterator state is just the batch index,
which is what makes the pipelines checkpointable and a restored learner reproduce its batches.
"""

import sys
import threading
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np


class ShardBatchIds:
  """grain data source: element k is the example ids of batch k of one shard's endless stream.

  Position p of the stream is `perm[epoch][p % n]` with epoch = p // n and
  `perm[epoch] = ids[default_rng([*seed_key, epoch]).permutation(n)]`; batch k covers positions
  [k*B, (k+1)*B), so a batch that straddles an epoch boundary takes its tail from the next epoch.

  Args:
    ids: the shard's example ids (any order; n = ids.size >= 1).
    batch_size: ids per batch (B >= 1).
    seed_key: the shard's seed words, e.g. (seed, num_shards, shard_index); the epoch is appended.

  Raises:
    ValueError: for an empty or non-1-D `ids`, or a batch size below 1.
  """

  def __init__(self, ids: np.ndarray, *, batch_size: int, seed_key: tuple[int, ...]):
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"ids must be a non-empty 1-D array, got shape {ids.shape}.")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    self._ids = ids
    self._batch_size = batch_size
    self._seed_key = tuple(seed_key)
    self._perms: dict[int, np.ndarray] = {}  # The two most recent epochs; one shuffle per epoch.
    self._lock = threading.Lock()  # grain may read from several threads (num_threads > 0).

  def __len__(self) -> int:
    return sys.maxsize  # Endless: batches run on across epochs.

  def _perm(self, epoch: int) -> np.ndarray:
    with self._lock:
      perm = self._perms.get(epoch)
      if perm is None:
        rng = np.random.default_rng([*self._seed_key, epoch])
        perm = self._ids[rng.permutation(self._ids.size)]
        self._perms[epoch] = perm
        # Batches are read in order, so at most two epochs are live; keep memory at O(2n).
        for old in sorted(self._perms)[:-2]:
          del self._perms[old]
      return perm

  def __getitem__(self, k: int) -> np.ndarray:
    """Returns batch k's ids, int64 [B]."""
    n = self._ids.size
    pos = k * self._batch_size + np.arange(self._batch_size, dtype=np.int64)
    epochs, within = np.divmod(pos, n)
    out = np.empty(self._batch_size, dtype=np.int64)
    for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):
      mask = epochs == epoch
      out[mask] = self._perm(epoch)[within[mask]]
    return out


class CheckedShardIterator(grain.DatasetIterator):
  """A grain iterator over one shard's batches, with a self-describing, checked state.

  `get_state()` is JSON-serializable: grain's batch index plus the settings that define the stream
  (`identity`), so that restoring a state into an iterator over a different stream fails loudly
  instead of silently training on other data. The text and vision pipelines share it.
  """

  def __init__(self, parent: grain.DatasetIterator, identity: Mapping[str, Any]):
    super().__init__(parent)
    self._identity = dict(identity)

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return {"next_index": int(self._parent.get_state()["next_index"]), **self._identity}

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes at `state`; the next batches (augmentation included) equal the saver's.

    Raises:
      ValueError: if the state was saved by an iterator over a different stream.
    """
    wrong = {k: (state.get(k), v) for k, v in self._identity.items() if state.get(k) != v}
    if wrong:
      raise ValueError(f"iterator state does not match this stream (saved, expected): {wrong}")
    self._parent.set_state({"next_index": int(state["next_index"])})
