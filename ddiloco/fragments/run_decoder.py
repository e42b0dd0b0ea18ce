"""`RunDecoder`: one array's payload decoded piece by piece into its output, base added (docs/algorithm.md §5)."""

from collections.abc import Callable

import numpy as np

from ddiloco.fragments.codec import INTO_RUN_VALUES, RUN_VALUES, Codec, RunScratch, as_f32


def add_base(dst: np.ndarray, base: np.ndarray, x: np.ndarray) -> None:
  """dst = cast(float32(base) + x), what a receiver holding `base` makes of decoded delta values."""
  if dst.dtype == np.float32:
    np.add(as_f32(base), x, out=dst)
  else:
    dst[...] = as_f32(base) + x


class RunDecoder:
  """Decodes one array's payload, fed in pieces of any size, into a flat output array.

  Each run of whole values is decoded, has `base` added (float32), is cast to the output's dtype
  and counted for NaN/Inf while it is in cache: one pass, no full-size temporary. A codec that
  decodes straight into the output (`Codec.decode_run_into`: bf16, int4) writes each run there
  with no temporary to copy, and `on_values` may read the run while it is still in cache (the
  door's norms, `fragment_reader._BlockDots`). A misaligned fp32 run (framing puts payloads at any
  byte offset) is first copied into an aligned scratch: numpy is several times slower on
  misaligned float32. A payload whose bytes are the output's own (an output of the codec's
  `payload_dtype`, no base: fp32 into float32, bf16 kept as bfloat16) is copied as bytes, or
  found in place (received there, transport/placement.py).
  """

  def __init__(
    self,
    codec: Codec,
    out: np.ndarray,
    *,
    scales: np.ndarray | None = None,
    base: np.ndarray | None = None,
    check: bool = True,
    on_values: Callable[[int], None] | None = None,
  ):
    """Prepares to fill `out` (flat, any float dtype) with cast(base + decoded values).

    Args:
      codec: the codec the payload was made with.
      out: the flat output array; its size is the array's number of values.
      scales: the array's `checked_scales` (int8/int4).
      base: a flat array of out's size added to the decoded values (a delta), or None.
      check: count NaN/Inf in the output (after the cast), see `close`.
      on_values: called after each run with k: values [0, k) of `out` are final.
    """
    self._codec, self._out, self._base = codec, out, base
    # Whether the payload's bytes are `out`'s: copied, or already in place (received there,
    # transport/placement.py).
    self._plain = (
      base is None and codec.payload_dtype is not None and out.dtype == codec.payload_dtype
    )
    self._scales = np.empty(0, np.float32) if scales is None else scales
    self._max_run = RUN_VALUES * codec.unit_bytes // codec.values_per_unit
    # A direct decoding's runs are longer: its scratch is smaller than `decode_run`'s temporaries,
    # and fewer numpy calls measured 12-14 % less CPU for bf16 and int4 (scripts/bench_ingest.py);
    # a run is then one block of the door's norms (`blockwise.BLOCK_VALUES`).
    self._into_run = INTO_RUN_VALUES * codec.unit_bytes // codec.values_per_unit
    self._finite = np.empty(min(out.size, RUN_VALUES), bool) if check else None
    self._on_values = on_values
    self._work = RunScratch(min(out.size, INTO_RUN_VALUES))  # `decode_run_into`'s, reused.
    self._aligned: memoryview | None = None
    self._carry = b""
    self._start = 0
    self._non_finite = 0

  @property
  def run_bytes(self) -> int:
    """Payload bytes of the longest run (`decode_run_into`'s): pieces of whole multiples of it
    decode in runs that start where the payload's first does (on a block)."""
    return self._into_run

  def feed(self, data: bytes | memoryview | np.ndarray) -> None:
    """Decodes the next bytes of the payload (a unit split across pieces is carried over).

    Raises:
      ValueError: on malformed codes or padding, or more payload than the array has values.
    """
    piece = memoryview(data).cast("B")
    unit, head = self._codec.unit_bytes, 0
    if self._carry:
      head = min(unit - len(self._carry), len(piece))
      self._carry += bytes(piece[:head])
      if len(self._carry) < unit:
        return
      carried = memoryview(self._carry)
      if not self._copy(carried):
        self._run(carried)
      self._done()
    whole = len(piece) - (len(piece) - head) % unit
    run = piece[head:whole]
    if whole > head and not self._in_place(run):
      for i in range(head, whole, self._into_run):
        run = piece[i : min(i + self._into_run, whole)]
        if not (self._copy(run) or self._into(run)):
          for j in range(0, len(run), self._max_run):
            self._run(run[j : j + self._max_run])
        self._done()
    self._carry = bytes(piece[whole:])

  def _done(self) -> None:
    if self._on_values is not None:
      self._on_values(self._start)

  def _copy(self, view: memoryview) -> bool:
    """Copies `view` (whole units) into `out` if its bytes are the values (`_plain`); False if
    not, nothing done."""
    if not self._plain:
      return False
    n = len(view) // self._out.itemsize
    if self._start + n > self._out.size:
      raise ValueError(f"payload holds more than the array's {self._out.size} values.")
    dst = self._out[self._start : self._start + n]
    dst.view(np.uint8)[...] = np.frombuffer(view, np.uint8)
    self._skip(n)  # Counts NaN/Inf if asked, as `_run` does.
    return True

  def _in_place(self, view: memoryview) -> bool:
    """Takes `view` if it holds the next values where they belong in `out` already; False if
    not, nothing done."""
    if not self._plain or self._start + len(view) // self._out.itemsize > self._out.size:
      return False
    x = np.frombuffer(view, self._out.dtype)
    dst = self._out[self._start : self._start + x.size]
    # may_share_memory compares bounds only (cheap); the addresses settle it.
    if not (
      np.may_share_memory(x, dst)
      and x.__array_interface__["data"][0] == dst.__array_interface__["data"][0]
    ):
      return False
    self._skip(x.size)
    self._done()
    return True

  def _into(self, view: memoryview) -> bool:
    """Decodes `view` (whole units) straight into `out` if the codec can (`Codec.decode_run_into`:
    no base to add); False if not, nothing done."""
    if self._base is not None:
      return False
    codec, start = self._codec, self._start
    n = codec.run_values(len(view), self._out.size - start)
    if len(view) // codec.unit_bytes * codec.values_per_unit - n >= codec.values_per_unit:
      return False  # More payload than values left (past a padding nibble): `_run` says so.
    dst = self._out[start : start + n]
    if not codec.decode_run_into(view, dst, start=start, scales=self._scales, work=self._work):
      return False
    self._skip(n)  # Counts NaN/Inf if asked, as `_run` does.
    return True

  def _skip(self, n: int) -> None:
    """Takes `n` values that are in place: only counted for NaN/Inf."""
    if self._finite is not None:
      for i in range(self._start, self._start + n, RUN_VALUES):
        run = self._out[i : min(i + RUN_VALUES, self._start + n)]
        finite = np.isfinite(run, out=self._finite[: run.size])
        self._non_finite += run.size - int(np.count_nonzero(finite))
    self._start += n

  def _run(self, run: memoryview) -> None:
    codec, start = self._codec, self._start
    x = codec.decode_run(run, start, self._out.size, self._scales)
    if not x.flags.aligned:  # An fp32 view: decode it again from an aligned copy.
      if self._aligned is None:
        self._aligned = memoryview(np.empty(self._max_run, np.uint8))
      self._aligned[: len(run)] = run
      x = codec.decode_run(self._aligned[: len(run)], start, self._out.size, self._scales)
    stop = start + x.size
    if stop > self._out.size:
      raise ValueError(f"payload holds more than the array's {self._out.size} values.")
    dst = self._out[start:stop]
    with np.errstate(over="ignore"):  # Overflow to Inf in the cast is counted below, precisely.
      if self._base is None:
        dst[...] = x
      else:
        add_base(dst, self._base[start:stop], x)
    if self._finite is not None:
      finite = np.isfinite(dst, out=self._finite[: x.size])
      self._non_finite += x.size - int(np.count_nonzero(finite))
    self._start = stop

  def close(self) -> int:
    """Returns the number of NaN/Inf values in the output (0 if not checked).

    Raises:
      ValueError: if the payload fed did not hold exactly the array's values.
    """
    if self._carry or self._start != self._out.size:
      raise ValueError(f"payload held {self._start} of the array's {self._out.size} values.")
    return self._non_finite
