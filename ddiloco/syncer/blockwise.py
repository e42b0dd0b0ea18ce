"""Block-wise passes over large float arrays, the merge's kernel: contributions v_m formed block by
block (`Diffs`), a finiteness check without a full-size temporary, a new version's digest, norm
and check in one pass (`summarize`), and 64-byte-aligned output memory."""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from scipy.linalg import blas

from ddiloco.fragments import buffers
from ddiloco.fragments.digest import values_digest

# Values per block: 512 KiB of float32, half this machine's 1 MiB L2. Measured on the 16 MiB,
# 8-contribution benchmark (scripts/bench_merge.py): 8K-32K-value blocks lose more to per-call
# overhead than they gain in cache hits; 64K-256K were within noise of each other.
BLOCK_VALUES = 1 << 17
_AXPY = {np.dtype(np.float32): blas.saxpy, np.dtype(np.float64): blas.daxpy}


def all_finite(x: np.ndarray, *, block_values: int = BLOCK_VALUES) -> bool:
  """Whether every value of a float array is finite, checked block by block.

  `np.all(np.isfinite(x))` allocates a bool array the size of `x`; this reuses one block-sized
  buffer and stops at the first block with a NaN/Inf. A sum or a norm would not do: it can
  overflow to Inf for finite values.

  Args:
    x: a floating array (any shape; non-contiguous arrays are checked through a flat copy).
    block_values: values per block.

  Raises:
    ValueError: if block_values < 1.
  """
  if block_values < 1:
    raise ValueError(f"block_values must be >= 1, got {block_values}.")
  flat = np.ravel(np.asarray(x))
  buf = np.empty(min(block_values, flat.size), bool)
  for start in range(0, flat.size, block_values):
    block = flat[start : start + block_values]
    if not np.isfinite(block, out=buf[: block.size]).all():
      return False
  return True


class Summary(NamedTuple):
  """A new version's digest, its norm and the keys with a NaN/Inf (`summarize`)."""

  digest: str
  norm: float
  non_finite: tuple[str, ...]


def block_sq_norm(values: Mapping[str, np.ndarray], dots: Mapping[str, Sequence[float]]) -> float:
  """‖values‖ from per-block float32 dot products, summed in float64 in `values`' key order."""
  sq = 0.0
  for key in values:
    for dot in dots[key]:
      sq += dot
  return math.sqrt(sq)


def summarize(values: Mapping[str, np.ndarray]) -> Summary:
  """`values_digest(values)`, ‖values‖ and the keys with a NaN/Inf, in one pass over the values.

  Each block of `BLOCK_VALUES` values is hashed, then cast to float32 and its dot product taken
  while it is in cache; the norm is summed from those dot products in float64, in the same order
  as `versions.norm` (the same bits). A finite float32 dot product proves its block finite (a
  NaN/Inf makes it NaN/Inf); only a block whose dot product is not finite (also an overflow of
  finite values) is checked value by value. So `non_finite` is exactly the keys that
  `all_finite` refuses, without a pass of its own.
  """
  dots: dict[str, list[float]] = {key: [] for key in values}
  bad: set[str] = set()

  def visit(key: str, block: np.ndarray) -> None:
    b32 = block.astype(np.float32, copy=False)
    dot = float(np.dot(b32, b32))
    if not math.isfinite(dot) and not np.isfinite(block).all():
      bad.add(key)
    dots[key].append(dot)

  with np.errstate(over="ignore", invalid="ignore"):  # Judged below, not warned about.
    digest = values_digest(values, visit=visit, block_values=BLOCK_VALUES)
  return Summary(digest, block_sq_norm(values, dots), tuple(sorted(bad)))


