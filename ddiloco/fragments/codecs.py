"""The registered wire codecs: fp32, bf16, and the block-quantized int8 and int4 (docs/algorithm.md §5).

Integer codecs quantize block-wise: the array is flattened (C order) and cut into blocks of
`block_size` values (the last block may be partial); each block has one absmax scale
s = absmax / qmax (qmax = 127 for int8, 7 for int4) and values are rounded to q = rint(x / s) in the
symmetric range [-qmax, qmax]. Decoding is q · s in float32.

Decisions (docs/algorithm.md §5):
  * Scales are float32 (4 bytes per block, 0.5 bit/value at block 64): bf16 scales would add a
    relative error of up to 2^-9 on every value of a block for 2 bytes saved per block.
  * int4 packs two values per byte over the whole flattened array (not per block): value 2i in the
    low nibble, 2i+1 in the high nibble, stored as q + 8 (so 8 is zero and 0 is never produced); an
    odd count pads the last high nibble with 8.
  * All bytes are little-endian and decoding is a single IEEE float32 multiply per value, so every
    process decodes bit-identical values: the syncer adopts exactly what learners decode (docs/algorithm.md §5).
"""

import dataclasses
import functools
import math
import sys
from typing import ClassVar, NoReturn

import ml_dtypes
import numpy as np

from ddiloco.fragments.codec import F32, RUN_VALUES, Codec, NonFiniteRun, RunScratch, register

_NO_SCALES = np.empty(0, F32)
_TINY = np.finfo(np.float32).tiny  # The smallest normal float32.
_MAX = np.finfo(np.float32).max


@functools.lru_cache(maxsize=16)
def _block_starts(n: int, block_size: int) -> np.ndarray:
  """The first index of each block of an n-value run (`np.maximum.reduceat`'s indices)."""
  starts = np.arange(0, n, block_size, dtype=np.intp)
  starts.flags.writeable = False
  return starts


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp32(Codec):
  """Float32 values as they are: exact."""

  name: ClassVar[str] = "fp32"
  wire_id: ClassVar[int] = 0
  exact: ClassVar[bool] = True
  unit_bytes: ClassVar[int] = 4
  payload_dtype: ClassVar[np.dtype] = F32

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x32.view(np.uint8), _NO_SCALES

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    del start, n, scales
    self._check_whole_units(payload)
    return np.frombuffer(payload, F32).astype(np.float32, copy=False)


