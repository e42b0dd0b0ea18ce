"""One-shot encoding of arrays and fragments into `Encoded` records, for tests of the codecs.

The library encodes and decodes in runs (`Codec.encode_runs`, `RunDecoder`); these functions put
a whole array through the same codec methods at once.

`Encoded.nbytes` counts payload and scales only; names, shapes and framing are the transport's.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

from ddiloco.fragments.codec import F32, Codec, check_len
from ddiloco.fragments.compression import get_codec


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


def encode(codec: Codec, x: np.ndarray) -> Encoded:
  """Encodes an array (any float dtype, numpy or jax) with `codec`, all at once.

  Raises:
    ValueError: if `x` has NaN/Inf values, or finite values that overflow bf16.
  """
  x = np.asarray(x)
  payload_len, scales_len = codec.nbytes(x.size)
  payload, scales = np.empty(payload_len, np.uint8), np.empty(scales_len // 4, F32)
  p = s = 0
  for run_payload, run_scales in codec.encode_runs(x):
    payload[p : p + run_payload.size] = run_payload
    scales[s : s + run_scales.size] = run_scales
    p, s = p + run_payload.size, s + run_scales.size
  return Encoded(
    codec=codec.name,
    shape=tuple(int(d) for d in x.shape),
    dtype=np.dtype(x.dtype).name,
    payload=payload.tobytes(),
    scales=scales.tobytes(),
    block_size=codec.block_size if codec.quantized else 0,
  )


def decode(codec: Codec, enc: Encoded) -> np.ndarray:
  """Decodes to a float32 array of the original shape; bit-identical in every process.

  Raises:
    ValueError: if `enc` was made by another codec/block size, or its bytes are malformed.
  """
  if enc.codec != codec.name:
    raise ValueError(f"Encoded with {enc.codec!r}, cannot decode with {codec.name!r}.")
  if codec.quantized and enc.block_size != codec.block_size:
    raise ValueError(f"Encoded with block_size {enc.block_size}, codec has {codec.block_size}.")
  n = enc.size
  check_len("payload", enc.payload, codec.nbytes(n)[0])
  out = codec.decode_run(enc.payload, 0, n, codec.checked_scales(enc.scales, n))
  # A decoded run may be a view of the payload (fp32); the caller gets an array of its own.
  return (out.copy() if out.base is not None else out).reshape(enc.shape)


def roundtrip(codec: Codec, x: np.ndarray) -> np.ndarray:
  """Returns decode(encode(x)): the value the receiver will hold (docs/algorithm.md §5 "adopt the dequantized")."""
  return decode(codec, encode(codec, x))


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
      out[key] = encode(codec, values[key])
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
      out[key] = decode(get_codec(enc.codec, enc.block_size or 64), enc)
    except ValueError as e:
      raise ValueError(f"{key!r}: {e}") from e
  return out


def fragment_wire_bytes(encoded: Mapping[str, Encoded]) -> int:
  """Total bytes on the wire (payload + scales) of an encoded fragment."""
  return sum(enc.nbytes for enc in encoded.values())


def delta_bytes(
  codec: str, anchor: np.ndarray, theta: np.ndarray, block_size: int
) -> tuple[bytes, bytes]:
  """The numpy codec's payload and scale bytes of δ = anchor − θ, as a push puts them on the wire
  (`Codec.encode_runs` with θ as base): the reference the device encoder is checked against."""
  payloads, scales = [], []
  for payload, run_scales in get_codec(codec, block_size).encode_runs(anchor, base=theta):
    payloads.append(payload.tobytes())
    scales.append(np.asarray(run_scales, "<f4").tobytes())
  return b"".join(payloads), b"".join(scales)


def delta_excess(
  codec: str,
  anchor: np.ndarray,
  theta: np.ndarray,
  payload: np.ndarray,
  scales: np.ndarray,
  *,
  block_size: int,
) -> float:
  """How far the receiver's decode of an encoding of δ = anchor − θ goes beyond the codec's error
  bound at worst (<= 0: within it everywhere).

  The bound per value: fp32 exact; bf16 2^-8 of |δ| (round to nearest); int8 and int4 half a
  step of the block's scale, plus float32's rounding of the division and of the decode's q · s
  (2^-22 of |δ|); plus the smallest normal float32 everywhere (a backend may flush subnormals).

  Raises:
    ValueError: if the decoder refuses the bytes.
  """
  spec = get_codec(codec, block_size)
  delta = np.asarray(anchor, np.float32).reshape(-1) - np.asarray(theta, np.float32).reshape(-1)
  enc = Encoded(
    codec=codec,
    shape=(delta.size,),
    dtype="float32",
    payload=np.asarray(payload, np.uint8).tobytes(),
    scales=np.asarray(scales, "<f4").tobytes(),
    block_size=block_size if spec.quantized else 0,
  )
  exact = delta.astype(np.float64)
  err = np.abs(decode(spec, enc).astype(np.float64) - exact)
  tiny = float(np.finfo(np.float32).tiny)
  if codec == "fp32":
    bound = np.full(delta.size, tiny)
  elif codec == "bf16":
    bound = np.abs(exact) * 2.0**-8 + tiny
  else:
    step = np.repeat(np.asarray(scales, np.float64), block_size)[: delta.size]
    bound = step / 2 + np.abs(exact) * 2.0**-22 + tiny
  return float(np.max(err - bound)) if delta.size else 0.0
