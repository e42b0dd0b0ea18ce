"""Fragment versions as chunk streams (a pull's FragmentChunk messages), as `messages` makes a push's.

A served version is sent as its values or as a delta against a version the receiver holds
(docs/algorithm.md §5), with the digest of what the receiver will hold (§4.7), which the receiver
checks after decoding.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ddiloco.fragments import compression
from ddiloco.fragments.digest import values_digest
from ddiloco.protocol import FragmentState
from ddiloco.transport import wire
from ddiloco.transport.chunk_stream import read_stream
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_encoder import FragmentEncoder
from ddiloco.transport.frames import ChunkFrame, chunk_prefix
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2

BaseLookup = Callable[[int], Mapping[str, np.ndarray]]


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


def state_pieces(
  state: FragmentState,
  codec: str,
  frame: Callable[[bytes, int], bytes],
  *,
  block_size: int = 64,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  base: FragmentState | None = None,
) -> Iterator[bytes | memoryview]:
  """A global fragment version as the FragmentChunk messages of a pull, as one flat stream of
  pieces, nothing copied, each message with `frame(message_head, data_len)` in front (as
  `messages.push_pieces`). A memoryview piece may be overwritten once the next piece is asked
  for: send it first.

  Args:
    state: the version to send.
    codec: the downlink codec name.
    frame: makes the bytes in front of a message's data from its head and the data's length.
    block_size: int8/int4 scale block size.
    chunk_size: payload bytes per chunk.
    base: an older version the receiver holds; if given the payload is state − base (docs/algorithm.md §5).

  Raises:
    ValueError: at once if `base` is another fragment; while iterating, if the values cannot be
      encoded.
  """
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


def encoded_state_messages(pieces: Sequence[bytes], **header) -> list[bytes]:
  """A pull stream of already-serialized payload pieces (e.g. a delta the syncer encoded once),
  as serialized FragmentChunk messages; one copy of each piece. `header`: the keywords of
  `headed_state_messages` (fragment, version, digest, codec, base_version).
  """
  pieces = list(pieces) or [b""]
  staged = [staged_prefix(i, len(d)) + d for i, d in enumerate(pieces)]
  return headed_state_messages(staged, sum(map(len, pieces)), **header)


def staged_prefix(index: int, nbytes: int) -> bytes:
  """The prefix (`FragmentEncoder.chunks(prefix=)`) of a pull stream's chunks cut before its header
  is known (`headed_state_messages`): every chunk after the first comes as its whole
  FragmentChunk message, made in its one copy; the first stays its bare data until then."""
  return chunk_prefix(index, nbytes) if index else b""


def headed_state_messages(
  staged: Sequence[bytes | memoryview],
  payload_bytes: int,
  *,
  fragment: int,
  version: int,
  digest: str,
  codec: str,
  base_version: int,
) -> list[bytes | memoryview]:
  """`encoded_state_messages` of a payload of `payload_bytes` cut with `staged_prefix` (the first
  chunk bare, the others whole messages already): byte for byte the same messages, and only the
  first chunk is copied again, behind its header.

  `digest` must be that of what the receiver will hold after decoding (docs/algorithm.md §4.7).
  """
  header = _fragment_header(
    fragment=fragment,
    version=version,
    digest=digest,
    codec=codec,
    total=payload_bytes,
    num_chunks=len(staged),
    base=base_version,
  ).SerializeToString()
  return [chunk_prefix(0, len(staged[0]), header) + staged[0], *staged[1:]]


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
  header, values, _ = read_stream(
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
