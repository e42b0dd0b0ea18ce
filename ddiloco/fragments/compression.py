"""Wire codecs for outer gradients and fragment updates: fp32, bf16, int8, int4 (SPEC §5).

Integer codecs quantize block-wise: the array is flattened (C order) and cut into blocks of
`block_size` values (the last block may be partial); each block has one absmax scale
s = absmax / qmax (qmax = 127 for int8, 7 for int4) and values are rounded to q = rint(x / s) in the
symmetric range [-qmax, qmax]. Decoding is q · s in float32.

Decisions (SPEC §5):
  * Scales are float32 (4 bytes per block, 0.5 bit/value at block 64): bf16 scales would add a
    relative error of up to 2^-9 on every value of a block for 2 bytes saved per block.
  * int4 packs two values per byte over the whole flattened array (not per block): value 2i in the
    low nibble, 2i+1 in the high nibble, stored as q + 8 (so 8 is zero and 0 is never produced); an
    odd count pads the last high nibble with 8.
  * All bytes are little-endian and decoding is a single IEEE float32 multiply per value, so every
    process decodes bit-identical values: the syncer adopts exactly what learners decode (SPEC §5).
  * Non-finite input raises ValueError: a NaN must never reach the global state silently.
  * `Encoded.nbytes` counts payload and scales only; names, shapes and framing are the transport's.
"""

import dataclasses
from collections.abc import Mapping

import ml_dtypes
import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}
_F32 = np.dtype("<f4")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Encoded:
  """One array on the wire.

  Attributes:
    codec: the codec name.
    shape: the original shape.
    dtype: the original dtype name (decoding always yields float32; the receiver casts if needed).
    payload: the encoded values.
    scales: little-endian float32 per-block scales (empty for fp32/bf16).
    block_size: values per scale block (0 for fp32/bf16).
  """

  codec: str
  shape: tuple[int, ...]
  dtype: str
  payload: bytes
  scales: bytes = b""
  block_size: int = 0

  @property
  def size(self) -> int:
    """Number of values."""
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    """Bytes on the wire (payload + scales)."""
    return len(self.payload) + len(self.scales)


