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
from typing import ClassVar

import ml_dtypes
import numpy as np

from ddiloco.fragments.codec import F32, RUN_VALUES, Codec, register

_NO_SCALES = np.empty(0, F32)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp32(Codec):
  """Float32 values as they are: exact."""

  name: ClassVar[str] = "fp32"
  wire_id: ClassVar[int] = 0
  exact: ClassVar[bool] = True
  unit_bytes: ClassVar[int] = 4

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x32.view(np.uint8), _NO_SCALES

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    del start, n, scales
    self._check_whole_units(payload)
    return np.frombuffer(payload, F32).astype(np.float32, copy=False)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16(Codec):
  """bfloat16, round to nearest even: 8 bits of mantissa, float32's range."""

  name: ClassVar[str] = "bf16"
  wire_id: ClassVar[int] = 1
  unit_bytes: ClassVar[int] = 2

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xb = x32.astype(ml_dtypes.bfloat16)
    if not np.isfinite(xb).all():
      raise ValueError("Values overflow bfloat16 (|x| > 3.39e38).")
    return xb.view(np.uint16).astype("<u2", copy=False).view(np.uint8), _NO_SCALES

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    del start, n, scales
    self._check_whole_units(payload)
    bits = np.frombuffer(payload, "<u2").astype(np.uint16, copy=False)
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BlockQuantized(Codec):
  """Symmetric integers with one float32 absmax scale per block of `block_size` values."""

  qmax: ClassVar[int]
  quantized: ClassVar[bool] = True

  def nbytes(self, n: int) -> tuple[int, int]:
    payload, _ = super().nbytes(n)
    return payload, 4 * -(-n // self.block_size)

  def _run_length(self) -> int:
    # Whole blocks, and whole units: the bytes are those of a single-shot encoding.
    run = self.block_size * max(1, RUN_VALUES // self.block_size)
    return run * self.values_per_unit if run % self.values_per_unit else run

  def _quantize(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (q as int16 in [-qmax, qmax], float32 scales) for a flat float32 array."""
    qmax = self.qmax
    n, bs = flat.size, self.block_size
    num_blocks = -(-n // bs)
    blocks = flat
    if n % bs:
      blocks = np.zeros(num_blocks * bs, np.float32)
      blocks[:n] = flat
    blocks = blocks.reshape(num_blocks, bs)
    scales = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(F32)
    # An all-zero block has scale 0: divide by 1 instead, its values are 0 anyway (no 0/0 NaN).
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int16)
    return q.ravel()[:n], scales

  def _scaled(self, values: np.ndarray, start: int, scales: np.ndarray) -> np.ndarray:
    """q · s for the run's integer values from value `start` on."""
    bs = self.block_size
    first = start // bs
    per_value = np.repeat(scales[first : -(-(start + values.size) // bs)], bs)
    per_value = per_value[start - first * bs : start - first * bs + values.size]
    if per_value.size != values.size:
      raise ValueError(f"scales cover {per_value.size} of the run's {values.size} values.")
    with np.errstate(over="ignore"):  # q · s beyond float32 is Inf; the receiver refuses it.
      return values * per_value

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
    q, scales = self._quantize(x32)
    codes = (q + 8).astype(np.uint8)
    if codes.size % 2:
      codes = np.append(codes, np.uint8(8))
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8), scales

  def decode_run(self, payload, start, n, scales) -> np.ndarray:
    packed = np.frombuffer(payload, np.uint8)
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2], codes[1::2] = packed & 0x0F, packed >> 4
    count = self.run_values(packed.size, n - start)
    if codes.size - count > 1:
      raise ValueError(f"payload run of {packed.size} bytes is past value {n} of the array.")
    if codes.size > count and codes[count] != 8:
      raise ValueError("int4 padding nibble must be 8.")
    codes = codes[:count]
    if (codes == 0).any():  # Code 0 is q = -8, the only 4-bit value outside [-7, 7].
      raise self._out_of_range()
    return self._scaled(codes.astype(np.float32) - np.float32(8), start, scales)
