"""Fragments on the wire: a self-describing, versioned binary format for a fragment's arrays.

Pure functions, no gRPC: `messages` wraps them into Push/Pull chunk streams (ARCHITECTURE.md,
"Process and protocol sketch"). Arrays are encoded with `ddiloco.fragments.compression` (SPEC §5).

Fragment format (version 1), all integers little-endian, never pickle:
  file:  magic b"DDWF" | u16 format version | u32 number of entries | entries, sorted by key
  entry: u16 key length | key (UTF-8) | u8 codec index in CODECS | u8 dtype-name length |
         dtype name (ASCII) | u8 ndim | u64 × ndim dims | u32 block size | u64 payload length |
         u64 scales length | payload | scales

Decisions:
  * Validation at the door (ARCHITECTURE.md): every length is checked against the expected layout
    *before* bytes are sliced, the payload and scales must be exactly what the codec needs for the
    expected shape, no bytes may trail, and decoded values must be finite after the cast to the
    layout dtype. Every failure is a `WireError` (a ValueError) whose message names the key or chunk.
  * Deltas (SPEC §5): with a `base`, the payload is `values − base` (float32) and the receiver holds
    `cast(base + decoded)`. One sign convention for both directions; a learner's outer gradient
    δ = Θ^(anchor) − θ is its negation, so no information differs. Without a base the receiver
    holds `cast(decoded)`; with "fp32" that is bit-exact for float32/bfloat16/float16 layouts.
  * `received_values` gives the sender exactly what the receiver will hold, so the syncer can adopt
    the dequantized value and both sides stay bit-identical (SPEC §5, §4.7).
"""

import math
import struct
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from ddiloco.fragments import compression
from ddiloco.transport.errors import WireError, WireSizeError

MAGIC = b"DDWF"
FORMAT_VERSION = 1
MAX_BLOCK_SIZE = 1 << 24

_FILE_HEADER = struct.Struct("<4sHI")
_U8, _U16 = struct.Struct("<B"), struct.Struct("<H")
_ENTRY_TAIL = struct.Struct("<IQQ")  # block size, payload length, scales length.
# Per-entry upper bound on framing bytes beyond the key and dims (u16+u8+u8+dtype+u8+tail).
_ENTRY_FRAMING = 2 + 1 + 1 + 255 + 1 + _ENTRY_TAIL.size

Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


def _resolve_dtype(d: object) -> np.dtype:
  # np.dtype("bfloat16") fails: ml_dtypes registers the type, not the name.
  if isinstance(d, str) and hasattr(ml_dtypes, d):
    return np.dtype(getattr(ml_dtypes, d))
  return np.dtype(d)


def make_layout(
  layout_keys: Sequence[str],
  shapes: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
  dtypes: Sequence[object] | Mapping[str, object],
) -> Layout:
  """Returns {key: (shape, dtype)} for keys with shapes/dtypes given in key order or by key.

  Raises:
    ValueError: if the lengths differ, a key repeats, or a dtype is not floating.
  """
  keys = list(layout_keys)
  if len(set(keys)) != len(keys):
    raise ValueError("layout_keys has duplicates.")
  shape_of = shapes if isinstance(shapes, Mapping) else dict(zip(keys, shapes, strict=True))
  dtype_of = dtypes if isinstance(dtypes, Mapping) else dict(zip(keys, dtypes, strict=True))
  layout = {}
  for k in keys:
    dt = _resolve_dtype(dtype_of[k])
    if not np.issubdtype(dt, np.floating) and dt != np.dtype(ml_dtypes.bfloat16):
      raise ValueError(f"{k!r} has dtype {dt}; only floating arrays travel on the wire.")
    layout[k] = (tuple(int(s) for s in shape_of[k]), dt)
  return layout


def max_wire_bytes(layout: Layout) -> int:
  """An upper bound on the serialized size of any valid encoding of `layout`.

  Int8 with block size 1 is the largest codec (1 payload + 4 scale bytes per value), so 5 bytes per
  value plus framing bounds every encoding; anything larger is rejected before it is buffered.
  """
  total = _FILE_HEADER.size
  for k, (shape, _) in layout.items():
    n = math.prod(shape)
    total += _ENTRY_FRAMING + len(k.encode()) + 8 * len(shape) + 5 * n
  return total


def _as_f32_delta(values: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None) -> dict:
  if base is None:
    return dict(values)
  if set(base) != set(values):
    raise ValueError(f"base keys differ from values keys: {sorted(set(base) ^ set(values))[:3]}.")
  out = {}
  for k, v in values.items():
    v32, b32 = np.asarray(v, np.float32), np.asarray(base[k], np.float32)
    if v32.shape != b32.shape:
      raise ValueError(f"{k!r}: base shape {b32.shape} != values shape {v32.shape}.")
    out[k] = v32 - b32
  return out


