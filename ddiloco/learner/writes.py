"""The host values a fragment's apply writes into a learner's parameter leaves.

A fragment holds whole leaves and, for a tensor split along axis 0 (docs/algorithm.md §2), pieces
of one: those are written into the leaf's current value, read back from the devices.
"""

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ddiloco.fragments import layout as layout_lib


def leaf_values(
  values: Mapping[str, np.ndarray],
  leaves: Sequence,
  index: Mapping[str, int],
  read_leaf: Callable[[int], np.ndarray],
) -> dict[int, np.ndarray]:
  """{leaf index: its new host value} for a fragment's `values` keyed as the layout keys them.

  Args:
    values: the fragment's values (whole leaves and pieces).
    leaves: the learner's current leaves (their dtypes are kept).
    index: leaf path -> position in `leaves`.
    read_leaf: reads leaf i's current value to the host (for the leaves a piece is written into).
  """
  pieces: dict[str, list[tuple[int, int, np.ndarray]]] = {}
  whole: dict[int, np.ndarray] = {}
  for key, value in values.items():
    leaf_key, start, stop = layout_lib.parse_key(key)
    if start is not None:
      pieces.setdefault(leaf_key, []).append((start, stop, value))
      continue
    i = index[leaf_key]
    whole[i] = np.asarray(value, dtype=leaves[i].dtype)
  for leaf_key, parts in pieces.items():
    i = index[leaf_key]
    full = np.array(read_leaf(i))
    for start, stop, value in parts:
      full[start:stop] = value
    whole[i] = full
  return whole