def _refuse(x32: np.ndarray) -> NoReturn:
  """Refuses a run whose bfloat16 encoding is not finite: NaN/Inf among its values
  (`NonFiniteRun`, which `Codec.encode_runs` reports with their count), or an overflow."""
  if not np.isfinite(x32).all():
    raise NonFiniteRun("a run has NaN/Inf values")
  raise ValueError("Values overflow bfloat16 (|x| > 3.39e38).")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16(Codec):
  """bfloat16, round to nearest even: 8 bits of mantissa, float32's range."""

  name: ClassVar[str] = "bf16"
  wire_id: ClassVar[int] = 1
  unit_bytes: ClassVar[int] = 2
  # The payload is little-endian: a bfloat16 array (native order) holds its bytes on such a host.
  payload_dtype: ClassVar[np.dtype | None] = (
    np.dtype(ml_dtypes.bfloat16) if sys.byteorder == "little" else None
  )

  # The encoding's own check refuses NaN/Inf: a bfloat16 is infinite or NaN exactly when the
  # float32 it comes from is, or overflows; `_refuse` tells the two apart.
  checks_finite: ClassVar[bool] = True

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xb = x32.astype(ml_dtypes.bfloat16)
    if not np.isfinite(xb).all():
      _refuse(x32)
    return xb.view(np.uint16).astype("<u2", copy=False).view(np.uint8), _NO_SCALES

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    del start, n, scales
    self._check_whole_units(payload)
    bits = np.frombuffer(payload, "<u2").astype(np.uint16, copy=False)
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)

  def encode_run_into(self, x32, base32, out, work):
    # The payload and the decoded values are formed in scratch while the run is in cache, by
    # ml_dtypes' casts (a bfloat16 widens exactly, the float32 `decode_run_into` forms from its
    # bits): one pass each way, no fresh memory. Their dot product proves them finite (a NaN/Inf
    # makes it NaN/Inf); only a run whose dot product is not finite, also an overflow of finite
    # values, is checked value by value. A 128K-value run: 97 against 116 µs for the shift and a
    # value-by-value check.
    xb = work.get("bf16", x32.size, ml_dtypes.bfloat16)
    np.copyto(xb, x32, casting="unsafe")
    values = work.get("decoded", x32.size, np.float32)
    np.copyto(values, xb, casting="unsafe")
    with np.errstate(over="ignore", invalid="ignore"):  # Judged here, not warned about.
      if not math.isfinite(float(np.dot(values, values))) and not np.isfinite(values).all():
        _refuse(x32)
      if out.dtype == np.float32:
        np.add(base32, values, out=out)
      else:
        out[...] = base32 + values
    return xb.view(np.uint16).astype("<u2", copy=False).view(np.uint8), _NO_SCALES

  def decode_run_into(self, payload, out: np.ndarray, *, start=0, scales=None, work=None) -> bool:
    del start, scales, work
    # A bfloat16 is the high half of the float32 it stands for: the float32's bits are the 16
    # bits shifted left, for every pattern, NaNs included (what the cast above gives, checked
    # over all 65536 in tests/fragments/codecs_test.py). One integer pass into `out`, without
    # the cast's temporary and its copy.
    if out.dtype != F32 or not out.flags.c_contiguous:
      return False
    self._check_whole_units(payload)
    bits = np.frombuffer(payload, "<u2")
    if bits.size != out.size:
      raise ValueError(f"a run of {bits.size} values for {out.size} places.")
    # The widening copy, then the shift in place: twice as fast as one shift that casts its
    # input through numpy's buffers (scripts/bench_ingest.py).
    wide = out.view(np.uint32)
    np.copyto(wide, bits)
    np.left_shift(wide, np.uint32(16), out=wide)
    return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BlockQuantized(Codec):
  """Symmetric integers with one float32 absmax scale per block of `block_size` values."""

  qmax: ClassVar[int]
  quantized: ClassVar[bool] = True
  checks_finite: ClassVar[bool] = True  # A NaN/Inf makes its block's absmax scale NaN/Inf.

  def nbytes(self, n: int) -> tuple[int, int]:
    payload, _ = super().nbytes(n)
    return payload, 4 * -(-n // self.block_size)

  def _run_length(self, values: int = RUN_VALUES) -> int:
    # Whole blocks, and whole units: the bytes are those of a single-shot encoding.
    run = self.block_size * max(1, values // self.block_size)
    return run * self.values_per_unit if run % self.values_per_unit else run

  def _quantize(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (q as float32 integers in [-qmax, qmax], float32 scales) for a flat float32 array."""
    qmax = self.qmax
    n, bs = flat.size, self.block_size
    num_blocks = -(-n // bs)
    blocks = flat
    if n % bs:
      blocks = np.zeros(num_blocks * bs, np.float32)
      blocks[:n] = flat
    blocks = blocks.reshape(num_blocks, bs)
    q = np.abs(blocks)
    scales = (q.max(axis=1) / np.float32(qmax)).astype(F32)
    # max propagates NaN, so the scales are finite exactly when the run is: one check of 1/bs of
    # the values instead of a pass over them (`Codec.checks_finite`).
    if not np.isfinite(scales).all():
      raise NonFiniteRun("a run has NaN/Inf values")
    # An all-zero block has scale 0: divide by 1 instead, its values are 0 anyway (no 0/0 NaN).
    # Per value: numpy broadcasts a (blocks, 1) operand 3-4x slower than it divides flat arrays.
    safe = np.repeat(np.where(scales > 0, scales, np.float32(1)), bs)
    q = q.reshape(-1)  # |x| so far: its memory is reused.
    np.divide(blocks.reshape(-1), safe, out=q)
    np.rint(q, out=q)
    # With a normal scale s = fl(absmax / qmax), |x / s| <= qmax · (1 + 2^-23) rounds to at most
    # qmax: the clip changes nothing. A subnormal scale loses precision (8 · 2^-149 / 7 rounds to
    # 2^-149, and 8 · 2^-149 / 2^-149 = 8), so blocks with one are clipped.
    if ((scales > 0) & (scales < _TINY)).any():
      np.clip(q, -qmax, qmax, out=q)
    return q[:n], scales

  def _quantize_into(
    self, x: np.ndarray, work: RunScratch
  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_quantize` in place and in scratch memory: (q, written over `x`; the per-value scales q was
    divided by; the block scales).

    The same bits as `_quantize`, with fewer passes and fewer calls: the block absmax is taken
    over the values' bit patterns with the sign cleared (a non-negative float32's bits order as
    its value does, and a NaN's are above +Inf's, so a NaN/Inf still makes its block's scale
    NaN/Inf), which numpy reduces faster than float32 values; the per-value scales are kept to
    decode with (where a scale is 0 they are 1, as the division uses, and q · 1 = q · 0 = +0
    there: every q is 0).
    """
    qmax, n, bs = self.qmax, x.size, self.block_size
    per = work.get("per", n, np.float32)
    bits = per.view(np.int32)  # |x|'s bits, until the per-value scales overwrite them.
    np.bitwise_and(x.view(np.int32), np.int32(0x7FFFFFFF), out=bits)
    full = n - n % bs
    # One reduction per block, a partial last block included (faster than a max over the rows
    # of a (blocks, bs) view here: 65 against 90 µs for 128K values).
    absmax = np.maximum.reduceat(bits, _block_starts(n, bs))
    scales = absmax.view(np.float32) / np.float32(qmax)
    if not scales.max() <= _MAX:  # max propagates NaN: one reduction checks every block.
      raise NonFiniteRun("a run has NaN/Inf values")
    safe = np.where(scales > 0, scales, np.float32(1))
    np.copyto(per[:full].reshape(-1, bs), safe[: full // bs, None])
    per[full:] = safe[-1]
    np.divide(x, per, out=x)
    np.rint(x, out=x)
    if safe.min() < _TINY:  # A subnormal scale (a zero one is 1 here): clipped as `_quantize`.
      np.clip(x, -qmax, qmax, out=x)
    return x, per, scales

  def _adopt(self, q: np.ndarray, per: np.ndarray, base32: np.ndarray, out: np.ndarray) -> None:
    """out = cast(base32 + q · s), q already +0.0 where a receiver's decoded integer is 0."""
    with np.errstate(over="ignore"):  # As `_scaled`, and Inf from the cast: the caller checks.
      np.multiply(q, per, out=q)
      if out.dtype == np.float32:
        np.add(base32, q, out=out)
      else:
        out[...] = base32 + q

  def _scaled(self, values: np.ndarray, start: int, scales: np.ndarray) -> np.ndarray:
    """q · s for the run's integer values (float32, multiplied in place) from value `start` on.

    Against a per-value copy of the scales: numpy broadcasts a (blocks, 1) operand over the rows
    of a block 3-4x slower than it multiplies two flat arrays, and the copy is cheap.
    """
    bs = self.block_size
    first = start // bs
    blocks = -(-values.size // bs)
    with np.errstate(over="ignore"):  # q · s beyond float32 is Inf; the receiver refuses it.
      if start % bs == 0 and first + blocks <= scales.size:
        # Runs start on a block (`_run_length`): no offset into the per-value scales.
        per_value = np.repeat(scales[first : first + blocks], bs)[: values.size]
        return np.multiply(values, per_value, out=values)
      per_value = np.repeat(scales[first : -(-(start + values.size) // bs)], bs)
      per_value = per_value[start - first * bs : start - first * bs + values.size]
      if per_value.size != values.size:
        raise ValueError(f"scales cover {per_value.size} of the run's {values.size} values.")
      return values * per_value

  def _per_value(self, n: int, start: int, scales: np.ndarray) -> np.ndarray | None:
    """Each of an n-value run's values' scale (as `_scaled` repeats them), or None if the run
    does not start on a block. `np.repeat` makes them faster than a broadcast copy into scratch
    (14 against 16 µs for 128K values, measured with `decode_run_into`'s other passes)."""
    bs = self.block_size
    if start % bs:
      return None
    first, blocks = start // bs, -(-n // bs)
    if first + blocks > scales.size:
      raise ValueError(f"scales cover fewer than the run's {n} values.")
    return np.repeat(scales[first : first + blocks], bs)[:n]

  def _out_of_range(self) -> ValueError:
    return ValueError(f"{self.name} payload has values outside [-{self.qmax}, {self.qmax}].")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8(_BlockQuantized):
  """int8 in [-127, 127] per value, a float32 scale per block."""

  name: ClassVar[str] = "int8"
  wire_id: ClassVar[int] = 2
  qmax: ClassVar[int] = 127

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, scales = self._quantize(x32)
    return q.astype(np.int8).view(np.uint8), scales

  def encode_run_decoded(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q, scales = self._quantize(x32)
    payload = q.astype(np.int8).view(np.uint8)
    q += np.float32(0)  # -0.0 -> +0.0, as int8 -> float32 gives it; the rest as `decode_run`.
    return payload, scales, self._scaled(q, 0, scales)

  def encode_run_in(self, x32, work):
    q, _, scales = self._quantize_into(x32, work)
    payload = work.get("payload", q.size, np.int8)
    np.copyto(payload, q, casting="unsafe")
    return payload.view(np.uint8), scales

  def encode_run_into(self, x32, base32, out, work):
    q, per, scales = self._quantize_into(x32, work)
    payload = work.get("payload", q.size, np.int8)
    np.copyto(payload, q, casting="unsafe")
    q += np.float32(0)  # -0.0 -> +0.0, as int8 -> float32 gives it.
    self._adopt(q, per, base32, out)
    return payload.view(np.uint8), scales

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    del n
    q = np.frombuffer(payload, np.int8)
    if (q == -128).any():  # The only int8 outside [-127, 127].
      raise self._out_of_range()
    return self._scaled(q.astype(np.float32), start, scales)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4(_BlockQuantized):
  """4-bit integers in [-7, 7], two per byte, a float32 scale per block."""

  name: ClassVar[str] = "int4"
  wire_id: ClassVar[int] = 3
  qmax: ClassVar[int] = 7
  values_per_unit: ClassVar[int] = 2

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return self._encoded(x32)[:2]

  def encode_run_decoded(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    payload, scales, codes = self._encoded(x32)
    codes -= np.float32(8)  # The code's value as `decode_run` forms it: float32(code) − 8.
    return payload, scales, self._scaled(codes, 0, scales)

  def encode_run_in(self, x32, work):
    q, _, scales = self._quantize_into(x32, work)
    return self._packed(q, work), scales

  def encode_run_into(self, x32, base32, out, work):
    q, per, scales = self._quantize_into(x32, work)
    payload = self._packed(q, work)
    q += np.float32(0)  # -0.0 becomes +0.0, as `decode_run`'s float32(code) − 8 gives it.
    self._adopt(q, per, base32, out)
    return payload, scales

  @staticmethod
  def _packed(q: np.ndarray, work: RunScratch) -> np.ndarray:
    """The payload of integers q in [-7, 7] (float32), in `work`'s scratch."""
    n = q.size
    codes = work.get("codes", n + n % 2, np.uint8)
    # q as int8 (exact: integers in [-7, 7]), then + 8 in uint8: the codes, one byte a value
    # for the add instead of four.
    np.copyto(codes[:n].view(np.int8), q, casting="unsafe")
    np.add(codes[:n], np.uint8(8), out=codes[:n])
    codes[n:] = 8  # The padding nibble of an odd count.
    pairs = codes.view("<u2")  # As `_encoded`: lo | hi << 4 in the low byte of lo + 256·hi.
    wide = work.get("wide", pairs.size, np.uint16)
    np.right_shift(pairs, 4, out=wide)
    np.bitwise_or(wide, pairs, out=wide)
    payload = work.get("payload", pairs.size, np.uint8)
    np.copyto(payload, wide, casting="unsafe")
    return payload

  def _encoded(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(payload, scales, the codes q + 8 as float32)."""
    q, scales = self._quantize(x32)
    q += np.float32(8)
    codes = q.astype(np.uint8)
    if codes.size % 2:
      codes = np.append(codes, np.uint8(8))
    # Each pair of codes read as one little-endian uint16 lo + 256·hi: its low byte after
    # v | (v >> 4) is lo | hi << 4 (lo < 16), i.e. value 2i in the low nibble, 2i+1 in the high.
    pairs = codes.view("<u2")
    return (pairs | (pairs >> 4)).astype(np.uint8), scales, q

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    packed = np.frombuffer(payload, np.uint8)
    count = self.run_values(packed.size, n - start)
    if 2 * packed.size - count > 1:
      raise ValueError(f"payload run of {packed.size} bytes is past value {n} of the array.")
    if 2 * packed.size > count and packed[-1] >> 4 != 8:
      raise ValueError("int4 padding nibble must be 8.")
    # Byte b -> the little-endian uint16 (b & 0x0F) + 256 · (b >> 4): its two bytes are the codes
    # of values 2i and 2i+1, in order.
    pairs = packed.astype("<u2")
    pairs |= pairs << 4
    pairs &= 0x0F0F
    codes = pairs.view(np.uint8)[:count]
    if not codes.all():  # Code 0 is q = -8, the only 4-bit value outside [-7, 7].
      raise self._out_of_range()
    values = codes.astype(np.float32)
    values -= np.float32(8)
    return self._scaled(values, start, scales)

  def decode_run_into(self, payload, out: np.ndarray, *, start=0, scales=None, work=None) -> bool:
    # `decode_run`'s operations, each into `out` or reused scratch: the codes are unpacked in
    # uint16 pairs, made q = code − 8 in place (int8), checked, cast straight into `out` and
    # multiplied there by the per-value scales. Half the passes, no copy.
    if scales is None or out.dtype != F32 or not out.flags.c_contiguous:
      return False
    packed = np.frombuffer(payload, np.uint8)
    count = out.size
    if packed.size != -(-count // 2):
      raise ValueError(f"a payload run of {packed.size} bytes for {count} values.")
    if 2 * packed.size > count and packed[-1] >> 4 != 8:
      raise ValueError("int4 padding nibble must be 8.")
    per = self._per_value(count, start, scales)
    if per is None:
      return False
    work = RunScratch(packed.size) if work is None else work
    pairs = work.get("pairs", packed.size, "<u2")
    np.copyto(pairs, packed)  # As `decode_run`: byte b is the pair (b & 0x0F) + 256 · (b >> 4).
    high = work.get("high", packed.size, "<u2")
    np.left_shift(pairs, 4, out=high)
    np.bitwise_or(pairs, high, out=pairs)
    np.bitwise_and(pairs, 0x0F0F, out=pairs)
    codes = pairs.view(np.uint8)[:count]
    # code − 8 in uint8 (wrapping) is q as int8; the int8 → float32 cast is then float32(code) − 8
    # exactly (q = 0 gives +0.0, as the subtraction does): one pass over the bytes saves a float32
    # subtraction over the values.
    np.subtract(codes, np.uint8(8), out=codes)
    q = codes.view(np.int8)
    if count and q.min() == -8:  # Code 0 is q = -8, the only 4-bit value outside [-7, 7].
      raise self._out_of_range()
    np.copyto(out, q)
    with np.errstate(over="ignore"):  # q · s beyond float32 is Inf; the receiver refuses it.
      np.multiply(out, per, out=out)
    return True
