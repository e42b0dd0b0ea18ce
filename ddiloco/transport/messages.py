"""Reports and fragment versions as gRPC chunk streams (Push / Pull of syncer.proto).

Builds on `wire` (payload format) and `chunks` (cutting and reassembly). The first chunk carries the
header; the receiver checks the header's sizes against its limits before buffering the rest, so a
service can reject a bad stream at the door (docs/architecture.md). A service that needs the fragment id
to pick the layout reads the first chunk itself and passes `itertools.chain([first], rest)`.

Copies (scripts/bench_wire.py): the sender encodes straight into the chunks' bytes
(`wire.FragmentEncoder`); the receiver checks the header (and looks up a delta's base) from chunk
0, then decodes each chunk as it comes, in order, straight into the output arrays
(`wire.FragmentReader`): chunks are never joined. On the Push path protobuf is bypassed for the
payload: `push_messages` makes each serialized PushChunk message in one piece (its fields in front
of the chunk's bytes, the bytes protobuf itself would produce) while the stream is being sent,
and `parse_chunk` reads a received message's fields by hand with its data a view into the
received bytes. Protobuf's own message objects would copy every payload byte twice on each side.
Only the small header submessage goes through protobuf.
"""

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from google.protobuf.message import DecodeError

from ddiloco.fragments import compression
from ddiloco.fragments.digest import values_digest
from ddiloco.protocol import FragmentState, Report, counter_error, step_time_error
from ddiloco.transport import wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, ChunkAssembler
from ddiloco.transport.errors import WireError
from ddiloco.transport.proto import syncer_pb2

BaseLookup = Callable[[int], Mapping[str, np.ndarray]]
# PushChunk and FragmentChunk share their field numbers (syncer.proto): 1 header, 2 index, 3 data.
_HEADER_TAG, _INDEX_TAG, _DATA_TAG = b"\x0a", b"\x10", b"\x1a"
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


@dataclasses.dataclass(frozen=True)
class ChunkFrame:
  """The fields of one chunk message (PushChunk or FragmentChunk).

  Attributes:
    header: the header submessage if the chunk carries one, else None.
    index: the chunk's position.
    data: its slice of the payload; a view into the received message when parsed from bytes.
    nbytes: size of the serialized message.
  """

  header: object | None
  index: int
  data: memoryview
  nbytes: int


def _varint(value: int) -> bytes:
  """Protobuf's base-128 varint of a non-negative integer below 2**64."""
  out = bytearray()
  while value > 0x7F:
    out.append((value & 0x7F) | 0x80)
    value >>= 7
  out.append(value)
  return bytes(out)