def _layout(specs: Sequence[tuple[int, np.dtype]]) -> tuple[list[int], int]:
  """Byte offsets of flat arrays of (size, dtype) packed with 64-byte alignment, and the total."""
  starts, total = [], 0
  for n, dtype in specs:
    starts.append(total)
    total += -(-n * dtype.itemsize // buffers.ALIGN) * buffers.ALIGN
  return starts, total + buffers.ALIGN  # Room to align the start.


def _carve(raw: np.ndarray, specs: Sequence[tuple[int, np.dtype]]) -> list[np.ndarray]:
  """Flat arrays of (size, dtype), each 64-byte aligned, as views into the uint8 array `raw`."""
  starts, _ = _layout(specs)
  base = -raw.ctypes.data % buffers.ALIGN
  return [
    raw[base + at : base + at + n * dtype.itemsize].view(dtype)
    for at, (n, dtype) in zip(starts, specs)
  ]


def aligned_empties(
  specs: Sequence[tuple[int, np.dtype]], alloc: Callable[[int], np.ndarray] | None = None
) -> list[np.ndarray]:
  """Flat arrays of (size, dtype), each 64-byte aligned, carved from one allocation.

  One large allocation rather than one per tensor: numpy backs large allocations with huge
  pages, and fresh memory is paid for in page faults (measured on this machine: writing four
  fresh 4 MiB arrays 3.2 ms, one fresh 16 MiB array 0.8 ms; reading the 8 contributions ~8 ms).
  `alloc(nbytes)` makes that allocation, a flat uint8 array (default `np.empty`; a recycling
  pool's, `chunks.ArrayPool`, whose buffer comes back once every array carved from it is gone).
  """
  nbytes = _layout(specs)[1]
  return _carve(np.empty(nbytes, np.uint8) if alloc is None else alloc(nbytes), specs)


class OutputBuffer:
  """Memory that `merge_reports` writes its results into, reused from one merge to the next.

  Fresh memory is paid for in page faults and the kernel's zeroing: reusing one buffer took a
  16 MiB, 8-contribution flush from ~42 to ~35 ms of CPU (scripts/bench_merge.py). A
  merge's results are views into it and are overwritten by the next merge that uses the same
  buffer, so the caller must be done with them first (`FragmentUpdater` is: the outer step has
  read them when it returns). Not thread-safe. It keeps the largest size asked for.
  """

  def __init__(self):
    self._raw = np.empty(0, np.uint8)

  def arrays(self, specs: Sequence[tuple[int, np.dtype]]) -> list[np.ndarray]:
    """Flat arrays of (size, dtype), each 64-byte aligned, in this buffer (see the class)."""
    total = _layout(specs)[1]
    if self._raw.nbytes < total:
      self._raw = np.empty(total, np.uint8)
    return _carve(self._raw, specs)

  @property
  def nbytes(self) -> int:
    """Bytes held."""
    return self._raw.nbytes


class Diffs:
  """The contributions v_m = a_m − b_m (or a_m alone) of one tensor, read block by block.

  Every array is flattened once (a view for contiguous inputs); `block` forms v_m's values
  [start, stop) in the accumulation dtype, in a scratch buffer or as a view when no arithmetic or
  cast is needed.
  """

  def __init__(
    self,
    pairs: Sequence[tuple[np.ndarray, np.ndarray | None]],
    block_values: int,
    out: np.ndarray | None = None,
  ):
    self.a = [np.ravel(a) for a, _ in pairs]
    self.b = [None if b is None else np.ravel(b) for _, b in pairs]
    self.size = self.a[0].size
    self.dtype = np.promote_types(self.a[0].dtype, np.float32)
    self.block_values = block_values
    self._scratch = np.empty(min(block_values, self.size), self.dtype)
    self._out = out

  def output(self) -> np.ndarray:
    """The flat output array (given, or allocated aligned on first use)."""
    if self._out is None:
      self._out = aligned_empties([(self.size, self.dtype)])[0]
    return self._out

  def block(self, m: int, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """v_m[start:stop], written to `out` (default: the scratch buffer) unless a view suffices."""
    a, b = self.a[m][start:stop], self.b[m]
    if b is None and a.dtype == self.dtype and out is None:
      return a
    dst = self._scratch[: stop - start] if out is None else out
    if b is None:
      np.copyto(dst, a, casting="same_kind")
    else:
      np.subtract(a, b[start:stop], out=dst, dtype=self.dtype)
    return dst

  def sq_norms(self, members: Sequence[int]) -> dict[int, float]:
    """{m: ‖v_m‖²} for the given contributions, in float64 from per-block dot products."""
    sq = dict.fromkeys(members, 0.0)
    for start in range(0, self.size, self.block_values):
      stop = min(start + self.block_values, self.size)
      for m in members:
        v = self.block(m, start, stop)
        sq[m] += float(np.dot(v, v))
    return sq

  def combine(self, coefs: Mapping[int, float]) -> tuple[np.ndarray, float]:
    """(Σ_m coefs[m] · v_m, its squared norm): one pass, block outer and contribution inner.

    The squared norm is summed from each finished block while it is still in cache.
    """
    out = self.output()
    axpy = _AXPY[self.dtype]
    members = list(coefs)
    sq = 0.0
    for start in range(0, self.size, self.block_values):
      stop = min(start + self.block_values, self.size)
      acc = out[start:stop]
      first = members[0]
      self.block(first, start, stop, out=acc)
      acc *= self.dtype.type(coefs[first])
      for m in members[1:]:
        axpy(self.block(m, start, stop), acc, a=coefs[m])  # In place: acc += c_m · v_m.
      sq += float(np.dot(acc, acc))
    return out, sq
