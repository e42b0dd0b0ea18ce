"""Host arrays that XLA can use in place: 64-byte aligned (docs/algorithm.md §4.6).

`jax.device_put` of a numpy array on the CPU backend aliases its memory, without a copy, only
when the data is 64-byte aligned; numpy's own allocations are 16-byte aligned for large arrays.
The syncer's outer step reads every answer it merges through XLA, so the arrays answers are
decoded or copied into come from here.
"""

import numpy as np

ALIGN = 64  # Bytes: XLA's CPU client aliases host buffers with this alignment.


def aligned_empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts at a multiple of `ALIGN` bytes."""
  dtype = np.dtype(dtype)
  n = int(np.prod(shape, dtype=np.int64))
  raw = np.empty(n * dtype.itemsize + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start : start + n * dtype.itemsize].view(dtype).reshape(shape)


def aligned_copy(x: np.ndarray) -> np.ndarray:
  """A copy of `x` (any layout) in aligned memory (`aligned_empty`)."""
  x = np.asarray(x)
  out = aligned_empty(x.shape, x.dtype)
  np.copyto(out, x)
  return out