def serialize_fragment(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
) -> bytes:
  """Encodes a fragment into the versioned wire format (see module docstring).

  Args:
    values: {key: float array}; the dtype recorded for each key is the array's own.
    codec_name: "fp32", "bf16", "int8" or "int4" (SPEC §5).
    block_size: values per absmax scale block for int8/int4.
    base: if given, `values − base` is encoded (a delta, SPEC §5); dtypes recorded are still those
      of `values`.

  Returns:
    The serialized bytes.

  Raises:
    ValueError: on an unknown codec, non-finite values, mismatched base, or a key/shape the format
      cannot hold.
  """
  codec = compression.get_codec(codec_name, block_size)
  encoded = compression.encode_fragment(_as_f32_delta(values, base), codec)
  parts = [_FILE_HEADER.pack(MAGIC, FORMAT_VERSION, len(encoded))]
  for key in sorted(encoded):
    enc = encoded[key]
    dtype = _resolve_dtype(np.asarray(values[key]).dtype).name.encode("ascii")
    kb = key.encode("utf-8")
    if len(kb) > 0xFFFF or len(enc.shape) > 0xFF:
      raise ValueError(f"{key!r}: key longer than 65535 bytes or more than 255 dims.")
    parts += [_U16.pack(len(kb)), kb, _U8.pack(compression.CODECS.index(enc.codec))]
    parts += [_U8.pack(len(dtype)), dtype, _U8.pack(len(enc.shape))]
    parts += [struct.pack(f"<{len(enc.shape)}Q", *enc.shape)]
    parts += [_ENTRY_TAIL.pack(enc.block_size, len(enc.payload), len(enc.scales))]
    parts += [enc.payload, enc.scales]
  return b"".join(parts)


class _Reader:
  """Bounds-checked reads from a bytes buffer; every short read is a precise WireError."""

  def __init__(self, data: bytes):
    self._view = memoryview(data)
    self.pos = 0

  def take(self, n: int, what: str) -> memoryview:
    if n > len(self._view) - self.pos:
      raise WireError(
        f"Truncated data: {what} needs {n} bytes at offset {self.pos}, "
        f"only {len(self._view) - self.pos} left."
      )
    out = self._view[self.pos : self.pos + n]
    self.pos += n
    return out

  def unpack(self, s: struct.Struct, what: str) -> tuple:
    return s.unpack(self.take(s.size, what))

  def remaining(self) -> int:
    return len(self._view) - self.pos


