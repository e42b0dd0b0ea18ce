"""Pre-tokenized corpora for training: grain batches of a corpus folder (data/token_corpus.py).

The stream, and who reads what. The train split's N examples are read in a global order of
positions g = 0, 1, 2, ...: position g holds example `perm_e[g mod N]` of epoch e = g // N, with
`perm_e` a permutation seeded by (seed, e). A learner in slot m of M (`shard_index`,
`num_shards`; the learner factory gives learner i slot i mod M) reads the positions
g ≡ m (mod M) in increasing order, from its start position; batch k holds the next B of them.
The iterator's state is the next position it would read, with the slot it read it in
(`TokenShardIterator.get_state`), never a batch number.

Rule for a learner that restarts, joins or leaves (`resume_position`). A learner given a position
g (its own checkpoint's, or another learner's) continues at the first position >= g in its own
slot: g itself when the slot count and the slot are unchanged, whatever the batch sizes. A learner
without any position starts at its slot's first position m. The runtimes give a restarted learner
the position its own checkpoint holds (checkpoint/learner.py; the simulator keeps a restarted
learner's iterator, as if it checkpointed every step: simulation/slot.py); a learner without a
checkpoint of its own starts fresh, and one given a peer's state (`set_state`) continues after
that peer.

What that guarantees (tests/data/token_shards_test.py checks each on a ledger of the positions
every learner read):
- While the slot count M is unchanged, no position is read twice: slots are disjoint residues
  mod M and each reads its own in increasing order. A restart with another batch size skips and
  repeats nothing: positions are counted in examples, not batches.
- When the fleet changes from M to M' slots (a learner joins or leaves, or the run restarts with
  another number of learners), every slot of the new fleet has a learner, and each continues from
  a position of the old fleet (its own, or a peer's for a newcomer), let L and H be the lowest and
  highest next positions of the old slots. The change repeats or skips only positions in
  [L, H + M'): at most H - L + M' of them. Below L nothing changes; from H + M' on every position
  is read exactly once. Learners at the same step with the same batch size have H - L < M, so at
  most M + M' - 1.
- A slot without a learner is not read: a learner that leaves for good while M stays leaves 1/M
  of the stream unread from then on; a restart of the fleet with M' = M - 1 slots closes the gap
  within the bound above.
- The slot count is the factory's `num_shards`. The simulator takes `RunConfig.data_slots` when
  set, and otherwise counts a slot for every learner that can ever join (`ClusterConfig.num_shards`),
  so a joining learner reads positions no one else reads. A distributed run has `RunConfig.the_data_slots()` slots (`data_slots`, default
  M = `num_learners`): a learner added with an id below it reads a slot of its own, and one added
  beyond it (`ddiloco-fleet add`) shares slot id mod the slots with a running learner and reads
  the same positions (the launcher warns): leave slots to spare, or restart the fleet with the
  larger M, within the bound above.
- A learner without a position (a fresh start, no checkpoint) reads its slot from the stream's
  start again: it repeats rather than skips, as the other pipelines do.
A repeated position is a repeated example; a skipped position is an example that epoch lacks.
Across epochs every example comes back once per epoch, as with any repeat.

Memory: one permutation of N int64 per live epoch (two at most), 8 N bytes each.
"""

import dataclasses
import sys
import threading
from typing import Any

import grain
import numpy as np

from ddiloco.data.token_corpus import CorpusInfo, read_info
from ddiloco.types import check_int_fields

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenShardDataConfig:
  """A pre-tokenized corpus and how a learner batches it. Bound from gin as
  `ddiloco.TokenShardDataConfig.<field>`; `RunConfig.data = @TokenShardDataConfig()` trains the
  text transformer on it.

  Attributes:
    path: the corpus folder (`tokens.json` and the ArrayRecord files); every process of a run
      reads it.
    batch_size: windows per batch; a learner's batch override replaces it.
    seq_len: None, or the corpus's window length - 1 (a check that the run reads the corpus it
      was written for).
    seed: the order's seed, in [0, 2**32).
  """

  path: str
  batch_size: int = 8
  seq_len: int | None = None
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.path, str) or not self.path:  # gin.REQUIRED left unbound, or None.
      raise ValueError("TokenShardDataConfig.path must name a corpus folder: bind it.")
    check_int_fields(self)
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}.")
    info = read_info(self.path)
    if self.seq_len is not None and self.seq_len != info.window_len - 1:
      raise ValueError(
        f"seq_len={self.seq_len}, but {self.path} holds windows of {info.window_len} tokens "
        f"(seq_len {info.window_len - 1})."
      )

  def info(self) -> CorpusInfo:
    return read_info(self.path)