def chunk_prefix(index: int, nbytes: int, header: bytes | None = None) -> bytes:
  """The serialized fields of a chunk message that come before its data's bytes.

  `chunk_prefix(i, len(d), h) + d` is the message `PushChunk(header=H, index=i, data=d)` (or a
  FragmentChunk) with H serialized as `h`, byte for byte as protobuf writes it: fields in number
  order, proto3 defaults (index 0, empty data) left out, an int32 index as a 64-bit varint.

  Args:
    index: the chunk's index (int32).
    nbytes: the length of its data.
    header: the serialized header submessage, or None for a chunk without one.
  """
  parts = []
  if header is not None:
    parts += [_HEADER_TAG, _varint(len(header)), header]
  if index:
    parts += [_INDEX_TAG, _varint(index & 0xFFFF_FFFF_FFFF_FFFF)]
  if nbytes:
    parts += [_DATA_TAG, _varint(nbytes)]
  return b"".join(parts)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
  value = shift = 0
  while pos < len(view):
    byte = view[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value & 0xFFFF_FFFF_FFFF_FFFF, pos
    shift += 7
    if shift >= 70:
      raise WireError("Malformed chunk message: a varint longer than 10 bytes.")
  raise WireError("Malformed chunk message: truncated varint.")


def parse_chunk(message: bytes | memoryview, header_type: type) -> ChunkFrame:
  """Reads a serialized PushChunk or FragmentChunk by hand; its data is a view (no copy).

  Follows protobuf's parsing rules: unknown fields are skipped, the last index and data win,
  header occurrences merge, an int32 index keeps its low 32 bits.

  Args:
    message: the message's bytes.
    header_type: `syncer_pb2.PushHeader` or `syncer_pb2.FragmentHeader`.

  Raises:
    WireError: on a malformed message (truncated, bad wire type, undecodable header).
  """
  view = memoryview(message).cast("B")
  pos, end = 0, len(view)
  headers, index, data = [], 0, view[0:0]
  while pos < end:
    key, pos = _read_varint(view, pos)
    field, wire_type = key >> 3, key & 7
    if field == 0:
      raise WireError("Malformed chunk message: field number 0.")
    if wire_type == _WIRE_VARINT:
      value, pos = _read_varint(view, pos)
    elif wire_type == _WIRE_LEN:
      length, pos = _read_varint(view, pos)
      if length > end - pos:
        raise WireError(f"Malformed chunk message: field {field} runs past the end.")
      value, pos = view[pos : pos + length], pos + length
    elif wire_type in (_WIRE_I64, _WIRE_I32):
      pos += 8 if wire_type == _WIRE_I64 else 4
      if pos > end:
        raise WireError(f"Malformed chunk message: field {field} runs past the end.")
      value = None
    else:
      raise WireError(f"Malformed chunk message: wire type {wire_type} of field {field}.")
    expected = {1: _WIRE_LEN, 2: _WIRE_VARINT, 3: _WIRE_LEN}.get(field, wire_type)
    if wire_type != expected:
      raise WireError(f"Malformed chunk message: field {field} has wire type {wire_type}.")
    if field == 1:
      headers.append(value)
    elif field == 2:
      index = (value & 0xFFFF_FFFF) - ((value & 0x8000_0000) << 1)  # int32, two's complement.
    elif field == 3:
      data = value
  header = None
  if headers:
    try:
      header = header_type.FromString(b"".join(headers))
    except DecodeError as e:
      raise WireError(f"Malformed chunk message: undecodable header: {e}") from e
  return ChunkFrame(header, index, data, end)


def as_frame(chunk: object, header_type: type) -> ChunkFrame:
  """A ChunkFrame of a chunk given as a frame, its serialized bytes, or a protobuf message.

  Raises:
    WireError: if serialized bytes are malformed.
  """
  if isinstance(chunk, ChunkFrame):
    return chunk
  if isinstance(chunk, bytes | bytearray | memoryview):
    return parse_chunk(chunk, header_type)
  header = chunk.header if chunk.HasField("header") else None
  return ChunkFrame(header, chunk.index, memoryview(chunk.data), chunk.ByteSize())


def _read_stream(
  chunks: Iterable,
  layout: wire.Layout,
  *,
  header_type: type,
  max_bytes: int | None,
  max_chunk_bytes: int,
  base_for: Callable[[object], Mapping[str, np.ndarray] | None],
  alloc: wire.Allocator | None = None,
  check_finite: bool = True,
) -> tuple[object, dict[str, np.ndarray]]:
  """Reads a chunk stream: (header of chunk 0, decoded values). Rejects bad streams early.

  Chunks may be ChunkFrames, serialized messages or protobuf messages (`as_frame`). The header is
  checked (by `base_for` too, which returns the base of a delta or None) before any further chunk
  is read; each chunk is then decoded as soon as it is next in order, and dropped.
  """
  it = iter(chunks)
  first = next(it, None)
  if first is None:
    raise WireError("Empty chunk stream: expected at least one chunk with a header.")
  first = as_frame(first, header_type)
  if first.index != 0 or first.header is None:
    raise WireError(f"The first chunk must be index 0 with a header, got index {first.index}.")
  header = first.header
  if header.codec not in compression.CODECS:
    raise WireError(f"Unknown codec {header.codec!r}; expected one of {compression.CODECS}.")
  asm = ChunkAssembler(
    num_chunks=header.num_chunks,
    total_bytes=header.total_bytes,
    max_total_bytes=wire.max_wire_bytes(layout) if max_bytes is None else max_bytes,
    max_chunk_bytes=max_chunk_bytes,
    keep=False,
  )
  reader = wire.FragmentReader(
    layout,
    codec_name=header.codec,
    max_bytes=max_bytes,
    base=base_for(header),
    alloc=alloc,
    check_finite=check_finite,
  )
  for data in asm.add(first.index, first.data):
    reader.feed(data)
  for c in it:
    frame = as_frame(c, header_type)
    if frame.header is not None:
      raise WireError(f"Chunk {frame.index} carries a header; only the first chunk may.")
    for data in asm.add(frame.index, frame.data):
      reader.feed(data)
  asm.check_complete()  # Before the reader's own end checks: a missing chunk is named as such.
  return header, reader.finish()


def _wrap(message: type, pieces: Iterable[bytes]) -> tuple[list, int]:
  """(messages with index and data, total bytes); the header is set on message 0 afterwards.

  Each chunk's bytes go into its message as they come and are dropped, so only one chunk of
  `bytes` is alive at a time: its memory is reused for the next instead of faulted in anew.
  """
  out, total = [], 0
  for i, data in enumerate(pieces):
    out.append(message(index=i, data=data))
    total += len(data)
  return out, total


def _push_header(report: Report, codec: str, total: int, num_chunks: int, delta: bool):
  return syncer_pb2.PushHeader(
    learner_id=report.learner_id,
    fragment=report.fragment,
    anchor_version=report.anchor_version,
    tokens=report.tokens,
    steps=report.steps,
    step=report.step,
    step_time_s=report.step_time_s,
    new_tokens=report.new_tokens,
    round_step=report.round_step,
    codec=codec,
    total_bytes=total,
    num_chunks=num_chunks,
    delta=delta,
  )


def _push_encoder(
  report: Report, codec: str, block_size: int, anchor_values: Mapping[str, np.ndarray] | None
) -> wire.FragmentEncoder:
  if report.outer_gradient:
    raise ValueError("A push takes θ (report.values) and Θ^(anchor); it forms δ itself.")
  if anchor_values is None:
    return wire.FragmentEncoder(report.values, codec, block_size=block_size)
  if report.anchor_version < 0:
    raise ValueError("A delta push needs anchor_version >= 0 (the learner never received p).")
  return wire.outer_gradient_encoder(report.values, anchor_values, codec, block_size=block_size)


def _framed(encoder: wire.FragmentEncoder, header: bytes, chunk_size: int) -> Iterator[bytes]:
  """The encoder's chunks as serialized chunk messages, the serialized header on chunk 0."""
  return encoder.chunks(
    chunk_size, prefix=lambda i, n: chunk_prefix(i, n, header if i == 0 else None)
  )


def push_messages(
  report: Report,
  codec: str,
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  anchor_values: Mapping[str, np.ndarray] | None = None,
) -> Iterator[bytes]:
  """A learner's report as the serialized PushChunk messages of a Push stream (docs/algorithm.md §3).

  The bytes of `[m.SerializeToString() for m in report_to_chunks(...)]`, but each message is
  encoded only when it is asked for, in one piece with one copy per payload byte: a client can
  send chunk i while chunk i + 1 is encoded, and protobuf never copies the payload. The header
  (chunk 0) announces the exact size, known before anything is encoded.

  Args:
    report: the report; `report.values` are θ_{m,p}.
    codec: the uplink codec name.
    block_size: int8/int4 scale block size.
    chunk_size: payload bytes per chunk (the receiver's limit must be at least this).
    anchor_values: Θ^(anchor) as the learner holds it; if given, the payload is the outer
      gradient δ = Θ^(anchor) − θ (docs/algorithm.md §5), which the syncer merges as decoded, and
      the header says `delta`.

  Returns:
    An iterator over the messages' bytes.

  Raises:
    ValueError: at once on a bad codec, keys, shapes or anchor; while iterating, on a NaN/Inf value
      (the stream then ends short, and a receiver refuses it as incomplete).
  """
  encoder = _push_encoder(report, codec, block_size, anchor_values)
  header = _push_header(
    report, codec, encoder.nbytes, encoder.num_chunks(chunk_size), anchor_values is not None
  ).SerializeToString()
  return _framed(encoder, header, chunk_size)


def report_to_chunks(
  report: Report,
  codec: str,
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  anchor_values: Mapping[str, np.ndarray] | None = None,
) -> list[syncer_pb2.PushChunk]:
  """A learner's report as a Push stream of protobuf messages: chunk 0 carries the header (docs/algorithm.md §3).

  The messages `push_messages` serializes (the client sends those; these are for inspection,
  accounting and tests).

  Args:
    report: the report; `report.values` are θ_{m,p}.
    codec: the uplink codec name.
    block_size: int8/int4 scale block size.
    chunk_size: bytes per chunk (the receiver's limit must be at least this).
    anchor_values: Θ^(anchor) as the learner holds it; if given, the payload is the outer
      gradient δ = Θ^(anchor) − θ (docs/algorithm.md §5), which the syncer merges as decoded, and
      the header says `delta`.

  Raises:
    ValueError: if the values cannot be encoded (NaN/Inf) or a delta has no valid anchor version.
  """
  encoder = _push_encoder(report, codec, block_size, anchor_values)
  out, total = _wrap(syncer_pb2.PushChunk, encoder.chunks(chunk_size))
  header = _push_header(report, codec, total, len(out), anchor_values is not None)
  out[0].header.CopyFrom(header)
  return out


def chunks_to_report(
  chunks: Iterable[syncer_pb2.PushChunk | bytes | ChunkFrame],
  layout_keys: Sequence[str],
  shapes: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
  dtypes: Sequence[object] | Mapping[str, object],
  *,
  max_bytes: int | None = None,
  max_chunk_bytes: int = DEFAULT_CHUNK_SIZE,
  alloc: wire.Allocator | None = None,
  check_finite: bool = True,
) -> Report:
  """Rebuilds a Report from a Push stream, validating everything (docs/architecture.md).

  The layout (keys, shapes, dtypes) is that of the fragment named in the header: a service reads the
  first chunk, picks the layout of `header.fragment` and passes `itertools.chain([first], rest)`.

  Args:
    chunks: the stream, as PushChunk messages, their serialized bytes or ChunkFrames; chunk 0 must
      carry the header.
    layout_keys: keys of the fragment.
    shapes: expected shapes, by key order or mapping.
    dtypes: expected dtypes, likewise.
    max_bytes: payload size limit; defaults to `max_wire_bytes` of the layout.
    max_chunk_bytes: per-chunk size limit.
    alloc: makes the arrays the values are decoded into (`wire.FragmentReader`); a service passes
      `chunks.ArrayPool.empty` to recycle the memory of reports it no longer holds.
    check_finite: refuse NaN/Inf values (WireError). A service that files the report into a
      `SyncerCore` passes False: the core checks every value, fused with RDA's first pass.

  Returns:
    The report, values cast to the layout dtypes: θ, or for a `delta` header the outer gradient
    δ = Θ^(anchor) − θ as decoded (`Report.outer_gradient`; no anchor is needed to read it).

  Raises:
    WireError: on any malformed chunk, header, payload or value (NaN/Inf with check_finite).
  """

  def base_for(header) -> Mapping[str, np.ndarray] | None:
    if header.learner_id < 0 or header.fragment < 0 or header.anchor_version < -1:
      raise WireError(
        f"Header ids out of range: learner_id {header.learner_id}, fragment {header.fragment}, "
        f"anchor_version {header.anchor_version}."
      )
    bad = counter_error(
      tokens=int(header.tokens),
      steps=int(header.steps),
      step=int(header.step),
      new_tokens=int(header.new_tokens),
      round_step=int(header.round_step),
    ) or step_time_error(float(header.step_time_s))
    if bad is not None:
      raise WireError(f"Bad header: {bad}.")
    if header.delta and header.anchor_version < 0:
      raise WireError("An outer gradient (delta) push needs anchor_version >= 0.")
    return None  # θ, or δ read as it is.

  layout = wire.make_layout(layout_keys, shapes, dtypes)
  header, values = _read_stream(
    chunks,
    layout,
    header_type=syncer_pb2.PushHeader,
    max_bytes=max_bytes,
    max_chunk_bytes=max_chunk_bytes,
    base_for=base_for,
    alloc=alloc,
    check_finite=check_finite,
  )
  return Report(
    learner_id=int(header.learner_id),
    fragment=int(header.fragment),
    values=values,
    tokens=int(header.tokens),
    steps=int(header.steps),
    anchor_version=int(header.anchor_version),
    step=int(header.step),
    step_time_s=float(header.step_time_s),
    new_tokens=int(header.new_tokens),
    round_step=int(header.round_step),
    outer_gradient=bool(header.delta),
  )


def _lookup(lookup: BaseLookup | None, version: int, what: str, field: str) -> Mapping:
  if version < 0:
    raise WireError(f"A {what} needs {field} >= 0, got {version}.")
  if lookup is None:
    raise WireError(f"A {what} needs its base values; the receiver was given no lookup.")
  try:
    return lookup(version)
  except KeyError as e:
    raise WireError(f"Base version {version} of this {what} is not available: {e}") from e


def _state_encoder(
  state: FragmentState, codec: str, block_size: int, base: FragmentState | None
) -> tuple[wire.FragmentEncoder, str]:
  """(the encoder of a Pull payload, the digest of what the receiver will hold; docs/algorithm.md §4.7)."""
  if base is not None and base.fragment != state.fragment:
    raise ValueError(f"base is fragment {base.fragment}, state is fragment {state.fragment}.")
  base_values = None if base is None else base.values
  encoder = wire.FragmentEncoder(state.values, codec, block_size=block_size, base=base_values)
  exact = compression.codec_class(codec).exact and base is None
  exact = exact and all(np.asarray(v).dtype.itemsize <= 4 for v in state.values.values())
  if exact:
    return encoder, state.digest
  view = wire.received_values(state.values, codec, block_size=block_size, base=base_values)
  return encoder, values_digest(view)


def _fragment_header(
  *, fragment: int, version: int, digest: str, codec: str, total: int, num_chunks: int, base: int
) -> syncer_pb2.FragmentHeader:
  return syncer_pb2.FragmentHeader(
    fragment=fragment,
    version=version,
    digest=digest,
    codec=codec,
    total_bytes=total,
    num_chunks=num_chunks,
    base_version=base,
  )


def state_messages(
  state: FragmentState,
  codec: str,
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  base: FragmentState | None = None,
) -> Iterator[bytes]:
  """A global fragment version as the serialized FragmentChunk messages of a Pull stream.

  The bytes of `[m.SerializeToString() for m in state_to_chunks(...)]`, made as `push_messages`
  makes a Push stream: each message when it is asked for, in one piece, with one copy per payload
  byte (a service sends them with no protobuf serializer: `service._add_servicer`).

  Args:
    state: the version to send.
    codec: the downlink codec name.
    block_size: int8/int4 scale block size.
    chunk_size: payload bytes per chunk.
    base: an older version the receiver holds; if given the payload is state − base (docs/algorithm.md §5).

  Raises:
    ValueError: at once if `base` is another fragment; while iterating, if the values cannot be
      encoded.
  """
  encoder, digest = _state_encoder(state, codec, block_size, base)
  header = _fragment_header(
    fragment=state.fragment,
    version=state.version,
    digest=digest,
    codec=codec,
    total=encoder.nbytes,
    num_chunks=encoder.num_chunks(chunk_size),
    base=-1 if base is None else base.version,
  ).SerializeToString()
  return _framed(encoder, header, chunk_size)


def state_to_chunks(
  state: FragmentState,
  codec: str,
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  base: FragmentState | None = None,
) -> list[syncer_pb2.FragmentChunk]:
  """A global fragment version as a Pull stream of protobuf messages (docs/algorithm.md §4.7).

  The messages `state_messages` serializes (a service sends those; these are for inspection,
  accounting and tests). The header digest is that of `received_values(...)`, what the receiver
  will hold: with "fp32" and no base that is `state.digest`; otherwise the syncer must hold
  (adopt) those values for the digests to agree (docs/algorithm.md §5).

  Args:
    state: the version to send.
    codec: the downlink codec name.
    block_size: int8/int4 scale block size.
    chunk_size: bytes per chunk.
    base: an older version the receiver holds; if given the payload is state − base (docs/algorithm.md §5).

  Raises:
    ValueError: if the values cannot be encoded or `base` is another fragment.
  """
  msgs = state_messages(state, codec, block_size=block_size, chunk_size=chunk_size, base=base)
  return [syncer_pb2.FragmentChunk.FromString(m) for m in msgs]


def encoded_state_messages(
  pieces: Sequence[bytes],
  *,
  fragment: int,
  version: int,
  digest: str,
  codec: str,
  base_version: int,
) -> list[bytes]:
  """A Pull stream of already-serialized payload pieces (e.g. a delta the syncer encoded once),
  as serialized FragmentChunk messages (`state_messages`); one copy of each piece.

  `digest` must be that of what the receiver will hold after decoding (docs/algorithm.md §4.7).
  """
  pieces = list(pieces) or [b""]
  header = _fragment_header(
    fragment=fragment,
    version=version,
    digest=digest,
    codec=codec,
    total=sum(map(len, pieces)),
    num_chunks=len(pieces),
    base=base_version,
  ).SerializeToString()
  return [chunk_prefix(i, len(d), header if i == 0 else None) + d for i, d in enumerate(pieces)]


def chunks_to_state(
  chunks: Iterable[syncer_pb2.FragmentChunk | bytes | ChunkFrame],
  layout_keys: Sequence[str],
  shapes: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
  dtypes: Sequence[object] | Mapping[str, object],
  *,
  base_lookup: BaseLookup | None = None,
  max_bytes: int | None = None,
  max_chunk_bytes: int = DEFAULT_CHUNK_SIZE,
) -> FragmentState:
  """Rebuilds a FragmentState from a Pull stream and checks its digest (docs/algorithm.md §4.7).

  Args:
    chunks: the stream, as FragmentChunk messages, their serialized bytes or ChunkFrames; chunk 0
      must carry the header.
    layout_keys: keys of the fragment.
    shapes: expected shapes, by key order or mapping.
    dtypes: expected dtypes, likewise.
    base_lookup: version -> the receiver's values of that version; required for delta streams.
    max_bytes: payload size limit; defaults to `max_wire_bytes` of the layout.
    max_chunk_bytes: per-chunk size limit.

  Returns:
    The state, values cast to the layout dtypes, with the header's (verified) digest.

  Raises:
    WireError: on any malformed chunk, header or payload, an unavailable base, or a digest mismatch.
  """

  def base_for(header) -> Mapping[str, np.ndarray] | None:
    if header.fragment < 0 or header.version < 0 or header.base_version < -1:
      raise WireError(
        f"Header ids out of range: fragment {header.fragment}, version {header.version}, "
        f"base_version {header.base_version}."
      )
    if header.base_version < 0:
      return None
    return _lookup(base_lookup, header.base_version, "delta fragment", "base_version")

  layout = wire.make_layout(layout_keys, shapes, dtypes)
  header, values = _read_stream(
    chunks,
    layout,
    header_type=syncer_pb2.FragmentHeader,
    max_bytes=max_bytes,
    max_chunk_bytes=max_chunk_bytes,
    base_for=base_for,
  )
  digest = values_digest(values)
  if digest != header.digest:
    raise WireError(
      f"Digest mismatch for fragment {header.fragment} v{header.version}: "
      f"received values hash to {digest}, the header says {header.digest!r}."
    )
  return FragmentState(int(header.fragment), int(header.version), values, digest)
