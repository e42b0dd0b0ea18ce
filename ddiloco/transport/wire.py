"""Fragments on the wire: a self-describing, versioned binary format for a fragment's arrays.

Pure functions, no gRPC: `messages` wraps them into Push/Pull chunk streams (docs/architecture.md,
"Process and protocol sketch"). Arrays are encoded with `ddiloco.fragments.compression` (docs/algorithm.md §5).

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
from collections.abc import Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from ddiloco.fragments import buffers, compression
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, ChunkWriter, Prefix, num_chunks_for
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
Allocator = Callable[[int, np.dtype], np.ndarray]  # (values, dtype) -> flat array to decode into.
Buffer = bytes | bytearray | memoryview


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


def _entry_head(key: str, shape: tuple[int, ...], dtype: str, codec: compression.Codec) -> bytes:
  """The framing of one entry, up to its payload (see the format in the module docstring)."""
  kb, db = key.encode("utf-8"), dtype.encode("ascii")
  if len(kb) > 0xFFFF or len(shape) > 0xFF:
    raise ValueError(f"{key!r}: key longer than 65535 bytes or more than 255 dims.")
  payload_len, scales_len = codec.nbytes(math.prod(shape))
  return b"".join(
    [
      _U16.pack(len(kb)),
      kb,
      _U8.pack(codec.wire_id),
      _U8.pack(len(db)),
      db,
      _U8.pack(len(shape)),
      struct.pack(f"<{len(shape)}Q", *shape),
      _ENTRY_TAIL.pack(codec.block_size if codec.quantized else 0, payload_len, scales_len),
    ]
  )


class FragmentEncoder:
  """A fragment checked and framed for the wire; its arrays are encoded as its bytes are read.

  The constructor checks everything but the values (keys, shapes, the base) and knows the exact
  serialized size, so a sender can announce it (a chunk stream's header) before encoding anything.
  Each array is then encoded in cache-sized runs (`Codec.encode_runs`): the delta, the float32
  cast, the NaN/Inf check and the encoding are one pass over the values.

  Attributes:
    nbytes: the exact size of the serialized fragment.
  """

  def __init__(
    self,
    values: Mapping[str, np.ndarray],
    codec_name: str,
    *,
    block_size: int = 64,
    base: Mapping[str, np.ndarray] | None = None,
  ):
    """Checks and frames `values` (see `serialize_fragment` for the arguments).

    Raises:
      ValueError: on an unknown codec, a base with other keys or shapes, or a key/shape the format
        cannot hold.
    """
    self._codec = compression.get_codec(codec_name, block_size)
    if base is not None and set(base) != set(values):
      raise ValueError(f"base keys differ from values keys: {sorted(set(base) ^ set(values))[:3]}.")
    self._entries = []
    self.nbytes = _FILE_HEADER.size
    for key in sorted(values):
      x = np.asarray(values[key])
      b = None if base is None else np.asarray(base[key])
      if b is not None and b.shape != x.shape:
        raise ValueError(f"{key!r}: base shape {b.shape} != values shape {x.shape}.")
      shape = tuple(int(d) for d in x.shape)
      head = _entry_head(key, shape, _resolve_dtype(x.dtype).name, self._codec)
      self._entries.append((key, head, x, b))
      self.nbytes += len(head) + sum(self._codec.nbytes(x.size))

  def pieces(self) -> Iterator[bytes | np.ndarray]:
    """The serialized fragment, piece by piece in order (no full-size buffer).

    A piece may be overwritten once the next is asked for.

    Raises:
      ValueError: while iterating, on a NaN/Inf value (named by key).
    """
    codec = self._codec
    yield _FILE_HEADER.pack(MAGIC, FORMAT_VERSION, len(self._entries))
    for key, head, x, b in self._entries:
      yield head
      scales = np.empty(codec.nbytes(x.size)[1] // 4, compression.F32)
      filled = 0
      try:
        for payload, run_scales in codec.encode_runs(x, base=b):
          yield payload
          scales[filled : filled + run_scales.size] = run_scales
          filled += run_scales.size
      except ValueError as e:
        raise ValueError(f"{key!r}: {e}") from e
      if scales.size:
        yield scales  # The format puts an entry's scales after its whole payload.

  def chunks(self, chunk_size: int = DEFAULT_CHUNK_SIZE, *, prefix: Prefix | None = None):
    """The serialized fragment cut into `bytes` chunks of `chunk_size`, made one by one.

    Every byte is copied once, into its chunk (`ChunkWriter`; with `prefix`, each chunk carries
    `prefix(index, n)` in front of its n bytes). There is always at least one chunk.

    Raises:
      ValueError: at once if chunk_size < 1; while iterating, as `pieces`.
    """
    writer = ChunkWriter(chunk_size, prefix=prefix)
    return self._chunks_of(writer)

  def _chunks_of(self, writer: ChunkWriter) -> Iterator[bytes]:
    for piece in self.pieces():
      yield from writer.write(piece)
    yield from writer.flush()
    if writer.nbytes != self.nbytes:  # The framing and the codecs disagree: a bug, not bad input.
      raise AssertionError(f"Serialized {writer.nbytes} bytes, announced {self.nbytes}.")

  def num_chunks(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """How many chunks `chunks(chunk_size)` makes."""
    return num_chunks_for(self.nbytes, chunk_size)


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
    codec_name: "fp32", "bf16", "int8" or "int4" (docs/algorithm.md §5).
    block_size: values per absmax scale block for int8/int4.
    base: if given, `values − base` is encoded (a delta, docs/algorithm.md §5); dtypes recorded are still those
      of `values`.

  Returns:
    The serialized bytes.

  Raises:
    ValueError: on an unknown codec, non-finite values, mismatched base, or a key/shape the format
      cannot hold.
  """
  encoder = FragmentEncoder(values, codec_name, block_size=block_size, base=base)
  (data,) = encoder.chunks(max(1, encoder.nbytes))  # One chunk: one copy per byte.
  return data


def serialize_chunks(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Iterator[bytes]:
  """`serialize_fragment(...)` cut into chunks of `chunk_size`, made one by one as iterated.

  Every byte is copied once, into its chunk, and no joined copy is made: a sender that wraps each
  chunk in its message as it comes holds one chunk of `bytes` at a time.

  Yields:
    The chunks in order; one empty chunk for an empty payload (there is always one).

  Raises:
    ValueError: at once on a bad codec, base, key or shape, or if chunk_size < 1; while iterating,
      on a NaN/Inf value.
  """
  encoder = FragmentEncoder(values, codec_name, block_size=block_size, base=base)
  return encoder.chunks(chunk_size)


class FragmentReader:
  """Parses, checks and decodes a serialized fragment fed in pieces (chunks), in order.

  Each piece is parsed or decoded into the output arrays when it is fed, so the caller can drop it:
  the payload is never joined or held whole. fp32/bf16 payloads are decoded as they arrive;
  int8/int4 payloads are gathered (their scales follow them) and decoded once the scales are in.
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
    """
    self._layout, self._codec_name, self._base = layout, codec_name, base
    self._check = check_finite
    self._alloc = buffers.aligned_empty if alloc is None else alloc
    self.limit = max_wire_bytes(layout) if max_bytes is None else max_bytes
    self._fed = 0
    self._view, self._off, self._pos = memoryview(b""), 0, 0  # Current piece; stream offset.
    self._parser = self._parse()
    next(self._parser)  # Runs to the first read.

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
    """Ends the data and returns {key: array of the layout's shape and dtype}, all finite.

    Raises:
      WireError: as `deserialize_fragment`, e.g. for truncated or trailing data or missing keys.
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
    magic, version, count = yield from self._unpack(_FILE_HEADER, "file header")
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
    (key_len,) = yield from self._unpack(_U16, "key length")
    try:
      key = bytes((yield from self._take(key_len, "key"))).decode("utf-8")
    except UnicodeDecodeError as e:
      raise WireError(f"Key at offset {self._pos - key_len} is not UTF-8.") from e
    if key not in self._layout:
      raise WireError(f"Unknown key {key!r}: not in this fragment's layout.")
    shape, dtype = self._layout[key]
    (codec_id,) = yield from self._unpack(_U8, f"{key!r} codec")
    try:
      codec_cls = compression.codec_by_wire_id(codec_id)
    except ValueError:
      raise WireError(f"{key!r}: unknown codec id {codec_id}.") from None
    codec = codec_cls.name
    if self._codec_name is not None and codec != self._codec_name:
      raise WireError(f"{key!r}: encoded with {codec!r}, the header says {self._codec_name!r}.")
    (dlen,) = yield from self._unpack(_U8, f"{key!r} dtype length")
    got_dtype = bytes((yield from self._take(dlen, f"{key!r} dtype"))).decode("ascii", "replace")
    if got_dtype != dtype.name:
      raise WireError(f"{key!r}: dtype {got_dtype!r}, expected {dtype.name!r}.")
    (ndim,) = yield from self._unpack(_U8, f"{key!r} ndim")
    got_shape = struct.unpack(f"<{ndim}Q", (yield from self._take(8 * ndim, f"{key!r} shape")))
    if got_shape != shape:
      raise WireError(f"{key!r}: shape {got_shape}, expected {shape}.")
    block_size, payload_len, scales_len = yield from self._unpack(_ENTRY_TAIL, f"{key!r} lengths")
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

  def _entry_values(self, key: str, codec: compression.Codec, payload_len: int):
    """Reads one entry's payload and scales (lengths already checked) into its output array."""
    shape, dtype = self._layout[key]
    n = math.prod(shape)
    base = None
    if self._base is not None:
      if key not in self._base or np.shape(self._base[key]) != shape:
        raise WireError(f"{key!r}: the base has no array of shape {shape} for this key.")
      base = np.ravel(np.asarray(self._base[key]))
    out = self._alloc(n, np.dtype(dtype))
    what, at, left = f"{key!r} payload", self._pos, payload_len
    try:
      if not codec.quantized:
        decoder = compression.RunDecoder(codec, out, base=base, check=self._check)
        while left:
          piece = yield from self._some(left, what, payload_len, at)
          decoder.feed(piece)
          left -= len(piece)
      else:  # The scales follow the payload: gather it (int payloads are 4-8x smaller).
        payload = memoryview(np.empty(payload_len, np.uint8))
        while left:
          piece = yield from self._some(left, what, payload_len, at)
          payload[payload_len - left : payload_len - left + len(piece)] = piece
          left -= len(piece)
        scales_len = codec.nbytes(n)[1]
        scales = codec.checked_scales((yield from self._take(scales_len, f"{key!r} scales")), n)
        decoder = compression.RunDecoder(codec, out, scales=scales, base=base, check=self._check)
        decoder.feed(payload)
      bad = decoder.close()
    except WireError:
      raise
    except ValueError as e:
      raise WireError(f"Malformed encoding: {key!r}: {e}") from e
    if bad:
      raise WireError(
        f"{key!r}: {bad} non-finite value(s) (NaN/Inf) after decoding as {dtype.name}."
      )
    return out.reshape(shape)


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
    WireError: as `deserialize_fragment`.
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


def deserialize_fragment(
  data: Buffer | Sequence[Buffer],
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
    data: the serialized bytes, or the chunks that hold them in order.
    layout_keys: the keys the fragment must hold, exactly.
    shapes: expected shape per key (in `layout_keys` order, or a mapping by key).
    dtypes: expected dtype per key (names like "bfloat16" or numpy dtypes), likewise.
    codec_name: if given, every entry must use this codec.
    base: if given, the data is a delta and the result is `cast(base + decoded)` (docs/algorithm.md §5).
    max_bytes: size limit; defaults to `max_wire_bytes` of the layout.

  Returns:
    {key: array of the layout's shape and dtype}, all finite.

  Raises:
    WireError: on truncated or trailing data, bad magic/version, unknown, duplicate or missing keys,
      wrong shapes/dtypes/codec, lengths that do not match the codec, oversized data, or NaN/Inf.
  """
  layout = make_layout(layout_keys, shapes, dtypes)
  return read_layout(data, layout, codec_name=codec_name, max_bytes=max_bytes, base=base)


def outer_gradient_encoder(
  theta: Mapping[str, np.ndarray],
  anchor: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
) -> FragmentEncoder:
  """A learner's outer gradient δ = Θ^(anchor) − θ framed for the wire (docs/algorithm.md §5).

  The encoder forms `values − base` in its one pass over the values; with Θ^(anchor) as the values
  and θ as the base that difference is δ, in the accumulation dtype, never held whole. The
  receiver reads δ as it is (no base): the syncer merges the decoded δ directly.

  Raises:
    ValueError: as `FragmentEncoder`; while encoding, on a NaN/Inf in δ (a NaN/Inf θ).
  """
  return FragmentEncoder(anchor, codec_name, block_size=block_size, base=theta)


def received_outer_gradient(
  theta: Mapping[str, np.ndarray],
  anchor: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
) -> dict[str, np.ndarray]:
  """The outer gradient δ = Θ^(anchor) − θ as the syncer decodes it from `outer_gradient_encoder`'s
  bytes, bit for bit, without the framing (the simulated cluster's uplink).

  Raises:
    ValueError: as `received_values`.
  """
  return received_values(anchor, codec_name, block_size=block_size, base=theta, add_base=False)


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

  Equal to `deserialize_fragment(serialize_fragment(values, ...), ...)` bit for bit, without the
  framing: each run is encoded and decoded by the same functions as on the wire. With "fp32", no
  base and float32/bfloat16/float16 arrays the result equals `values`.

  Raises:
    ValueError: as `serialize_fragment`; WireError (a ValueError) if a value is NaN/Inf after the
      cast to its dtype.
  """
  codec = compression.get_codec(codec_name, block_size)
  if base is not None and set(base) != set(values):
    raise ValueError(f"base keys differ from values keys: {sorted(set(base) ^ set(values))[:3]}.")
  out = {}
  for k in sorted(values):
    x = np.asarray(values[k])
    b = None if base is None else np.asarray(base[k])
    dtype = _resolve_dtype(x.dtype)
    y = buffers.aligned_empty(x.size, dtype)
    b_flat, start, bad = None if b is None else np.ravel(b), 0, 0
    try:
      for payload, scales in codec.encode_runs(x, base=b):
        # Runs are whole scale blocks: a run decodes with its own scales, as its own array.
        m = codec.run_values(payload.size, x.size - start)
        run_base = None if b_flat is None or not add_base else b_flat[start : start + m]
        decoder = compression.RunDecoder(codec, y[start : start + m], scales=scales, base=run_base)
        decoder.feed(payload)
        bad += decoder.close()
        start += m
    except ValueError as e:
      raise ValueError(f"{k!r}: {e}") from e
    if bad:
      raise WireError(f"{k!r}: {bad} non-finite value(s) (NaN/Inf) after decoding as {dtype.name}.")
    out[k] = y.reshape(x.shape)
  return out
