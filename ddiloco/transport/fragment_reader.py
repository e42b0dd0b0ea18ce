"""`FragmentReader`: a serialized fragment parsed, checked and decoded as its chunks arrive.

The format is described in `wire`; `fragment_encoder` writes it.
"""

import math
import struct
from collections.abc import Mapping, Sequence

import numpy as np

from ddiloco.fragments import buffers, compression
from ddiloco.fragments.codec import Codec
from ddiloco.fragments.run_decoder import RunDecoder
from ddiloco.syncer.blockwise import BLOCK_VALUES
from ddiloco.transport.errors import WireError, WireSizeError
from ddiloco.transport.placement import Placement
from ddiloco.transport.wire import (
  ENTRY_TAIL,
  FILE_HEADER,
  FORMAT_VERSION,
  MAGIC,
  MAX_BLOCK_SIZE,
  U8,
  U16,
  Allocator,
  Buffer,
  Layout,
  max_wire_bytes,
  payload_offsets,
)

_LE_F32 = np.dtype("<f4")


class FragmentReader:
  """Parses, checks and decodes a serialized fragment fed in pieces (chunks), in order.

  Each piece is parsed or decoded into the output arrays when it is fed, so the caller can drop it:
  the payload is never joined. fp32/bf16 payloads are decoded as they arrive (or kept as sent,
  `as_sent`); int8/int4 payloads
  are held (their scales follow them: views of the pieces, not copies, so a caller must not write
  into a piece it fed until the entry's scales are read) and decoded once the scales are in.
  Every length is checked against the layout before the bytes it covers are read, and NaN/Inf is
  counted after the cast to the layout dtype (`RunDecoder`), the one check of the receive path.

  Attributes:
    limit: the size limit in bytes; feeding more raises WireSizeError.
  """

  def __init__(
    self,
    layout: Layout,
    *,
    codec_name: str | None = None,
    max_bytes: int | None = None,
    base: Mapping[str, np.ndarray] | None = None,
    alloc: Allocator | None = None,
    check_finite: bool = True,
    placement: Placement | None = None,
    norms: bool = False,
    as_sent: bool = False,
  ):
    """Prepares to read a fragment of `layout`.

    Args:
      layout: from `make_layout`.
      codec_name: if given, every entry must use this codec.
      max_bytes: size limit; defaults to `max_wire_bytes(layout)`.
      base: if given, the data is a delta and the result is `cast(base + decoded)` (docs/algorithm.md §5).
      alloc: makes each output array, (number of values, dtype) -> flat writable array; default
        `buffers.aligned_empty` (XLA reads it in place). A receiver recycles memory with `chunks.ArrayPool.empty`.
      check_finite: count NaN/Inf and raise on any. False only for a caller that checks every
        value itself (the syncer service: `SyncerCore.report` checks them at filing, fused with
        RDA's norm, so a second pass here would only cost time).
      placement: where a socket reader may receive payload bytes in place (transport/placement.py):
        with an fp32 `codec_name` (or bf16 and `as_sent`) and no base, the arrays whose bytes the
        payload is are made at once and offered at the offsets the sender's encoding puts them;
        an entry that starts elsewhere gets a fresh one.
      norms: sum each float32 entry's squared norm (no base) as the syncer's door does, block by
        block as its values are decoded (while they are in cache): `sq_norms` (`Report.sq_norms`).
      as_sent: keep the values of a float32 array as they were sent when the codec's payload is
        an array of its own dtype whose widening to float32 is exact (`Codec.payload_dtype`: bf16's
        bfloat16), with no base: the array is then that payload (received in place with
        `placement`), half the bytes, never widened here. For a receiver that widens the values
        where it reads them (the syncer's merge); their norms (`norms`) are the float32 values'.

    Attributes:
      sq_norms: with `norms`, {key: ‖values‖²} of the entries read so far whose every block's dot
        product was finite (`_BlockDots`); an entry with a NaN/Inf (or an overflow) has none.
    """
    self._layout, self._codec_name, self._base = layout, codec_name, base
    self._check = check_finite
    self._norms = norms
    self._as_sent = as_sent
    self.sq_norms: dict[str, float] = {}
    self._alloc = buffers.aligned_empty if alloc is None else alloc
    self.limit = max_wire_bytes(layout) if max_bytes is None else max_bytes
    self._fed = 0
    self._view, self._off, self._pos = memoryview(b""), 0, 0  # Current piece; stream offset.
    self._preset: dict[str, tuple[int, np.ndarray]] = {}
    if placement is not None and codec_name is not None and base is None:
      self._offer(placement, compression.get_codec(codec_name))
    self._parser = self._parse()
    next(self._parser)  # Runs to the first read.

  def _offer(self, placement: Placement, codec: Codec) -> None:
    """Makes the arrays whose payload is their own bytes, and offers them (`placement`)."""
    if codec.payload_dtype is None:
      return
    starts = payload_offsets(self._layout, codec)
    for key, (shape, dtype) in self._layout.items():
      kept = self._kept_dtype(codec, dtype)
      if kept is not None and kept.isnative:
        out = self._alloc(math.prod(shape), kept)
        placement.offer(starts[key], out)
        self._preset[key] = (starts[key], out)

  def _kept_dtype(self, codec: Codec, dtype: np.dtype) -> np.dtype | None:
    """The dtype of an output array whose bytes are `codec`'s payload for an array of `dtype`
    (no base): fp32's float32 for float32, bf16's bfloat16 for float32 with `as_sent`; or None."""
    kept = codec.payload_dtype
    if self._base is not None or kept is None or dtype != _LE_F32:
      return None
    return kept if kept == dtype or self._as_sent else None

  def feed(self, data: Buffer) -> None:
    """Parses and decodes the next piece of the serialized fragment.

    Raises:
      WireError: on anything malformed so far (then the reader is done); WireSizeError if the
        bytes fed exceed the size limit.
    """
    view = memoryview(data).cast("B")
    self._fed += len(view)
    if self._fed > self.limit:
      raise WireSizeError(f"Oversized payload: {self._fed} bytes, the limit is {self.limit}.")
    try:
      self._parser.send(view)
    except StopIteration as e:
      raise WireError("This reader is done (finished or failed); it takes no more data.") from e

  def finish(self) -> dict[str, np.ndarray]:
    """Ends the data and returns {key: array of the layout's shape and dtype (or the codec's
    payload dtype, `as_sent`)}, all finite.

    Raises:
      WireError: as `read_layout`, e.g. for truncated or trailing data or missing keys.
    """
    try:
      self._parser.send(None)
    except StopIteration as stop:
      if stop.value is None:
        raise WireError(
          "This reader is done (finished or failed); it has no more values."
        ) from stop
      return stop.value
    raise AssertionError("The parser asked for data after the end.")

  # Generators below: `yield` hands control back until the next piece is fed (None: the end).

  def _next_piece(self, what: str, n: int, at: int):
    while self._off == len(self._view):
      data = yield
      if data is None:
        raise WireError(
          f"Truncated data: {what} needs {n} bytes at offset {at}, only {self._fed - at} left."
        )
      self._view, self._off = data, 0

  def _some(self, n: int, what: str, need: int, at: int):
    """Between 1 and n bytes of the stream, a view of the current piece (no copy)."""
    yield from self._next_piece(what, need, at)
    m = min(n, len(self._view) - self._off)
    out = self._view[self._off : self._off + m]
    self._off, self._pos = self._off + m, self._pos + m
    return out

  def _take(self, n: int, what: str):
    """Exactly n contiguous bytes; only framing that straddles two pieces is copied."""
    if not n:
      return memoryview(b"")  # Never wait for a piece that is not needed.
    at = self._pos
    if len(self._view) - self._off >= n:
      return (yield from self._some(n, what, n, at))
    got = bytearray()
    while len(got) < n:
      got += yield from self._some(n - len(got), what, n, at)
    return memoryview(got)

  def _unpack(self, s: struct.Struct, what: str):
    return s.unpack((yield from self._take(s.size, what)))

  def _parse(self):
    magic, version, count = yield from self._unpack(FILE_HEADER, "file header")
    if magic != MAGIC:
      raise WireError(f"Bad magic {magic!r}, expected {MAGIC!r}: not a ddiloco fragment.")
    if version != FORMAT_VERSION:
      raise WireError(f"Unsupported format version {version}; this build reads {FORMAT_VERSION}.")
    if count > len(self._layout):
      raise WireError(f"Payload has {count} entries, the layout only {len(self._layout)}.")
    out: dict[str, np.ndarray] = {}
    for _ in range(count):
      key, codec, payload_len = yield from self._entry_head()
      if key in out:
        raise WireError(f"Duplicate key {key!r} in payload.")
      out[key] = yield from self._entry_values(key, codec, payload_len)
    while (yield) is not None:  # Count whatever trails the last entry.
      pass
    if self._fed > self._pos:
      raise WireError(f"{self._fed - self._pos} trailing bytes after the last entry.")
    missing = sorted(set(self._layout) - set(out))
    if missing:
      raise WireError(f"Missing {len(missing)} key(s) of the layout: {missing[:3]}.")
    return {k: out[k] for k in self._layout}

  def _entry_head(self):
    """Reads and checks one entry's framing against the layout: (key, codec, payload length)."""
    (key_len,) = yield from self._unpack(U16, "key length")
    try:
      key = bytes((yield from self._take(key_len, "key"))).decode("utf-8")
    except UnicodeDecodeError as e:
      raise WireError(f"Key at offset {self._pos - key_len} is not UTF-8.") from e
    if key not in self._layout:
      raise WireError(f"Unknown key {key!r}: not in this fragment's layout.")
    shape, dtype = self._layout[key]
    (codec_id,) = yield from self._unpack(U8, f"{key!r} codec")
    try:
      codec_cls = compression.codec_by_wire_id(codec_id)
    except ValueError:
      raise WireError(f"{key!r}: unknown codec id {codec_id}.") from None
    codec = codec_cls.name
    if self._codec_name is not None and codec != self._codec_name:
      raise WireError(f"{key!r}: encoded with {codec!r}, the header says {self._codec_name!r}.")
    (dlen,) = yield from self._unpack(U8, f"{key!r} dtype length")
    got_dtype = bytes((yield from self._take(dlen, f"{key!r} dtype"))).decode("ascii", "replace")
    if got_dtype != dtype.name:
      raise WireError(f"{key!r}: dtype {got_dtype!r}, expected {dtype.name!r}.")
    (ndim,) = yield from self._unpack(U8, f"{key!r} ndim")
    got_shape = struct.unpack(f"<{ndim}Q", (yield from self._take(8 * ndim, f"{key!r} shape")))
    if got_shape != shape:
      raise WireError(f"{key!r}: shape {got_shape}, expected {shape}.")
    block_size, payload_len, scales_len = yield from self._unpack(ENTRY_TAIL, f"{key!r} lengths")
    if codec_cls.quantized and not 1 <= block_size <= MAX_BLOCK_SIZE:
      raise WireError(f"{key!r}: block size {block_size} outside [1, {MAX_BLOCK_SIZE}].")
    if not codec_cls.quantized and block_size != 0:
      raise WireError(f"{key!r}: {codec} entries must have block size 0, got {block_size}.")
    c = codec_cls(block_size=block_size or 64)
    want_payload, want_scales = c.nbytes(math.prod(shape))
    if (payload_len, scales_len) != (want_payload, want_scales):
      raise WireError(
        f"{key!r}: payload/scales of {payload_len}/{scales_len} bytes, expected "
        f"{want_payload}/{want_scales} for {codec} of shape {shape}."
      )
    return key, c, payload_len

  def _entry_values(self, key: str, codec: Codec, payload_len: int):
    """Reads one entry's payload and scales (lengths already checked) into its output array."""
    shape, dtype = self._layout[key]
    n = math.prod(shape)
    base = None
    if self._base is not None:
      if key not in self._base or np.shape(self._base[key]) != shape:
        raise WireError(f"{key!r}: the base has no array of shape {shape} for this key.")
      base = np.ravel(np.asarray(self._base[key]))
    preset = self._preset.pop(key, None)
    if preset is not None and preset[0] == self._pos:  # Where it was offered: bytes may be there.
      out = preset[1]
    else:
      out = self._alloc(n, self._kept_dtype(codec, dtype) or np.dtype(dtype))
    what, at, left = f"{key!r} payload", self._pos, payload_len
    # The door's norms of a float32 δ, summed block by block as the decoder finishes each run.
    dots = None
    if self._norms and base is None and dtype == _LE_F32:
      dots = _BlockDots(out)
    on_values = None if dots is None else dots.advance
    try:
      if not codec.quantized:
        decoder = RunDecoder(codec, out, base=base, check=self._check, on_values=on_values)
        while left:
          piece = yield from self._some(left, what, payload_len, at)
          decoder.feed(piece)
          left -= len(piece)
      else:  # The scales follow the payload: hold its pieces (int payloads are 4-8x smaller).
        pieces = []
        while left:
          piece = yield from self._some(left, what, payload_len, at)
          pieces.append(piece)
          left -= len(piece)
        scales_len = codec.nbytes(n)[1]
        scales = codec.checked_scales((yield from self._take(scales_len, f"{key!r} scales")), n)
        decoder = RunDecoder(
          codec, out, scales=scales, base=base, check=self._check, on_values=on_values
        )
        for run in _recut(pieces, decoder.run_bytes):
          decoder.feed(run)
      bad = decoder.close()
      if dots is not None and dots.finite and dots.done:
        self.sq_norms[key] = dots.sq
    except WireError:
      raise
    except ValueError as e:
      raise WireError(f"Malformed encoding: {key!r}: {e}") from e
    if bad:
      raise WireError(
        f"{key!r}: {bad} non-finite value(s) (NaN/Inf) after decoding as {dtype.name}."
      )
    return out.reshape(shape)