# -- the stream -----------------------------------------------------------------------------------


def resume_position(position: int, shard_index: int, num_shards: int) -> int:
  """The first position >= `position` in slot `shard_index` of `num_shards` (the module's rule)."""
  if num_shards < 1 or not 0 <= shard_index < num_shards:
    raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index} and {num_shards}.")
  return position + (shard_index - position) % num_shards


class EpochOrder:
  """Position g -> example `perm_e[g mod N]`, e = g // N, `perm_e` seeded by (seed, e)."""

  def __init__(self, num_examples: int, seed: int):
    self.num_examples = num_examples
    self._seed = seed
    self._perms: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()  # grain may read from several threads.

  def _perm(self, epoch: int) -> np.ndarray:
    with self._lock:
      perm = self._perms.get(epoch)
      if perm is None:
        perm = np.random.default_rng([self._seed, epoch]).permutation(self.num_examples)
        self._perms[epoch] = perm
        for old in sorted(self._perms)[:-2]:  # Positions are read in order: two epochs live.
          del self._perms[old]
      return perm

  def examples(self, positions: np.ndarray) -> np.ndarray:
    """The example ids at `positions` (int64)."""
    epochs, within = np.divmod(positions, self.num_examples)
    out = np.empty(positions.shape, np.int64)
    for epoch in np.unique(epochs):
      mask = epochs == epoch
      out[mask] = self._perm(int(epoch))[within[mask]]
    return out


def slot_positions(start: int, num_shards: int, batch_size: int, k: int) -> np.ndarray:
  """The positions of batch k of a slot that starts at `start`: start + (kB + j) M, j < B."""
  return start + (k * batch_size + np.arange(batch_size, dtype=np.int64)) * num_shards


class _SlotBatches:
  """grain source: element k is the example ids of batch k of one slot's stream."""

  def __init__(self, order: EpochOrder, *, start: int, num_shards: int, batch_size: int):
    self._order, self._start, self._m, self._b = order, start, num_shards, batch_size

  def __len__(self) -> int:
    return sys.maxsize  # Endless.

  def __getitem__(self, k: int) -> np.ndarray:
    return self._order.examples(slot_positions(self._start, self._m, self._b, k))


class _ReadWindows(grain.transforms.Map):
  """Example ids [B] -> {"inputs", "targets"} int32 [B, L], read from the ArrayRecord files."""

  def __init__(self, source: Any, dtype: str, window_len: int):
    self._source = source
    self._dtype = np.dtype(dtype).newbyteorder("<")
    self._window_len = window_len

  def map(self, element: np.ndarray) -> Batch:
    records = self._source.__getitems__([int(i) for i in element])
    windows_BxW = np.frombuffer(b"".join(records), self._dtype).reshape(len(records), -1)
    if windows_BxW.shape[1] != self._window_len:
      raise ValueError(f"A record holds {windows_BxW.shape[1]} ids, not {self._window_len}.")
    windows_BxW = windows_BxW.astype(np.int32)
    return {"inputs": windows_BxW[:, :-1], "targets": windows_BxW[:, 1:]}


def _source(info: CorpusInfo, split: str) -> Any:
  return grain.sources.ArrayRecordDataSource(list(info.files[split]))


