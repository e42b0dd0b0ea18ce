"""Tests of ddiloco.syncer.blockwise: the merge's block-wise kernel."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.syncer import blockwise

# -- blockwise finiteness (the core's door check) ----------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_finds_a_non_finite_value_in_the_last_partial_block(bad):
  x = np.zeros(10, np.float32)
  assert blockwise.all_finite(x, block_values=4)  # Blocks [0, 4), [4, 8), [8, 10).
  x[9] = bad  # The last value of the short last block.
  assert not blockwise.all_finite(x, block_values=4)
  y = np.zeros((3, 5), np.float64)
  y[2, 4] = bad
  assert not blockwise.all_finite(y, block_values=7)  # 2-D: blocks of the flattened values.
  assert not blockwise.all_finite(y[:, ::2], block_values=2)  # Non-contiguous: its (2, 4) is bad.


def test_all_finite_edge_cases():
  assert blockwise.all_finite(np.zeros(0, np.float32))
  assert blockwise.all_finite(np.float32(3.0))
  huge = np.full(8, np.finfo(np.float32).max, np.float32)
  assert blockwise.all_finite(huge)  # Finite values whose sum overflows to Inf are finite.
  half = np.ones(5, ml_dtypes.bfloat16)
  half[4] = np.nan
  assert not blockwise.all_finite(half, block_values=2)
  with pytest.raises(ValueError, match="block_values must be >= 1"):
    blockwise.all_finite(huge, block_values=0)
