"""Wire codecs for outer gradients and fragment updates: fp32, bf16, int8, int4 (docs/algorithm.md §5).

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
  * Non-finite input raises ValueError: a NaN must never reach the global state silently.
  * `Encoded.nbytes` counts payload and scales only; names, shapes and framing are the transport's.
  * Large arrays are encoded and decoded in runs of `RUN_VALUES` values (`encode_runs`,
    `decode_run`): the delta, the cast, the NaN/Inf check and the encoding of a run happen while it
    is in cache, and no full-size temporary is made. Runs of the integer codecs are whole blocks
    (and an even count for int4), so the bytes are those of a single-shot encoding.
"""

import dataclasses
from collections.abc import Iterator, Mapping
from typing import ClassVar

import ml_dtypes
import numpy as np

F32 = np.dtype("<f4")  # Little-endian float32: payloads and scales on the wire.
# Values per run (256 KiB of float32): big enough to amortize numpy's per-call cost, small enough
# that a run and its temporaries stay in L2 while it is delta'd, checked and encoded.
RUN_VALUES = 1 << 16


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


def _non_finite_error(bad: int) -> ValueError:
  return ValueError(
    f"Refusing to encode {bad} non-finite value(s) (NaN/Inf or beyond float32 range)."
  )


def _as_f32(x: np.ndarray) -> np.ndarray:
  return x if x.dtype == np.float32 else x.astype(np.float32)


def _check_len(what: str, data: bytes | memoryview | np.ndarray, expected: int) -> None:
  nbytes = memoryview(data).nbytes
  if nbytes != expected:
    raise ValueError(f"{what} has {nbytes} bytes, expected {expected}.")