def _expected_lengths(codec: str, n: int, block_size: int) -> tuple[int, int]:
  """(payload, scales) bytes the codec needs for n values."""
  if codec == "fp32":
    return 4 * n, 0
  if codec == "bf16":
    return 2 * n, 0
  blocks = -(-n // block_size)
  return (n if codec == "int8" else -(-n // 2)), 4 * blocks


def _read_entry(
  r: _Reader, layout: Layout, codec_name: str | None
) -> tuple[str, compression.Encoded]:
  """Reads one entry, checking it against the layout before slicing its payload."""
  (key_len,) = r.unpack(_U16, "key length")
  try:
    key = bytes(r.take(key_len, "key")).decode("utf-8")
  except UnicodeDecodeError as e:
    raise WireError(f"Key at offset {r.pos - key_len} is not UTF-8.") from e
  if key not in layout:
    raise WireError(f"Unknown key {key!r}: not in this fragment's layout.")
  shape, dtype = layout[key]
  (codec_idx,) = r.unpack(_U8, f"{key!r} codec")
  if codec_idx >= len(compression.CODECS):
    raise WireError(f"{key!r}: unknown codec index {codec_idx}.")
  codec = compression.CODECS[codec_idx]
  if codec_name is not None and codec != codec_name:
    raise WireError(f"{key!r}: encoded with {codec!r}, the header says {codec_name!r}.")
  (dlen,) = r.unpack(_U8, f"{key!r} dtype length")
  got_dtype = bytes(r.take(dlen, f"{key!r} dtype")).decode("ascii", errors="replace")
  if got_dtype != dtype.name:
    raise WireError(f"{key!r}: dtype {got_dtype!r}, expected {dtype.name!r}.")
  (ndim,) = r.unpack(_U8, f"{key!r} ndim")
  got_shape = struct.unpack(f"<{ndim}Q", r.take(8 * ndim, f"{key!r} shape"))
  if got_shape != shape:
    raise WireError(f"{key!r}: shape {got_shape}, expected {shape}.")
  block_size, payload_len, scales_len = r.unpack(_ENTRY_TAIL, f"{key!r} lengths")
  if codec in ("int8", "int4") and not 1 <= block_size <= MAX_BLOCK_SIZE:
    raise WireError(f"{key!r}: block size {block_size} outside [1, {MAX_BLOCK_SIZE}].")
  if codec in ("fp32", "bf16") and block_size != 0:
    raise WireError(f"{key!r}: {codec} entries must have block size 0, got {block_size}.")
  want_payload, want_scales = _expected_lengths(codec, math.prod(shape), block_size)
  if (payload_len, scales_len) != (want_payload, want_scales):
    raise WireError(
      f"{key!r}: payload/scales of {payload_len}/{scales_len} bytes, expected "
      f"{want_payload}/{want_scales} for {codec} of shape {shape}."
    )
  payload = bytes(r.take(payload_len, f"{key!r} payload"))
  scales = bytes(r.take(scales_len, f"{key!r} scales"))
  return key, compression.Encoded(
    codec=codec,
    shape=shape,
    dtype=dtype.name,
    payload=payload,
    scales=scales,
    block_size=block_size,
  )


def decode_layout(
  data: bytes, layout: Layout, *, codec_name: str | None, max_bytes: int | None
) -> dict[str, np.ndarray]:
  """Parses and decodes to float32, before any base is added or dtype cast.

  Args:
    data: serialized bytes.
    layout: from `make_layout`.
    codec_name: if given, every entry must use this codec.
    max_bytes: size limit; defaults to `max_wire_bytes(layout)`.

  Raises:
    WireError: as `deserialize_fragment`, except for NaN/Inf (checked by `finish_layout`).
  """
  limit = max_wire_bytes(layout) if max_bytes is None else max_bytes
  if len(data) > limit:
    raise WireSizeError(f"Oversized payload: {len(data)} bytes, the limit is {limit}.")
  r = _Reader(data)
  magic, version, count = r.unpack(_FILE_HEADER, "file header")
  if magic != MAGIC:
    raise WireError(f"Bad magic {magic!r}, expected {MAGIC!r}: not a ddiloco fragment.")
  if version != FORMAT_VERSION:
    raise WireError(f"Unsupported format version {version}; this build reads {FORMAT_VERSION}.")
  if count > len(layout):
    raise WireError(f"Payload has {count} entries, the layout only {len(layout)}.")
  encoded: dict[str, compression.Encoded] = {}
  for _ in range(count):
    key, enc = _read_entry(r, layout, codec_name)
    if key in encoded:
      raise WireError(f"Duplicate key {key!r} in payload.")
    encoded[key] = enc
  if r.remaining():
    raise WireError(f"{r.remaining()} trailing bytes after the last entry.")
  missing = sorted(set(layout) - set(encoded))
  if missing:
    raise WireError(f"Missing {len(missing)} key(s) of the layout: {missing[:3]}.")
  try:
    return compression.decode_fragment(encoded)
  except ValueError as e:
    raise WireError(f"Malformed encoding: {e}") from e


def finish_layout(
  decoded: Mapping[str, np.ndarray], layout: Layout, base: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
  """Returns cast(base + decoded) per key, what the receiver holds (SPEC §5).

  Raises:
    WireError: if the base lacks a key or shape, or a value is NaN/Inf after the cast.
  """
  out = {}
  for k, (shape, dtype) in layout.items():
    x = decoded[k]
    if base is not None:
      if k not in base or np.shape(base[k]) != shape:
        raise WireError(f"{k!r}: the base has no array of shape {shape} for this key.")
      x = np.asarray(base[k], np.float32) + x
    with np.errstate(over="ignore"):  # Overflow to Inf is reported just below, precisely.
      y = x.astype(dtype)
    bad = int(np.count_nonzero(~np.isfinite(y.astype(np.float32))))
    if bad:
      raise WireError(f"{k!r}: {bad} non-finite value(s) (NaN/Inf) after decoding as {dtype.name}.")
    out[k] = y
  return out


def deserialize_fragment(
  data: bytes,
  layout_keys: Sequence[str],
  shapes: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
  dtypes: Sequence[object] | Mapping[str, object],
  *,
  codec_name: str | None = None,
  base: Mapping[str, np.ndarray] | None = None,
  max_bytes: int | None = None,
) -> dict[str, np.ndarray]:
  """Parses, validates and decodes a fragment serialized by `serialize_fragment`.

  Args:
    data: the serialized bytes.
    layout_keys: the keys the fragment must hold, exactly.
    shapes: expected shape per key (in `layout_keys` order, or a mapping by key).
    dtypes: expected dtype per key (names like "bfloat16" or numpy dtypes), likewise.
    codec_name: if given, every entry must use this codec.
    base: if given, the data is a delta and the result is `cast(base + decoded)` (SPEC §5).
    max_bytes: size limit; defaults to `max_wire_bytes` of the layout.

  Returns:
    {key: array of the layout's shape and dtype}, all finite.

  Raises:
    WireError: on truncated or trailing data, bad magic/version, unknown, duplicate or missing keys,
      wrong shapes/dtypes/codec, lengths that do not match the codec, oversized data, or NaN/Inf.
  """
  layout = make_layout(layout_keys, shapes, dtypes)
  decoded = decode_layout(data, layout, codec_name=codec_name, max_bytes=max_bytes)
  return finish_layout(decoded, layout, base)


def received_values(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
  """What a receiver holds after `values` went over the wire: the sender adopts it (SPEC §5).

  Equal to `deserialize_fragment(serialize_fragment(values, ...), ...)` bit for bit, without the
  framing. With "fp32", no base and float32/bfloat16/float16 arrays this is `values` itself.

  Raises:
    ValueError: as `serialize_fragment`.
  """
  codec = compression.get_codec(codec_name, block_size)
  decoded = compression.decode_fragment(
    compression.encode_fragment(_as_f32_delta(values, base), codec)
  )
  layout = {k: (tuple(np.shape(v)), _resolve_dtype(np.asarray(v).dtype)) for k, v in values.items()}
  return finish_layout(decoded, layout, base)
