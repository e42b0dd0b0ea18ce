"""Reports as chunk streams (a push's PushChunk messages); `state_messages` makes a pull's.

Builds on `wire` (payload format), `chunks` (cutting and reassembly) and `chunk_stream` (a
stream's two ends). The first chunk carries the header; the receiver checks the header's sizes
against its limits before buffering the rest, so a service can reject a bad stream at the door
(docs/architecture.md). A service that needs the fragment id to pick the layout reads the first
chunk itself and passes `itertools.chain([first], rest)`.

Copies (scripts/bench_wire.py): the sender hands the encoder's runs to the socket as pieces
(`push_pieces`, `FragmentEncoder.framed`); the receiver checks the header from chunk 0, then
decodes each chunk as it comes, in order, straight into the output arrays (`FragmentReader`):
chunks are never joined. A receiver passes messages parsed by hand (`frames.parse_chunk`):
protobuf's message objects would copy every payload byte twice on each side. Only the small
header submessage goes through protobuf.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ddiloco.fragments import compression
from ddiloco.protocol import Report, counter_error, step_time_error
from ddiloco.transport import wire
from ddiloco.transport.chunk_stream import read_stream
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_encoder import FragmentEncoder, outer_gradient_encoder
from ddiloco.transport.frames import ChunkFrame, chunk_prefix
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2


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

  `encoded`: δ already encoded in `codec` (per key, payload and scales; fragments/device_codec.py);
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
  """A learner's report as the PushChunk messages of a push (docs/algorithm.md §3), as one flat
  stream of pieces, nothing copied (`FragmentEncoder.framed`).

  The bytes protobuf makes of the messages, each with `frame(message_head, data_len)` in front in
  place of its head (the fields before its data; `frame` adds the data plane's framing,
  `bulk_wire.frame_head`). Each message is encoded only when it is asked for: a sender sends run
  i while run i + 1 is encoded, and protobuf never copies the payload. The header (chunk 0)
  announces the exact size, known before anything is encoded. A memoryview piece may be
  overwritten once the next piece is asked for: send it first. `bulk_wire.messages_of` joins the
  pieces into whole messages.

  Args:
    report: the report; `report.values` are θ_{m,p}.
    codec: the uplink codec name.
    frame: makes the bytes in front of a message's data from its head and the data's length.
    block_size: int8/int4 scale block size.
    chunk_size: payload bytes per chunk (the receiver's limit must be at least this).
    anchor_values: Θ^(anchor) as the learner holds it; if given, the payload is the outer
      gradient δ = Θ^(anchor) − θ (docs/algorithm.md §5), which the syncer merges as decoded, and
      the header says `delta`.
    encoded: δ already encoded in `codec` (`push_encoder`; sent as it is).

  Raises:
    ValueError: at once on a bad codec, keys, shapes or anchor; while iterating, on a NaN/Inf value
      (the stream then ends short, and a receiver refuses it as incomplete).
  """
  encoder = push_encoder(report, codec, block_size, anchor_values, encoded)
  header = push_header(
    report, codec, encoder.nbytes, encoder.num_chunks(chunk_size), anchor_values is not None
  ).SerializeToString()
  return encoder.framed(
    chunk_size, lambda i, n: frame(chunk_prefix(i, n, header if i == 0 else None), n)
  )


def kept_dtype(codec: str) -> np.dtype | None:
  """The dtype `chunks_to_report(as_sent=True)` keeps a float32 tensor's δ in when pushed in
  `codec` (bf16: bfloat16), or None if it decodes it to float32."""
  kept = compression.get_codec(codec).payload_dtype
  return None if kept is None or kept == np.float32 else kept


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
  as_sent: bool = False,
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
    as_sent: keep a `delta` push's values of float32 tensors as sent when the codec's payload
      widens exactly to them (bf16: bfloat16 arrays, `FragmentReader(as_sent=)`): for a receiver
      that widens them where it reads them (the syncer's merge, `syncer.types.Report`).

  Returns:
    The report, values cast to the layout dtypes: θ, or for a `delta` header the outer gradient
    δ = Θ^(anchor) − θ as decoded (`Report.outer_gradient`; no anchor is needed to read it), or
    as sent (`as_sent`).

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
  header, values, sq_norms = read_stream(
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
    as_sent=lambda header: as_sent and bool(header.delta),
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