class TokenShardIterator(grain.DatasetIterator):
  """One learner's endless batches of a corpus (the module's stream), checkpointable.

  `get_state()` is JSON: the next position, the slot it belongs to, the batch size and the corpus
  and seed. `set_state` takes the state of any slot count, slot and batch size of the same corpus
  and seed, and continues at `resume_position` of it (the module's rule).
  """

  def __init__(
    self, config: TokenShardDataConfig, *, shard_index: int, num_shards: int, batch_size: int
  ):
    super().__init__()
    self._info = config.info()
    self._order = EpochOrder(self._info.examples["train"], config.seed)
    self._source = _source(self._info, "train")
    self._seed = config.seed
    self._slot, self._num_shards, self._batch_size = shard_index, num_shards, batch_size
    self._start(resume_position(0, shard_index, num_shards))

  def _start(self, start: int) -> None:
    self._first = start
    batches = _SlotBatches(
      self._order, start=start, num_shards=self._num_shards, batch_size=self._batch_size
    )
    dataset = grain.MapDataset.source(batches).map(
      _ReadWindows(self._source, self._info.dtype, self._info.window_len)
    )
    self._inner = iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0)))

  def __next__(self) -> Batch:
    return next(self._inner)

  def next_positions(self) -> np.ndarray:
    """The positions the next batch holds (what a data ledger books for it)."""
    k = int(self._inner.get_state()["next_index"])
    return slot_positions(self._first, self._num_shards, self._batch_size, k)

  def position(self) -> int:
    """The next position this iterator reads."""
    return int(self.next_positions()[0])

  def get_state(self) -> dict[str, Any]:
    return {
      "position": self.position(),
      "shard_index": self._slot,
      "num_shards": self._num_shards,
      "batch_size": self._batch_size,
      "corpus": self._info.fingerprint,
      "seed": self._seed,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues after `state`'s position, in this iterator's slot (the module's rule).

    Raises:
      ValueError: for a state of another corpus or seed, or one without a position.
    """
    theirs = (state.get("corpus"), state.get("seed"))
    if theirs != (self._info.fingerprint, self._seed) or "position" not in state:
      raise ValueError(
        f"iterator state does not match this stream: corpus and seed {theirs}, expected "
        f"{(self._info.fingerprint, self._seed)}."
      )
    self._start(resume_position(int(state["position"]), self._slot, self._num_shards))


def stream_position(data: Any) -> dict[str, int] | None:
  """Where a data iterator is, for one that reads numbered positions (`TokenShardIterator`):
  the next `position`, its `slot` of `slots` (a learner summary's "data"); None for others."""
  if not hasattr(data, "position"):
    return None
  state = data.get_state()
  return {
    "position": int(state["position"]),
    "slot": int(state["shard_index"]),
    "slots": int(state["num_shards"]),
  }


def make_train_iterator(
  config: TokenShardDataConfig, *, shard_index: int, num_shards: int, batch_size: int | None = None
) -> TokenShardIterator:
  """An endless, checkpointable iterator over slot `shard_index` of `num_shards` (module docstring).

  Raises:
    ValueError: for a bad slot or batch size.
  """
  batch_size = config.batch_size if batch_size is None else batch_size
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  resume_position(0, shard_index, num_shards)  # Checks the slot.
  return TokenShardIterator(
    config, shard_index=shard_index, num_shards=num_shards, batch_size=batch_size
  )


def eval_batches(
  config: TokenShardDataConfig, *, num_batches: int, batch_size: int | None = None
) -> list[Batch]:
  """Fixed batches of the eval split: windows floor(j n / (num_batches B)), spread over it.

  Raises:
    ValueError: if the eval split holds fewer than num_batches x B windows.
  """
  batch_size = config.batch_size if batch_size is None else batch_size
  if num_batches < 1 or batch_size < 1:
    raise ValueError(f"num_batches and batch_size must be >= 1, got {num_batches}, {batch_size}.")
  info = config.info()
  available, wanted = info.examples["eval"], num_batches * batch_size
  if wanted > available:
    raise ValueError(
      f"{config.path}'s eval split holds {available} windows; {num_batches} x {batch_size} = "
      f"{wanted} requested."
    )
  ids = np.arange(wanted, dtype=np.int64) * available // wanted
  read = _ReadWindows(_source(info, "eval"), info.dtype, info.window_len)
  return [read.map(chunk) for chunk in ids.reshape(num_batches, batch_size)]


@dataclasses.dataclass(frozen=True)
class DataLedger:
  """Which stream positions a run's learners read (`data_ledger`), up to `end`, the furthest.

  Attributes:
    end: one past the furthest position any learner read.
    read: positions read at least once.
    repeated: positions read more than once.
    unread: positions below `end` nobody read, by slot (slot -> count; the slot count of the
      learner that read furthest).
  """

  end: int
  read: int
  repeated: int
  unread: dict[int, int]


def data_ledger(segments: list[tuple[int, int, int, int]]) -> DataLedger:
  """The ledger of (slot, slots, start, end) segments: a learner of slot `slot` of `slots` read
  the positions p ≡ slot (mod slots) with start <= p < end, in order (this module's rule; a
  learner's summary.json has them as "data").

  Raises:
    ValueError: on a segment that is not a slot of its slots, or that ends before it starts.
  """
  end = 0
  for slot, slots, start, stop in segments:
    if not (0 <= slot < slots and 0 <= start <= stop):
      raise ValueError(f"Not a data segment: slot {slot} of {slots}, positions [{start}, {stop}).")
    end = max(end, stop)
  counts = np.zeros(end, np.int64)
  for slot, slots, start, stop in segments:
    first = start + (slot - start) % slots
    counts[first:stop:slots] += 1
  slots = max((s[1] for s in segments), default=1)
  never = np.flatnonzero(counts == 0)
  unread = {int(k): int(v) for k, v in zip(*np.unique(never % slots, return_counts=True))}
  return DataLedger(
    end=end, read=int((counts > 0).sum()), repeated=int((counts > 1).sum()), unread=unread
  )
