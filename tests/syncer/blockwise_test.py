"""Tests of ddiloco.syncer.blockwise: the merge's block-wise kernel."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.syncer import blockwise, versions

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


def test_summarize_is_digest_norm_and_check_in_one_pass():
  # Against the three passes it replaces: the same digest, the same norm bits, the same verdict.
  rng = np.random.default_rng(3)
  values = {
    "b": rng.standard_normal(300_001).astype(np.float32),  # Several blocks, a partial last one.
    "a": rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16),
    "c": np.float32(3e19) * np.ones(40, np.float32),  # Finite, but its dot product overflows.
    "d": np.zeros((0, 3), np.float32),
  }
  got = blockwise.summarize(values)
  assert got.digest == values_digest(values)
  assert got.norm == versions.norm(values)  # Bit-equal: same blocks, same order.
  assert got.non_finite == ()
  bad = dict(values, b=values["b"].copy(), e=np.array([1.0, np.inf], np.float32))
  bad["b"][200_000] = np.nan
  got = blockwise.summarize(bad)
  assert got.non_finite == ("b", "e")
  assert got.non_finite == tuple(k for k in sorted(bad) if not blockwise.all_finite(bad[k]))
  assert got.digest == values_digest(bad)
