"""A chunk stream's receiving end, shared by a push (`messages`) and a pull (`state_messages`).

`read_stream` checks a stream's header from chunk 0 and decodes each chunk as it comes, in
order, straight into the output arrays (`FragmentReader`): chunks are never joined.
"""

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from ddiloco.fragments import compression
from ddiloco.transport import wire
from ddiloco.transport.chunks import ChunkAssembler
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_reader import FragmentReader
from ddiloco.transport.frames import as_frame
from ddiloco.transport.placement import Placement


def read_stream(
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
  as_sent: Callable[[object], bool] | None = None,
) -> tuple[object, dict[str, np.ndarray], dict[str, float]]:
  """(header of chunk 0, values, `FragmentReader.sq_norms` if `norms(header)`) of a chunk stream.

  Chunks may be ChunkFrames, serialized messages or protobuf messages (`as_frame`). The header is
  checked (by `base_for` too, which returns the base of a delta or None) before any further chunk
  is read; each chunk is then decoded as soon as it is next in order, and dropped. `norms(header)`
  and `as_sent(header)` say whether the reader sums the norms and keeps values as sent
  (`FragmentReader`).
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
    as_sent=as_sent is not None and as_sent(header),
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
