"""Slices: a fragment (a group) cut into S byte-balanced slices, one per syncer shard
(fragments/layout.py's module docstring, docs/architecture.md "The sharded syncer")."""

import itertools
from collections.abc import Sequence

from ddiloco.fragments.layout import PIECE_SEPARATOR, _lpt, _nbytes, parse_key


def _cut(key: str, shape: tuple[int, ...], num_pieces: int) -> list[tuple[str, tuple[int, ...]]]:
  """Cuts item `key` (a leaf or a piece of one) along axis 0 into `num_pieces` near-equal pieces
  (the first rows % k get one extra row, as np.array_split), as piece keys of its leaf."""
  leaf, offset, _ = parse_key(key)
  offset = offset or 0
  base, extra = divmod(shape[0], num_pieces)
  sizes = [base + (i < extra) for i in range(num_pieces)]
  return [
    (f"{leaf}{PIECE_SEPARATOR}{offset + start}:{offset + stop}", (stop - start, *shape[1:]))
    for start, stop in itertools.pairwise(itertools.accumulate(sizes, initial=0))
  ]


def slice_group(
  p: int,
  keys: Sequence[str],
  shapes: dict[str, tuple[int, ...]],
  dtypes: dict[str, str],
  slices: int,
) -> list[list[str]]:
  """Cuts group `p` into `slices` byte-balanced slices (module docstring); updates `shapes` and
  `dtypes` in place for the pieces it cuts.

  Raises:
    ValueError: if the group cannot be cut into `slices` non-empty slices (too few rows).
  """
  total = sum(_nbytes(shapes[k], dtypes[k]) for k in keys)
  items: dict[str, tuple[int, ...]] = {}
  for key in keys:
    shape, dtype = shapes.pop(key), dtypes.pop(key)
    size = _nbytes(shape, dtype)
    num_pieces = min(-(-size * slices // total), shape[0]) if shape and total else 1
    for k, s in _cut(key, shape, num_pieces) if num_pieces > 1 else [(key, shape)]:
      items[k], dtypes[k] = s, dtype
  while len(items) < slices:
    cuttable = [k for k, s in items.items() if s and s[0] >= 2]
    if not cuttable:
      raise ValueError(
        f"Fragment {p} cannot be cut into {slices} slices (one per syncer shard): its "
        f"{len(items)} tensor(s) have too few rows. Use fewer syncer shards or fewer fragments."
      )
    key = max(cuttable, key=lambda k: (_nbytes(items[k], dtypes[k]), k))
    dtype = dtypes.pop(key)
    for k, s in _cut(key, items.pop(key), 2):
      items[k], dtypes[k] = s, dtype
  shapes.update(items)
  assignment: list[list[str]] = [[] for _ in range(slices)]
  _lpt([(k, _nbytes(s, dtypes[k])) for k, s in sorted(items.items())], [0] * slices, assignment)
  return assignment
