"""The `Codec` interface of the wire codecs, and their registry by name and wire id (docs/algorithm.md §5).

A codec encodes float32 values run by run (`Codec.encode_runs`) and decodes whole units of payload
(`Codec.decode_run`); the concrete codecs are in `codecs`, the lookups by name in `compression`.

Decisions (docs/algorithm.md §5):
  * Non-finite input raises ValueError: a NaN must never reach the global state silently.
  * Large arrays are encoded and decoded in runs of `RUN_VALUES` values (`encode_runs`,
    `decode_run`): the delta, the cast, the NaN/Inf check and the encoding of a run happen while it
    is in cache, and no full-size temporary is made. Runs of the integer codecs are whole blocks
    (and an even count for int4), so the bytes are those of a single-shot encoding.
"""

import dataclasses
import types
from collections.abc import Iterator
from typing import ClassVar

import numpy as np

F32 = np.dtype("<f4")  # Little-endian float32: payloads and scales on the wire.
# Values per run (256 KiB of float32): big enough to amortize numpy's per-call cost, small enough
# that a run and its temporaries stay in L2 while it is delta'd, checked and encoded.
RUN_VALUES = 1 << 16
# Values per run when the encoding also writes the adopted values (`encode_runs(into=)`): the run
# makes fewer, larger numpy calls there (~13 per run), and halving their number measured ~12 %
# less CPU for a 16 MiB int4 adoption (scripts/bench_merge.py's "int4 adoption alone").
INTO_RUN_VALUES = 1 << 17


def _non_finite_error(bad: int) -> ValueError:
  return ValueError(
    f"Refusing to encode {bad} non-finite value(s) (NaN/Inf or beyond float32 range)."
  )


def as_f32(x: np.ndarray) -> np.ndarray:
  """`x` as float32 (itself if it already is)."""
  return x if x.dtype == np.float32 else x.astype(np.float32)


def check_len(what: str, data: bytes | memoryview | np.ndarray, expected: int) -> None:
  """Raises ValueError unless `data` has `expected` bytes."""
  nbytes = memoryview(data).nbytes
  if nbytes != expected:
    raise ValueError(f"{what} has {nbytes} bytes, expected {expected}.")


class NonFiniteRun(ValueError):
  """Raised by the `encode_run` of a codec with `checks_finite` for a run with a NaN/Inf."""


class RunScratch:
  """Scratch arrays of one `encode_runs` call, reused by every run (no allocation per run)."""

  def __init__(self, run: int):
    self._run = run
    self._arrays: dict[tuple[str, np.dtype], np.ndarray] = {}

  def get(self, name: str, n: int, dtype: np.dtype | type) -> np.ndarray:
    """The first n values of scratch array `name` (at least a run's worth), of `dtype`."""
    key = (name, np.dtype(dtype))
    buf = self._arrays.get(key)
    if buf is None or buf.size < n:
      buf = self._arrays[key] = np.empty(max(n, self._run), dtype)
    return buf[:n]


