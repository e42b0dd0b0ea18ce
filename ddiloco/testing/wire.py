"""One-shot and protobuf-object forms of the wire stack's streaming API, for tests and inspection.

The library streams: `FragmentEncoder` and `FragmentReader` work chunk by chunk, and
`messages.push_pieces` / `state_messages.state_pieces` make a stream's chunk messages as pieces
while they are sent. These make and read the same bytes whole, and the same streams as protobuf
message objects.
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from ddiloco.protocol import FragmentState, Report
from ddiloco.transport import bulk_wire, messages, state_messages, wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE
from ddiloco.transport.fragment_encoder import FragmentEncoder
from ddiloco.transport.fragment_reader import read_layout
from ddiloco.transport.proto import syncer_pb2


def serialize_fragment(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
) -> bytes:
  """Encodes a fragment into the versioned wire format (`wire`'s module docstring), in one piece.

  The arguments are `FragmentEncoder`'s.

  Returns:
    The serialized bytes.

  Raises:
    ValueError: as `FragmentEncoder`, or on non-finite values.
  """
  encoder = FragmentEncoder(values, codec_name, block_size=block_size, base=base)
  (data,) = encoder.chunks(max(1, encoder.nbytes))  # One chunk: one copy per byte.
  return data


def deserialize_fragment(
  data: wire.Buffer | Sequence[wire.Buffer],
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
  layout = wire.make_layout(layout_keys, shapes, dtypes)
  return read_layout(data, layout, codec_name=codec_name, max_bytes=max_bytes, base=base)


def received_outer_gradient(
  theta: Mapping[str, np.ndarray],
  anchor: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
) -> dict[str, np.ndarray]:
  """The outer gradient δ = Θ^(anchor) − θ as the syncer decodes it from `outer_gradient_encoder`'s
  bytes, bit for bit, without the framing.

  Raises:
    ValueError: as `received_values`.
  """
  return wire.received_values(anchor, codec_name, block_size=block_size, base=theta, add_base=False)


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


def report_to_chunks(
  report: Report,
  codec: str,
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  anchor_values: Mapping[str, np.ndarray] | None = None,
) -> list[syncer_pb2.PushChunk]:
  """A learner's report as a Push stream of protobuf messages: chunk 0 carries the header (docs/algorithm.md §3).

  The messages `messages.push_pieces` makes (the client sends those; these are for inspection,
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
  encoder = messages.push_encoder(report, codec, block_size, anchor_values)
  out, total = _wrap(syncer_pb2.PushChunk, encoder.chunks(chunk_size))
  header = messages.push_header(report, codec, total, len(out), anchor_values is not None)
  out[0].header.CopyFrom(header)
  return out


def state_to_chunks(
  state: FragmentState,
  codec: str,
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  base: FragmentState | None = None,
) -> list[syncer_pb2.FragmentChunk]:
  """A global fragment version as a Pull stream of protobuf messages (docs/algorithm.md §4.7).

  The messages `state_messages.state_pieces` makes (a service sends those; these are for
  inspection, accounting and tests). The header digest is that of `received_values(...)`, what the receiver
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
  msgs = pull_messages(state, codec, block_size=block_size, chunk_size=chunk_size, base=base)
  return [syncer_pb2.FragmentChunk.FromString(m) for m in msgs]


def push_messages(report: Report, codec: str, **kwargs) -> Iterator[bytes]:
  """A push's serialized PushChunk messages, each whole: `messages.push_pieces` (with its
  keyword arguments) joined. Bad input raises at once; a NaN/Inf value while iterating."""
  pieces = messages.push_pieces(report, codec, bulk_wire.frame_head, **kwargs)
  return (bytes(m) for m in bulk_wire.messages_of(pieces))


def pull_messages(state: FragmentState, codec: str, **kwargs) -> Iterator[bytes]:
  """A pull's serialized FragmentChunk messages, each whole: `state_messages.state_pieces`
  (with its keyword arguments) joined."""
  pieces = state_messages.state_pieces(state, codec, bulk_wire.frame_head, **kwargs)
  return (bytes(m) for m in bulk_wire.messages_of(pieces))