def _recut(pieces: list[memoryview], size: int):
  """The bytes of `pieces` in order, as views of `size` bytes (the last shorter): only the few that
  span two pieces are copied (each run of a block-quantized payload then starts on a block, as
  its direct decoding needs, without gathering the payload into one buffer)."""
  held: memoryview | bytearray = memoryview(b"")  # A piece's tail (a view) until more comes.
  for piece in pieces:
    if not piece:
      continue
    at = 0
    if held:
      at = min(size - len(held), len(piece))
      held = bytearray(held) + piece[:at]
      if len(held) < size:
        continue
      yield memoryview(held)
    whole = at + (len(piece) - at) // size * size
    for i in range(at, whole, size):
      yield piece[i : i + size]
    held = piece[whole:]
  if held:
    yield memoryview(held)


class _BlockDots:
  """‖out‖² summed exactly as the syncer's door sums an outer gradient's (`merge.finite_sq_norm`:
  the float32 dot product of each block of `BLOCK_VALUES` values, added in float64 in order), a
  block as soon as its values are final: the same bits, without a pass over the array later.

  Values kept as sent (`FragmentReader(as_sent=)`, bfloat16) are widened to float32 block by block
  into one reused, aligned scratch (exact) and their dot product taken there, while the block is
  in cache: the same float32 values, the same dot products. (ml_dtypes' cast widens a block in
  about half the CPU of bf16's shift, `Bf16.decode_run_into`: 11 against 19 µs per 128K values.)"""

  def __init__(self, out: np.ndarray):
    self._out = out
    self._wide = None
    if out.dtype != _LE_F32:
      self._wide = buffers.aligned_empty(min(out.size, BLOCK_VALUES), np.float32)
    self._done = 0
    self.sq = 0.0
    self.finite = True  # False once a block's dot product is NaN/Inf: the door then checks it.

  @property
  def done(self) -> bool:
    """Whether every value is summed."""
    return self._done == self._out.size

  def advance(self, final: int) -> None:
    """Values [0, final) of the array are final: sums every whole block among them (the last,
    shorter block once the array is complete)."""
    size = self._out.size
    with np.errstate(over="ignore", invalid="ignore"):  # Judged below, not warned about.
      while (
        self.finite and self._done < final and (final - self._done >= BLOCK_VALUES or final == size)
      ):
        stop = min(self._done + BLOCK_VALUES, size)
        block = self._widened(self._out[self._done : stop])
        dot = float(np.dot(block, block))
        self.finite = math.isfinite(dot)
        self.sq += dot
        self._done = stop

  def _widened(self, block: np.ndarray) -> np.ndarray:
    """`block` in float32: itself, or widened into the scratch."""
    if self._wide is None:
      return block
    wide = self._wide[: block.size]
    np.copyto(wide, block, casting="safe")  # Exact: a payload dtype widens exactly.
    return wide