_REGISTRY: dict[str, type["Codec"]] = {}
# The registered codec classes by name: a read-only view of the registry (`register` adds to it).
REGISTRY = types.MappingProxyType(_REGISTRY)


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
    payload_dtype: the dtype whose little-endian bytes the payload is, value for value, and
      whose widening to float32 is exactly `decode_run` (fp32: float32, bf16: bfloat16); None if
      the payload must be decoded (int8, int4). A receiver may keep such a payload as it is sent,
      an array of this dtype (`FragmentReader(as_sent=)`), and widen it where it reads it.

  Attributes:
    block_size: values per absmax scale (quantized codecs; others ignore it).
  """

  name: ClassVar[str]
  wire_id: ClassVar[int]
  exact: ClassVar[bool] = False
  quantized: ClassVar[bool] = False
  unit_bytes: ClassVar[int] = 1
  values_per_unit: ClassVar[int] = 1
  payload_dtype: ClassVar[np.dtype | None] = None

  # Whether `encode_run` itself refuses NaN/Inf (`NonFiniteRun`), so `encode_runs` need not check
  # every value first (the block-quantized codecs see it in their scales).
  checks_finite: ClassVar[bool] = False

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

  def _run_length(self, values: int = RUN_VALUES) -> int:
    """Values per encoded run, about `values`: whole units (no int4 byte spans two runs)."""
    return self.values_per_unit * max(1, values // self.values_per_unit)

  def encode_runs(
    self,
    x: np.ndarray,
    *,
    base: np.ndarray | None = None,
    decoded: bool = False,
    into: np.ndarray | None = None,
    run_values: int | None = None,
  ) -> Iterator[tuple[np.ndarray, ...]]:
    """Encodes `x`, or the float32 delta `x − base`, run by run (C order).

    Each run is made float32 (and the delta taken), checked for NaN/Inf and encoded while it is in
    cache. The concatenated payloads and scales are those of a one-shot encoding of `x − base`.

    Args:
      x: any float array (numpy or jax).
      base: an array of x's shape, or None.
      decoded: also yield the run's values as `decode_run` gives them back from its bytes
        (`encode_run_decoded`): a sender that must hold what its receivers decode (the syncer's
        lossy downlink, docs/algorithm.md §5) gets them in the same pass, without decoding.
      into: with `base`, a flat array of x's size filled run by run with what a receiver holding
        `base` makes of the bytes, cast(float32(base) + decoded) (`run_decoder.add_base`), bit
        for bit (`encode_run_into`); the runs then yield (payload, scales) only.
      run_values: values per run (default `RUN_VALUES`; whole blocks and payload units): a
        sender that hands each run to the kernel as it is made, or encodes on several threads
        (which contend for the interpreter between numpy's calls), takes longer runs, fewer calls
        per byte.

    Yields:
      (payload bytes as a uint8 array, float32 scales of the run's blocks; empty for fp32/bf16),
      and the decoded float32 values if `decoded`. All may be overwritten by the next run: use
      them before asking for it.

    Raises:
      ValueError: on a base of another shape, NaN/Inf (of the delta), or bf16 overflow.
    """
    if into is not None and (base is None or decoded or into.ndim != 1 or into.size != np.size(x)):
      raise ValueError("`into` needs a base, no `decoded`, and a flat array of x's size.")
    flat = np.ravel(np.asarray(x))
    base_flat = None
    if base is not None:
      base_arr = np.asarray(base)
      if base_arr.shape != np.shape(x):
        raise ValueError(f"base shape {base_arr.shape} != values shape {np.shape(x)}.")
      base_flat = np.ravel(base_arr)
    n = flat.size
    if into is not None:
      run = self._run_length(INTO_RUN_VALUES)
    elif run_values is not None:
      run = self._run_length(run_values)
    else:
      run = self._run_length(RUN_VALUES)
    scratch, finite = np.empty(min(run, n), F32), np.empty(min(run, n), bool)
    work = RunScratch(min(run, n))
    for start in range(0, n, run):
      stop = min(start + run, n)
      x32 = scratch[: stop - start]
      with np.errstate(over="ignore"):  # float64 beyond float32 range becomes Inf: refused below.
        if base_flat is None:
          np.copyto(x32, flat[start:stop], casting="unsafe")
        else:
          np.subtract(as_f32(flat[start:stop]), as_f32(base_flat[start:stop]), out=x32)
      if not self.checks_finite and not np.isfinite(x32, out=finite[: stop - start]).all():
        raise _non_finite_error(self._count_non_finite(flat, base_flat))
      try:
        if into is not None:
          b32 = as_f32(base_flat[start:stop])
          encoded = self.encode_run_into(x32, b32, into[start:stop], work)
        elif decoded:
          encoded = self.encode_run_decoded(x32)
        else:
          encoded = self.encode_run_in(x32, work)
      except NonFiniteRun:
        raise _non_finite_error(self._count_non_finite(flat, base_flat)) from None
      yield encoded

  def encode_run(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(payload bytes as uint8, float32 scales) of a run of finite float32 values.

    A codec with `checks_finite` raises `NonFiniteRun` for a run with a NaN/Inf instead.
    """
    raise NotImplementedError

  def encode_run_in(self, x32: np.ndarray, work: "RunScratch") -> tuple[np.ndarray, np.ndarray]:
    """`encode_run(x32)`, its temporaries and payload in `work`'s scratch memory (reused from run
    to run, so the payload is overwritten by the next run's); `x32` may be overwritten.

    The default is `encode_run`. A codec whose encoding makes per-value temporaries overrides it:
    fresh memory each run costs allocation and page faults, which threads encoding at once
    contend on (scripts/bench_host_encode.py).
    """
    del work
    return self.encode_run(x32)

  def encode_run_decoded(self, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`encode_run(x32)` and the float32 values `decode_run` gives back for those bytes.

    Bit for bit what a receiver decodes (the default decodes the run; a codec may instead form
    the values from its quantized integers with the same operations). `x32` may be overwritten.
    """
    payload, scales = self.encode_run(x32)
    return payload, scales, self.decode_run(payload, 0, x32.size, scales)

  def encode_run_into(
    self, x32: np.ndarray, base32: np.ndarray, out: np.ndarray, work: "RunScratch"
  ) -> tuple[np.ndarray, np.ndarray]:
    """`encode_run(x32)`, and `out` = cast(base32 + the values `decode_run` gives back).

    `out` gets exactly what `run_decoder.add_base` makes of the decoded run: what a receiver
    holding the base holds. A codec may form it from its quantized integers, in `work`'s scratch
    memory (reused from run to run); `x32` may be overwritten.
    """
    del work
    payload, scales, values = self.encode_run_decoded(x32)
    with np.errstate(over="ignore"):  # Inf from the cast: the caller checks its values.
      if out.dtype == np.float32:
        np.add(base32, values, out=out)
      else:
        out[...] = base32 + values
    return payload, scales

  @staticmethod
  def _count_non_finite(flat: np.ndarray, base_flat: np.ndarray | None) -> int:
    """The error path only: NaN/Inf in the whole float32 array (or delta), for the message."""
    with np.errstate(over="ignore", invalid="ignore"):
      x32 = as_f32(flat) if base_flat is None else as_f32(flat) - as_f32(base_flat)
    return int(np.count_nonzero(~np.isfinite(x32)))

  def checked_scales(self, scales: bytes | memoryview, n: int) -> np.ndarray:
    """The float32 scales of an n-value array, checked (empty for fp32/bf16).

    Raises:
      ValueError: on a wrong length, or scales that are NaN/Inf or negative.
    """
    check_len("scales", scales, self.nbytes(n)[1])
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

  def decode_run_into(
    self,
    payload: bytes | memoryview | np.ndarray,
    out: np.ndarray,
    *,
    start: int = 0,
    scales: np.ndarray | None = None,
    work: RunScratch | None = None,
  ) -> bool:
    """Decodes a run of whole units straight into `out` if this codec can, bit for bit what
    `decode_run` gives; False (nothing written) if it cannot: the caller uses `decode_run`.

    No temporary the size of the run leaves the codec, and none is copied into `out`.

    Args:
      payload: bytes of whole units of an array's payload, beginning at value `start`.
      out: the flat, C-contiguous output for exactly the run's values (any float dtype); its
        size says how many values the payload holds (int4: a trailing nibble past it is
        padding).
      start: index of the run's first value in the flattened array (quantized codecs).
      scales: the array's `checked_scales` (quantized codecs).
      work: scratch memory reused from run to run (None: the codec's own, made for this run).

    Raises:
      ValueError: as `decode_run`, on malformed codes or padding, or a payload that does not
        hold `out`'s values.
    """
    del payload, out, start, scales, work
    return False

  def _check_whole_units(self, payload: bytes | memoryview | np.ndarray) -> None:
    """Raises ValueError unless `payload` holds whole units (no value cut in two)."""
    nbytes = memoryview(payload).nbytes
    check_len("payload run", payload, self.unit_bytes * (nbytes // self.unit_bytes))


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