_REGISTRY: dict[str, type["Codec"]] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec:
  """A wire codec: one subclass per codec, registered under its name and its wire id.

  Class attributes (a subclass sets them; `register` checks them):
    name: the codec's name in configs, headers and logs.
    wire_id: the byte that names it in the fragment wire format (transport/wire.py); stable
      forever: a new codec takes a new id.
    exact: whether decoding gives back the encoded float32 values bit for bit.
    quantized: whether it has block scales (then `block_size` applies and goes on the wire).
    unit_bytes: bytes of the smallest self-contained piece of payload.
    values_per_unit: values in such a piece (int4: a byte holds two).

  Attributes:
    block_size: values per absmax scale (quantized codecs; others ignore it).
  """

  name: ClassVar[str]
  wire_id: ClassVar[int]
  exact: ClassVar[bool] = False
  quantized: ClassVar[bool] = False
  unit_bytes: ClassVar[int] = 1
  values_per_unit: ClassVar[int] = 1

  block_size: int = 64

  def __post_init__(self):
    if type(self) is Codec:
      raise TypeError("Codec is abstract: use get_codec(name) or a codec class.")
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}.")

  def nbytes(self, n: int) -> tuple[int, int]:
    """(payload, scales) bytes this codec makes of n values."""
    return -(-n // self.values_per_unit) * self.unit_bytes, 0

  def run_values(self, nbytes: int, left: int) -> int:
    """Values held by `nbytes` of whole-unit payload when `left` values remain (int4 padding)."""
    return min(nbytes // self.unit_bytes * self.values_per_unit, left)

  def encode(self, x: np.ndarray) -> Encoded:
    """Encodes an array (any float dtype, numpy or jax).

    Raises:
      ValueError: if `x` has NaN/Inf values, or finite values that overflow bf16.
    """
    x = np.asarray(x)
    payload_len, scales_len = self.nbytes(x.size)
    payload, scales = np.empty(payload_len, np.uint8), np.empty(scales_len // 4, F32)
    p = s = 0
    for run_payload, run_scales in self.encode_runs(x):
      payload[p : p + run_payload.size] = run_payload
      scales[s : s + run_scales.size] = run_scales
      p, s = p + run_payload.size, s + run_scales.size
    return Encoded(
      codec=self.name,
      shape=tuple(int(d) for d in x.shape),
      dtype=np.dtype(x.dtype).name,
      payload=payload.tobytes(),
      scales=scales.tobytes(),
      block_size=self.block_size if self.quantized else 0,
    )

  def _run_length(self) -> int:
    """Values per encoded run: whole units (no int4 byte spans two runs)."""
    return self.values_per_unit * max(1, RUN_VALUES // self.values_per_unit)

  def encode_runs(
    self, x: np.ndarray, *, base: np.ndarray | None = None
  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encodes `x`, or the float32 delta `x − base`, run by run (C order).

    Each run is made float32 (and the delta taken), checked for NaN/Inf and encoded while it is in
    cache. The concatenated payloads and scales are exactly `encode(x − base)`'s.

    Args:
      x: any float array (numpy or jax).
      base: an array of x's shape, or None.

    Yields:
      (payload bytes as a uint8 array, float32 scales of the run's blocks; empty for fp32/bf16).
      Both may be overwritten by the next run: use them before asking for it.

    Raises:
      ValueError: on a base of another shape, NaN/Inf (of the delta), or bf16 overflow.
    """
    flat = np.ravel(np.asarray(x))
    base_flat = None
    if base is not None:
      base_arr = np.asarray(base)
      if base_arr.shape != np.shape(x):
        raise ValueError(f"base shape {base_arr.shape} != values shape {np.shape(x)}.")
      base_flat = np.ravel(base_arr)
    n = flat.size
    run = self._run_length()
    scratch, finite = np.empty(min(run, n), F32), np.empty(min(run, n), bool)
    for start in range(0, n, run):
      stop = min(start + run, n)
      x32 = scratch[: stop - start]
      with np.errstate(over="ignore"):  # float64 beyond float32 range becomes Inf: refused below.
        if base_flat is None:
          np.copyto(x32, flat[start:stop], casting="unsafe")
        else:
          np.subtract(_as_f32(flat[start:stop]), _as_f32(base_flat[start:stop]), out=x32)
      if not np.isfinite(x32, out=finite[: stop - start]).all():
        raise _non_finite_error(self._count_non_finite(flat, base_flat))
      yield self.encode_run(x32)

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(payload bytes as uint8, float32 scales) of a run of finite float32 values."""
    raise NotImplementedError

  @staticmethod
  def _count_non_finite(flat: np.ndarray, base_flat: np.ndarray | None) -> int:
    """The error path only: NaN/Inf in the whole float32 array (or delta), for the message."""
    with np.errstate(over="ignore", invalid="ignore"):
      x32 = _as_f32(flat) if base_flat is None else _as_f32(flat) - _as_f32(base_flat)
    return int(np.count_nonzero(~np.isfinite(x32)))

  def decode(self, enc: Encoded) -> np.ndarray:
    """Decodes to a float32 array of the original shape; bit-identical in every process.

    Raises:
      ValueError: if `enc` was made by another codec/block size, or its bytes are malformed.
    """
    if enc.codec != self.name:
      raise ValueError(f"Encoded with {enc.codec!r}, cannot decode with {self.name!r}.")
    if self.quantized and enc.block_size != self.block_size:
      raise ValueError(f"Encoded with block_size {enc.block_size}, codec has {self.block_size}.")
    n = enc.size
    _check_len("payload", enc.payload, self.nbytes(n)[0])
    out = self.decode_run(enc.payload, 0, n, self.checked_scales(enc.scales, n))
    # A decoded run may be a view of the payload (fp32); the caller gets an array of its own.
    return (out.copy() if out.base is not None else out).reshape(enc.shape)

  def checked_scales(self, scales: bytes | memoryview, n: int) -> np.ndarray:
    """The float32 scales of an n-value array, checked (empty for fp32/bf16).

    Raises:
      ValueError: on a wrong length, or scales that are NaN/Inf or negative.
    """
    _check_len("scales", scales, self.nbytes(n)[1])
    out = np.frombuffer(scales, F32).astype(np.float32)
    if not (np.isfinite(out).all() and (out >= 0).all()):
      raise ValueError("Scales must be finite and non-negative.")
    return out

  def decode_run(
    self, payload: bytes | memoryview | np.ndarray, start: int, n: int, scales: np.ndarray
  ) -> np.ndarray:
    """Decodes the values that `payload`, a whole number of units, holds from value `start` on.

    Args:
      payload: bytes of whole units (`unit_bytes`) of an array's payload, beginning at value
        `start` (a multiple of `values_per_unit`).
      start: index of the first value in the flattened array.
      n: number of values of the whole array (int4: a trailing nibble past n is padding).
      scales: the array's `checked_scales`; indexed from value `start`'s block.

    Returns:
      Float32 values, flat; possibly a view of `payload` (fp32: copy it to keep it).

    Raises:
      ValueError: on a length that does not hold whole values, or malformed codes or padding.
    """
    raise NotImplementedError

  def _check_whole_units(self, payload: bytes | memoryview | np.ndarray) -> None:
    """Raises ValueError unless `payload` holds whole units (no value cut in two)."""
    nbytes = memoryview(payload).nbytes
    _check_len("payload run", payload, self.unit_bytes * (nbytes // self.unit_bytes))

  def roundtrip(self, x: np.ndarray) -> np.ndarray:
    """Returns decode(encode(x)): the value the receiver will hold (docs/algorithm.md §5 "adopt the dequantized")."""
    return self.decode(self.encode(x))


def register(cls: type[Codec]) -> type[Codec]:
  """Class decorator: adds a codec to the registry (`get_codec`, `CODECS`, wire ids).

  Raises:
    ValueError: if it lacks a name or wire id, either is taken, or the id does not fit the wire's
      byte.
  """
  name, wire_id = getattr(cls, "name", None), getattr(cls, "wire_id", None)
  if not isinstance(name, str) or not name or not isinstance(wire_id, int):
    raise ValueError(f"Codec class {cls.__name__} needs a `name` (str) and a `wire_id` (int).")
  if not 0 <= cls.wire_id <= 255:
    raise ValueError(f"Codec {cls.name!r}: wire_id must fit a byte, got {cls.wire_id}.")
  for other in _REGISTRY.values():
    if other.name == cls.name or other.wire_id == cls.wire_id:
      raise ValueError(f"Codec {cls.name!r} (wire id {cls.wire_id}) clashes with {other.name!r}.")
  _REGISTRY[cls.name] = cls
  return cls


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


_NO_SCALES = np.empty(0, F32)
# The registered codecs' names, in wire-id order.
CODECS = tuple(c.name for c in sorted(_REGISTRY.values(), key=lambda c: c.wire_id))


def codec_class(name: str) -> type[Codec]:
  """The registered codec class called `name`.

  Raises:
    ValueError: on an unknown name.
  """
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"Unknown codec {name!r}; expected one of {CODECS}.") from None


def codec_by_wire_id(wire_id: int) -> type[Codec]:
  """The registered codec class whose wire id is `wire_id`.

  Raises:
    ValueError: on an unknown id.
  """
  for cls in _REGISTRY.values():
    if cls.wire_id == wire_id:
      return cls
  raise ValueError(f"Unknown codec id {wire_id}; the registered ids are 0..{len(CODECS) - 1}.")


class RunDecoder:
  """Decodes one array's payload, fed in pieces of any size, into a flat output array.

  Each run of whole values is decoded, has `base` added (float32), is cast to the output's dtype
  and counted for NaN/Inf while it is in cache: one pass, no full-size temporary. A misaligned
  fp32 run (framing puts payloads at any byte offset) is first copied into an aligned scratch:
  numpy is several times slower on misaligned float32.
  """

  def __init__(
    self,
    codec: Codec,
    out: np.ndarray,
    *,
    scales: np.ndarray | None = None,
    base: np.ndarray | None = None,
    check: bool = True,
  ):
    """Prepares to fill `out` (flat, any float dtype) with cast(base + decoded values).

    Args:
      codec: the codec the payload was made with.
      out: the flat output array; its size is the array's number of values.
      scales: the array's `checked_scales` (int8/int4).
      base: a flat array of out's size added to the decoded values (a delta), or None.
      check: count NaN/Inf in the output (after the cast), see `close`.
    """
    self._codec, self._out, self._base = codec, out, base
    self._scales = np.empty(0, np.float32) if scales is None else scales
    self._max_run = RUN_VALUES * codec.unit_bytes // codec.values_per_unit
    self._finite = np.empty(min(out.size, RUN_VALUES), bool) if check else None
    self._aligned: memoryview | None = None
    self._carry = b""
    self._start = 0
    self._non_finite = 0

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
      self._run(memoryview(self._carry))
    whole = len(piece) - (len(piece) - head) % unit
    for i in range(head, whole, self._max_run):
      self._run(piece[i : min(i + self._max_run, whole)])
    self._carry = bytes(piece[whole:])

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
      elif dst.dtype == np.float32:
        np.add(_as_f32(self._base[start:stop]), x, out=dst)
      else:
        dst[...] = _as_f32(self._base[start:stop]) + x
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


def get_codec(name: str, block_size: int = 64) -> Codec:
  """Returns the codec `name` (one of `CODECS`: "fp32", "bf16", "int8", "int4").

  Raises:
    ValueError: on an unknown name or block_size < 1.
  """
  return codec_class(name)(block_size=block_size)


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
