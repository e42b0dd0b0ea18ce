"""Fragments on the wire: a self-describing, versioned binary format for a fragment's arrays.

This module holds the format's constants and layouts and `received_values`; `fragment_encoder` writes
the format and `fragment_reader` reads it. Pure functions, no gRPC: `messages` wraps them into
Push/Pull chunk streams (docs/architecture.md, "Process and protocol sketch"). Arrays are encoded
with the codecs of `ddiloco.fragments.compression` (docs/algorithm.md §5).

Fragment format (version 1), all integers little-endian, never pickle:
  file:  magic b"DDWF" | u16 format version | u32 number of entries | entries, sorted by key
  entry: u16 key length | key (UTF-8) | u8 codec wire id (`Codec.wire_id`) | u8 dtype-name length |
         dtype name (ASCII) | u8 ndim | u64 × ndim dims | u32 block size | u64 payload length |
         u64 scales length | payload | scales

Decisions:
  * Validation at the door (docs/architecture.md): every length is checked against the expected layout
    *before* bytes are sliced, the payload and scales must be exactly what the codec needs for the
    expected shape, no bytes may trail, and decoded values must be finite after the cast to the
    layout dtype. Every failure is a `WireError` (a ValueError) whose message names the key or chunk.
  * Deltas (docs/algorithm.md §5): with a `base`, the payload is `values − base` (float32) and the receiver holds
    `cast(base + decoded)`. One sign convention for both directions; a learner's outer gradient
    δ = Θ^(anchor) − θ is its negation, so no information differs. Without a base the receiver
    holds `cast(decoded)`; with "fp32" that is bit-exact for float32/bfloat16/float16 layouts.
  * `received_values` gives the sender exactly what the receiver will hold, so the syncer can adopt
    the dequantized value and both sides stay bit-identical (docs/algorithm.md §5, §4.7).
  * Copies (scripts/bench_wire.py): both ends stream. The sender encodes each array in
    cache-sized runs (delta, float32 cast, NaN/Inf check and encoding in one pass) straight into
    the chunks' bytes (`FragmentEncoder`, which knows the exact size before encoding, so a stream's
    header can announce it and the chunks be made while they are sent). The receiver (`FragmentReader`) parses each chunk as it
    arrives and decodes it straight into the output arrays (base added, cast, NaN/Inf counted after
    the cast: the receive path's one finiteness check), so the payload is never joined. The bytes
    are those of the one-shot format above.
"""

import math
import struct
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from ddiloco.fragments import buffers, compression
from ddiloco.fragments.codec import Codec
from ddiloco.fragments.run_decoder import RunDecoder
from ddiloco.transport.errors import WireError

MAGIC = b"DDWF"
FORMAT_VERSION = 1
MAX_BLOCK_SIZE = 1 << 24

# The framing of the format above, shared by `fragment_encoder` and `fragment_reader`.
FILE_HEADER = struct.Struct("<4sHI")
U8, U16 = struct.Struct("<B"), struct.Struct("<H")
ENTRY_TAIL = struct.Struct("<IQQ")  # block size, payload length, scales length.
# Per-entry upper bound on framing bytes beyond the key and dims (u16+u8+u8+dtype+u8+tail).
_ENTRY_FRAMING = 2 + 1 + 1 + 255 + 1 + ENTRY_TAIL.size


Layout = dict[str, tuple[tuple[int, ...], np.dtype]]
Allocator = Callable[[int, np.dtype], np.ndarray]  # (values, dtype) -> flat array to decode into.
Buffer = bytes | bytearray | memoryview


def resolve_dtype(d: object) -> np.dtype:
  """The numpy dtype `d` names (a name like "bfloat16", or a dtype)."""
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
    dt = resolve_dtype(dtype_of[k])
    if not np.issubdtype(dt, np.floating) and dt != np.dtype(ml_dtypes.bfloat16):
      raise ValueError(f"{k!r} has dtype {dt}; only floating arrays travel on the wire.")
    layout[k] = (tuple(int(s) for s in shape_of[k]), dt)
  return layout


def max_wire_bytes(layout: Layout) -> int:
  """An upper bound on the serialized size of any valid encoding of `layout`.

  Int8 with block size 1 is the largest codec (1 payload + 4 scale bytes per value), so 5 bytes per
  value plus framing bounds every encoding; anything larger is rejected before it is buffered.
  """
  total = FILE_HEADER.size
  for k, (shape, _) in layout.items():
    n = math.prod(shape)
    total += _ENTRY_FRAMING + len(k.encode()) + 8 * len(shape) + 5 * n
  return total


def payload_offsets(layout: Layout, codec: Codec) -> dict[str, int]:
  """Stream offset of each entry's payload in an encoding of `layout` with `codec` in the
  sender's order (keys sorted, `FragmentEncoder`): where a receiver may expect them
  (`placement.Placement`). A stream in another order is still valid; it just starts elsewhere."""
  at, out = FILE_HEADER.size, {}
  for key in sorted(layout):
    shape, dtype = layout[key]
    at += 2 + len(key.encode()) + 2 + len(dtype.name) + 1 + 8 * len(shape) + ENTRY_TAIL.size
    out[key] = at
    at += sum(codec.nbytes(math.prod(shape)))
  return out


def received_values(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
  add_base: bool = True,
) -> dict[str, np.ndarray]:
  """What a receiver holds after `values` went over the wire: the sender adopts it (docs/algorithm.md §5).

  With a `base`, the wire carries `values − base`; the receiver adds `base` back unless
  `add_base` is False (then it holds the decoded difference itself).

  Equal to what `fragment_reader.read_layout` decodes of `fragment_encoder.FragmentEncoder`'s bytes,
  bit for bit, without the framing: each run is encoded and decoded by the same functions as on
  the wire. With "fp32", no base and float32/bfloat16/float16 arrays the result equals `values`.

  Raises:
    ValueError: as `FragmentEncoder`; WireError (a ValueError) if a value is NaN/Inf after the
      cast to its dtype.
  """
  codec = compression.get_codec(codec_name, block_size)
  if base is not None and set(base) != set(values):
    raise ValueError(f"base keys differ from values keys: {sorted(set(base) ^ set(values))[:3]}.")
  out = {}
  for k in sorted(values):
    x = np.asarray(values[k])
    b = None if base is None else np.asarray(base[k])
    dtype = resolve_dtype(x.dtype)
    y = buffers.aligned_empty(x.size, dtype)
    b_flat, start, bad = None if b is None else np.ravel(b), 0, 0
    try:
      for payload, scales in codec.encode_runs(x, base=b):
        # Runs are whole scale blocks: a run decodes with its own scales, as its own array.
        m = codec.run_values(payload.size, x.size - start)
        run_base = None if b_flat is None or not add_base else b_flat[start : start + m]
        decoder = RunDecoder(codec, y[start : start + m], scales=scales, base=run_base)
        decoder.feed(payload)
        bad += decoder.close()
        start += m
    except ValueError as e:
      raise ValueError(f"{k!r}: {e}") from e
    if bad:
      raise WireError(f"{k!r}: {bad} non-finite value(s) (NaN/Inf) after decoding as {dtype.name}.")
    out[k] = y.reshape(x.shape)
  return out