def _finite_f32(x: np.ndarray) -> np.ndarray:
  x32 = np.asarray(x).astype(np.float32)
  bad = np.count_nonzero(~np.isfinite(x32))
  if bad:
    raise ValueError(
      f"Refusing to encode {bad} non-finite value(s) (NaN/Inf or beyond float32 range)."
    )
  return x32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec:
  """A wire codec.

  Attributes:
    name: one of "fp32", "bf16", "int8", "int4".
    block_size: values per absmax scale for int8/int4 (ignored by fp32/bf16).
  """

  name: str
  block_size: int = 64

  def __post_init__(self):
    if self.name not in CODECS:
      raise ValueError(f"Unknown codec {self.name!r}; expected one of {CODECS}.")
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}.")

  @property
  def quantized(self) -> bool:
    """Whether this codec uses block scales (int8/int4)."""
    return self.name in _QMAX

  def encode(self, x: np.ndarray) -> Encoded:
    """Encodes an array (any float dtype, numpy or jax).

    Raises:
      ValueError: if `x` has NaN/Inf values, or finite values that overflow bf16.
    """
    dtype = np.dtype(np.asarray(x).dtype).name
    x32 = _finite_f32(x)
    shape = tuple(int(d) for d in x32.shape)
    if self.name == "fp32":
      return Encoded(codec=self.name, shape=shape, dtype=dtype, payload=x32.astype(_F32).tobytes())
    if self.name == "bf16":
      xb = x32.astype(ml_dtypes.bfloat16)
      if not np.isfinite(xb.astype(np.float32)).all():
        raise ValueError("Values overflow bfloat16 (|x| > 3.39e38).")
      return Encoded(
        codec=self.name,
        shape=shape,
        dtype=dtype,
        payload=xb.view(np.uint16).astype("<u2").tobytes(),
      )
    q, scales = self._quantize(x32.ravel())
    if self.name == "int8":
      payload = q.astype(np.int8).tobytes()
    else:
      codes = (q + 8).astype(np.uint8)
      if codes.size % 2:
        codes = np.append(codes, np.uint8(8))
      payload = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8).tobytes()
    return Encoded(
      codec=self.name,
      shape=shape,
      dtype=dtype,
      payload=payload,
      scales=scales.astype(_F32).tobytes(),
      block_size=self.block_size,
    )

  def _quantize(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (q as int16 in [-qmax, qmax], float32 scales) for a flat float32 array."""
    qmax = _QMAX[self.name]
    n, bs = flat.size, self.block_size
    num_blocks = -(-n // bs)
    blocks = np.zeros(num_blocks * bs, np.float32)
    blocks[:n] = flat
    blocks = blocks.reshape(num_blocks, bs)
    scales = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(np.float32)
    # An all-zero block has scale 0: divide by 1 instead, its values are 0 anyway (no 0/0 NaN).
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int16)
    return q.ravel()[:n], scales

  def decode(self, enc: Encoded) -> np.ndarray:
    """Decodes to a float32 array of the original shape; bit-identical in every process.

    Raises:
      ValueError: if `enc` was made by another codec/block size, or its bytes are malformed.
    """
    if enc.codec != self.name:
      raise ValueError(f"Encoded with {enc.codec!r}, cannot decode with {self.name!r}.")
    n = enc.size
    if self.name == "fp32":
      self._check_len("payload", enc.payload, 4 * n)
      return np.frombuffer(enc.payload, _F32).astype(np.float32).reshape(enc.shape)
    if self.name == "bf16":
      self._check_len("payload", enc.payload, 2 * n)
      bits = np.frombuffer(enc.payload, "<u2").astype(np.uint16)
      return bits.view(ml_dtypes.bfloat16).astype(np.float32).reshape(enc.shape)
    if enc.block_size != self.block_size:
      raise ValueError(f"Encoded with block_size {enc.block_size}, codec has {self.block_size}.")
    qmax = _QMAX[self.name]
    num_blocks = -(-n // self.block_size)
    self._check_len("scales", enc.scales, 4 * num_blocks)
    scales = np.frombuffer(enc.scales, _F32).astype(np.float32)
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
      raise ValueError("Scales must be finite and non-negative.")
    if self.name == "int8":
      self._check_len("payload", enc.payload, n)
      q = np.frombuffer(enc.payload, np.int8)
    else:
      self._check_len("payload", enc.payload, -(-n // 2))
      packed = np.frombuffer(enc.payload, np.uint8)
      codes = np.stack([packed & 0x0F, packed >> 4], axis=1).ravel()
      if codes.size > n and codes[n] != 8:
        raise ValueError("int4 padding nibble must be 8.")
      q = codes[:n].astype(np.int8) - np.int8(8)
    if n and np.abs(q.astype(np.int16)).max() > qmax:
      raise ValueError(f"{self.name} payload has values outside [-{qmax}, {qmax}].")
    per_value = np.repeat(scales, self.block_size)[:n]
    return (q.astype(np.float32) * per_value).reshape(enc.shape)

  @staticmethod
  def _check_len(what: str, data: bytes, expected: int) -> None:
    if len(data) != expected:
      raise ValueError(f"{what} has {len(data)} bytes, expected {expected}.")

  def roundtrip(self, x: np.ndarray) -> np.ndarray:
    """Returns decode(encode(x)): the value the receiver will hold (SPEC §5 "adopt the dequantized")."""
    return self.decode(self.encode(x))


def get_codec(name: str, block_size: int = 64) -> Codec:
  """Returns the codec `name` ("fp32", "bf16", "int8", "int4").

  Raises:
    ValueError: on an unknown name or block_size < 1.
  """
  return Codec(name=name, block_size=block_size)


def encode_fragment(values: Mapping[str, np.ndarray], codec: Codec | str) -> dict[str, Encoded]:
  """Encodes every array of a fragment, keyed as `values`.

  Raises:
    ValueError: naming the key, if an array cannot be encoded (e.g. it holds NaN).
  """
  if isinstance(codec, str):
    codec = get_codec(codec)
  out = {}
  for key in sorted(values):
    try:
      out[key] = codec.encode(values[key])
    except ValueError as e:
      raise ValueError(f"{key!r}: {e}") from e
  return out


def decode_fragment(encoded: Mapping[str, Encoded]) -> dict[str, np.ndarray]:
  """Decodes a fragment; each `Encoded` names its own codec and block size.

  Raises:
    ValueError: naming the key, if an entry is malformed.
  """
  out = {}
  for key in sorted(encoded):
    enc = encoded[key]
    try:
      out[key] = get_codec(enc.codec, enc.block_size or 64).decode(enc)
    except ValueError as e:
      raise ValueError(f"{key!r}: {e}") from e
  return out


def fragment_wire_bytes(encoded: Mapping[str, Encoded]) -> int:
  """Total bytes on the wire (payload + scales) of an encoded fragment."""
  return sum(enc.nbytes for enc in encoded.values())
