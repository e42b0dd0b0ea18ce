"""Cutting serialized payloads into ~1 MiB chunks and putting them back together, checked.

gRPC messages have a size cap and large messages stall a stream, so payloads travel as chunks
(ARCHITECTURE.md: ~1 MiB measured best on loopback). The receiver learns `num_chunks` and
`total_bytes` from the first chunk's header and checks every chunk against them *before* buffering,
so an oversized or malformed stream is rejected without holding its bytes.
"""

from collections.abc import Iterable

from ddiloco.transport.errors import WireError, WireSizeError

DEFAULT_CHUNK_SIZE = 1 << 20


def chunk(data: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
  """Cuts `data` into pieces of `chunk_size` bytes (the last may be shorter).

  Empty data gives one empty chunk, so every payload has at least one chunk to carry its header.

  Raises:
    ValueError: if chunk_size < 1.
  """
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
  if not data:
    return [b""]
  view = memoryview(data)
  return [bytes(view[i : i + chunk_size]) for i in range(0, len(data), chunk_size)]


def num_chunks_for(total_bytes: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
  """Number of chunks `chunk` makes of `total_bytes` bytes."""
  return max(1, -(-total_bytes // chunk_size))


class ChunkAssembler:
  """Accepts chunks in any order and returns the payload once all arrived, validating each."""

  def __init__(
    self,
    *,
    num_chunks: int,
    total_bytes: int,
    max_total_bytes: int,
    max_chunk_bytes: int = DEFAULT_CHUNK_SIZE,
  ):
    """Prepares to receive `num_chunks` chunks adding up to `total_bytes`.

    Raises:
      WireError: if the announced counts are impossible or over the limits.
    """
    if num_chunks < 1:
      raise WireError(f"num_chunks must be >= 1, got {num_chunks}.")
    if total_bytes < 0:
      raise WireError(f"total_bytes must be >= 0, got {total_bytes}.")
    if total_bytes > max_total_bytes:
      raise WireSizeError(
        f"Oversized payload: {total_bytes} bytes announced, the limit is {max_total_bytes}."
      )
    if num_chunks > num_chunks_for(total_bytes, 1):
      raise WireError(f"{num_chunks} chunks announced for only {total_bytes} bytes.")
    if total_bytes > num_chunks * max_chunk_bytes:
      raise WireError(
        f"{total_bytes} bytes cannot fit in {num_chunks} chunks of at most {max_chunk_bytes} bytes."
      )
    self._num_chunks = num_chunks
    self._total = total_bytes
    self._max_chunk = max_chunk_bytes
    self._parts: dict[int, bytes] = {}
    self._received = 0

  def add(self, index: int, data: bytes) -> None:
    """Stores chunk `index`.

    Raises:
      WireError: on an index out of range, a repeated index, a chunk over the size limit, or more
        bytes than announced.
    """
    if not 0 <= index < self._num_chunks:
      raise WireError(f"Chunk index {index} out of range [0, {self._num_chunks}).")
    if index in self._parts:
      raise WireError(f"Duplicate chunk index {index}.")
    if len(data) > self._max_chunk:
      raise WireSizeError(f"Chunk {index} has {len(data)} bytes, the limit is {self._max_chunk}.")
    if self._received + len(data) > self._total:
      raise WireError(
        f"Chunk {index} brings the payload to {self._received + len(data)} bytes, "
        f"more than the {self._total} announced."
      )
    self._parts[index] = bytes(data)
    self._received += len(data)

  def result(self) -> bytes:
    """The payload, in index order.

    Raises:
      WireError: if chunks are missing or the bytes fall short of `total_bytes`.
    """
    missing = [i for i in range(self._num_chunks) if i not in self._parts]
    if missing:
      raise WireError(
        f"Missing {len(missing)} of {self._num_chunks} chunk(s), first indices {missing[:5]}."
      )
    if self._received != self._total:
      raise WireError(f"Received {self._received} bytes, {self._total} announced.")
    return b"".join(self._parts[i] for i in range(self._num_chunks))


def reassemble(
  chunks: Iterable[tuple[int, bytes]],
  *,
  num_chunks: int,
  total_bytes: int,
  max_total_bytes: int,
  max_chunk_bytes: int = DEFAULT_CHUNK_SIZE,
) -> bytes:
  """Joins (index, bytes) chunks into the payload; see `ChunkAssembler` for the checks.

  Raises:
    WireError: on any inconsistency between the chunks and the announced counts or limits.
  """
  asm = ChunkAssembler(
    num_chunks=num_chunks,
    total_bytes=total_bytes,
    max_total_bytes=max_total_bytes,
    max_chunk_bytes=max_chunk_bytes,
  )
  for index, data in chunks:
    asm.add(index, data)
  return asm.result()
