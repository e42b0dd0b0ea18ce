"""Reports and fragment versions as gRPC chunk streams (Push / Pull of syncer.proto).

Builds on `wire` (payload format) and `chunks` (cutting and reassembly). The first chunk carries the
header; the receiver checks the header's sizes against its limits before buffering the rest, so a
service can reject a bad stream at the door (docs/architecture.md). A service that needs the fragment id
to pick the layout reads the first chunk itself and passes `itertools.chain([first], rest)`.

Copies (scripts/bench_wire.py): the sender encodes straight into the chunks' bytes
(`FragmentEncoder`); the receiver checks the header (and looks up a delta's base) from chunk
0, then decodes each chunk as it comes, in order, straight into the output arrays
(`FragmentReader`): chunks are never joined. `push_messages` and `state_messages` make each
serialized chunk message in one piece while the stream is being sent, and a receiver passes
messages parsed by hand (`frames.parse_chunk`): protobuf's message objects would copy every payload
byte twice on each side. Only the small header submessage goes through protobuf.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ddiloco.fragments import compression
from ddiloco.fragments.digest import values_digest
from ddiloco.protocol import FragmentState, Report, counter_error, step_time_error
from ddiloco.transport import wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, ChunkAssembler
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_encoder import FragmentEncoder, outer_gradient_encoder
from ddiloco.transport.fragment_reader import FragmentReader
from ddiloco.transport.frames import ChunkFrame, as_frame, chunk_prefix
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2

BaseLookup = Callable[[int], Mapping[str, np.ndarray]]


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
  placement: Placement | None = None,
  norms: Callable[[object], bool] | None = None,
) -> tuple[object, dict[str, np.ndarray], dict[str, float]]:
  """(header of chunk 0, values, `FragmentReader.sq_norms` if `norms(header)`) of a chunk stream.

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
  reader = FragmentReader(
    layout,
    codec_name=header.codec,
    max_bytes=max_bytes,
    base=base_for(header),
    alloc=alloc,
    check_finite=check_finite,
    placement=placement,
    norms=norms is not None and norms(header),
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
  values = reader.finish()
  return header, values, reader.sq_norms


def push_header(report: Report, codec: str, total: int, num_chunks: int, delta: bool):
  """The PushHeader of a report's stream: `total` payload bytes in `num_chunks` chunks."""
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


def push_encoder(
  report: Report,
  codec: str,
  block_size: int,
  anchor_values: Mapping[str, np.ndarray] | None,
  encoded: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> FragmentEncoder:
  """The encoder of a report's Push payload: θ, or with `anchor_values` δ = Θ^(anchor) − θ.

  `encoded`: δ already encoded in `codec` (per key, payload and scales; fragments/device_int4.py);
  needs `anchor_values`, which then give the keys, shapes and dtypes, and ignores report.values.

  Raises:
    ValueError: on a report that already holds δ, or a delta without an anchor version.
  """
  if report.outer_gradient:
    raise ValueError("A push takes θ (report.values) and Θ^(anchor); it forms δ itself.")
  if encoded is not None:
    if anchor_values is None or report.anchor_version < 0:
      raise ValueError("An encoded δ needs its anchor (anchor_version >= 0).")
    return FragmentEncoder(anchor_values, codec, block_size=block_size, encoded=encoded)
  if anchor_values is None:
    return FragmentEncoder(report.values, codec, block_size=block_size)
  if report.anchor_version < 0:
    raise ValueError("A delta push needs anchor_version >= 0 (the learner never received p).")
  return outer_gradient_encoder(report.values, anchor_values, codec, block_size=block_size)


def _framed(encoder: FragmentEncoder, header: bytes, chunk_size: int) -> Iterator[bytes]:
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
  encoded: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Iterator[bytes]:
  """A learner's report as the serialized PushChunk messages of a Push stream (docs/algorithm.md §3).

  The bytes protobuf makes of the stream's PushChunk messages, but each message is encoded only
  when it is asked for, in one piece with one copy per payload byte: a client can send chunk i
  while chunk i + 1 is encoded, and protobuf never copies the payload. The header (chunk 0)
  announces the exact size, known before anything is encoded.

  Args:
    report: the report; `report.values` are θ_{m,p}.
    codec: the uplink codec name.
    block_size: int8/int4 scale block size.
    chunk_size: payload bytes per chunk (the receiver's limit must be at least this).
    anchor_values: Θ^(anchor) as the learner holds it; if given, the payload is the outer
      gradient δ = Θ^(anchor) − θ (docs/algorithm.md §5), which the syncer merges as decoded, and
      the header says `delta`.
    encoded: δ already encoded in `codec` (`push_encoder`).

  Returns:
    An iterator over the messages' bytes.

  Raises:
    ValueError: at once on a bad codec, keys, shapes or anchor; while iterating, on a NaN/Inf value
      (the stream then ends short, and a receiver refuses it as incomplete).
  """
  encoder = push_encoder(report, codec, block_size, anchor_values, encoded)
  header = push_header(
    report, codec, encoder.nbytes, encoder.num_chunks(chunk_size), anchor_values is not None
  ).SerializeToString()
  return _framed(encoder, header, chunk_size)


def push_pieces(
  report: Report,
  codec: str,
  frame: Callable[[bytes, int], bytes],
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  anchor_values: Mapping[str, np.ndarray] | None = None,
  encoded: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Iterator[bytes | memoryview]:
  """`push_messages`' stream as one flat stream of pieces, nothing copied (`FragmentEncoder.framed`).

  The same messages, byte for byte, each with `frame(message_head, data_len)` in front in place of
  its head (the fields before its data; `frame` adds a transport's framing, e.g. the bulk port's
  length). A memoryview piece may be overwritten once the next piece is asked for: send it first.
  `encoded`: δ already encoded, as `push_messages`' (sent as it is).

  Raises:
    ValueError: as `push_messages`.
  """
  encoder = push_encoder(report, codec, block_size, anchor_values, encoded)
  header = push_header(
    report, codec, encoder.nbytes, encoder.num_chunks(chunk_size), anchor_values is not None
  ).SerializeToString()
  return encoder.framed(
    chunk_size, lambda i, n: frame(chunk_prefix(i, n, header if i == 0 else None), n)
  )


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
  placement: Placement | None = None,
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
    alloc: makes the arrays the values are decoded into (`FragmentReader`); a service passes
      `chunks.ArrayPool.empty` to recycle the memory of reports it no longer holds.
    check_finite: refuse NaN/Inf values (WireError). A service that files the report into a
      `SyncerCore` passes False: the core checks every value, fused with RDA's first pass; and
      for a delta push, that pass is made here as the values arrive (`Report.sq_norms`).
    placement: where the stream's socket reader receives chunks in place (transport/placement.py).

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
  header, values, sq_norms = _read_stream(
    chunks,
    layout,
    header_type=syncer_pb2.PushHeader,
    max_bytes=max_bytes,
    max_chunk_bytes=max_chunk_bytes,
    base_for=base_for,
    alloc=alloc,
    check_finite=check_finite,
    placement=placement,
    norms=None if check_finite else lambda header: bool(header.delta),  # The core's pass, here.
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
    sq_norms=sq_norms if header.delta and not check_finite else None,
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
) -> tuple[FragmentEncoder, str]:
  """(the encoder of a Pull payload, the digest of what the receiver will hold; docs/algorithm.md §4.7)."""
  if base is not None and base.fragment != state.fragment:
    raise ValueError(f"base is fragment {base.fragment}, state is fragment {state.fragment}.")
  base_values = None if base is None else base.values
  # A served version's values are finite (checked when merged) and never mutated.
  encoder = FragmentEncoder(
    state.values, codec, block_size=block_size, base=base_values, finite=True
  )
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

  The bytes protobuf makes of the stream's FragmentChunk messages, made as `push_messages`
  makes a Push stream: each message when it is asked for, in one piece, with one copy per payload
  byte (a service sends them with no protobuf serializer: `distributed/server.py`, `_add_servicer`).

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
  encoder, header = _state_stream(state, codec, block_size, chunk_size, base)
  return _framed(encoder, header, chunk_size)


def state_pieces(
  state: FragmentState,
  codec: str,
  frame: Callable[[bytes, int], bytes],
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  base: FragmentState | None = None,
) -> Iterator[bytes | memoryview]:
  """`state_messages`' stream as one flat stream of pieces, nothing copied, each message with
  `frame(message_head, data_len)` in front (as `push_pieces`). A memoryview piece may be
  overwritten once the next piece is asked for: send it first."""
  encoder, header = _state_stream(state, codec, block_size, chunk_size, base)
  return encoder.framed(
    chunk_size, lambda i, n: frame(chunk_prefix(i, n, header if i == 0 else None), n)
  )


def _state_stream(
  state: FragmentState, codec: str, block_size: int, chunk_size: int, base: FragmentState | None
) -> tuple[FragmentEncoder, bytes]:
  """(the encoder of a Pull stream's payload, its serialized FragmentHeader)."""
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
  return encoder, header


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
  placement: Placement | None = None,
  alloc: wire.Allocator | None = None,
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
    placement: where the stream's socket reader receives chunks in place (transport/placement.py).
    alloc: makes the arrays the values are decoded into (`FragmentReader`; e.g. a client's
      `chunks.ArrayPool.empty`, recycling what it pulled before).

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
  header, values, _ = _read_stream(
    chunks,
    layout,
    header_type=syncer_pb2.FragmentHeader,
    max_bytes=max_bytes,
    max_chunk_bytes=max_chunk_bytes,
    base_for=base_for,
    placement=placement,
    alloc=alloc,
  )
  digest = values_digest(values)
  if digest != header.digest:
    raise WireError(
      f"Digest mismatch for fragment {header.fragment} v{header.version}: "
      f"received values hash to {digest}, the header says {header.digest!r}."
    )
  return FragmentState(int(header.fragment), int(header.version), values, digest)