def read_layout(
  data: Buffer | Sequence[Buffer],
  layout: Layout,
  *,
  codec_name: str | None,
  max_bytes: int | None,
  base: Mapping[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
  """Parses, checks and decodes to what the receiver holds: cast(base + decoded) (docs/algorithm.md §5).

  Args:
    data: the serialized bytes, or the pieces (chunks) that hold them in order, not joined.
    layout: from `make_layout`.
    codec_name: if given, every entry must use this codec.
    max_bytes: size limit; defaults to `max_wire_bytes(layout)`.
    base: if given, the data is a delta against it.

  Returns:
    {key: new array of the layout's shape and dtype}, all finite.

  Raises:
    WireError: on truncated or trailing data, bad magic/version, unknown, duplicate or missing keys,
      wrong shapes/dtypes/codec, lengths that do not match the codec, oversized data, or NaN/Inf.
  """
  return _read(data, FragmentReader(layout, codec_name=codec_name, max_bytes=max_bytes, base=base))


def _read(data: Buffer | Sequence[Buffer], reader: FragmentReader) -> dict[str, np.ndarray]:
  parts = [data] if isinstance(data, bytes | bytearray | memoryview) else data
  total = sum(memoryview(p).nbytes for p in parts)
  if total > reader.limit:  # The whole size is known: refuse before parsing anything.
    raise WireSizeError(f"Oversized payload: {total} bytes, the limit is {reader.limit}.")
  for part in parts:
    reader.feed(part)
  return reader.finish()
