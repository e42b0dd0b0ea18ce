"""Cutting serialized payloads into chunks and putting them back together, checked.

Payloads travel as chunks (the bulk port's 4 MiB, `ServiceConfig.bulk_chunk_bytes`; 1 MiB in a
Recover's gRPC messages, whose size is capped): each costs both ends per-message work, and a
receiver bounds what it holds by the chunk. The receiver learns `num_chunks` and `total_bytes` from
the first chunk's header and checks every chunk against them *before* buffering, so an oversized
or malformed stream is rejected without holding its bytes.

Copies (scripts/bench_wire.py): `ChunkWriter` cuts a stream of writes into chunks, one copy per
byte, no full-size buffer (the downlink's cached deltas: each chunk's message made in that copy).
The receiver decodes each chunk as `ChunkAssembler` hands it on in order
(`fragment_reader.FragmentReader`), then drops it: nothing is joined, a chunk may be a view into
the received message (never copied), and a chunk's memory is reused for the next instead of being
faulted in anew.
"""

import collections
import threading
import weakref
from collections.abc import Callable, Iterable

import numpy as np

from ddiloco.fragments import buffers
from ddiloco.transport.errors import WireError, WireSizeError

DEFAULT_CHUNK_SIZE = 1 << 20
# Room for a chunk's protobuf framing and header on top of its payload bytes: a message limit is
# the chunk size plus this, at both ends (the client's channel and the server's).
FRAMING_SLACK = 64 * 1024
# (chunk index, chunk bytes) -> bytes to put in front of the chunk (`FragmentEncoder.framed`).
Prefix = Callable[[int, int], bytes]


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


class ChunkWriter:
  """Cuts a stream of writes into chunks of `chunk_size` payload bytes (the last may be shorter).

  Each byte is copied once, into its chunk, and chunks are handed out as they complete, so a
  sender can hand each on and drop it. Without a prefix a chunk is `bytes`: a write that fills
  whole chunks becomes them directly, smaller pieces gather in one reused chunk-sized buffer.
  With a prefix, pieces gather in the chunk's own buffer behind room for its prefix, written when
  the chunk is complete, and the chunk is handed out as a memoryview of that buffer: the chunk's
  message is made in the one copy of its bytes, not copied again behind its prefix.

  Attributes:
    nbytes: bytes written so far.
  """

  def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, prefix: Prefix | None = None):
    """Prepares an empty stream.

    Args:
      chunk_size: payload bytes per chunk.
      prefix: if given, each chunk comes as `prefix(index, n)` followed by its n bytes (a chunk's
        message framing, written with its data rather than copied in later). A prefix must not
        be longer for a short last chunk than for a whole one, or that chunk costs a copy more.

    Raises:
      ValueError: if chunk_size < 1.
    """
    if chunk_size < 1:
      raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    self._size = chunk_size
    self._prefix = prefix
    self._buf: memoryview | None = None  # numpy-backed: no zero fill, huge pages when large.
    self._head = 0  # Bytes kept in front of the buffer's payload for its prefix.
    self._fill = 0
    self._emitted = 0
    self.nbytes = 0

  def write(self, data: bytes | memoryview | np.ndarray) -> list[bytes | memoryview]:
    """Appends the bytes of `data` (any C-contiguous buffer); returns the chunks it completed."""
    view = memoryview(data).cast("B")
    self.nbytes += len(view)
    size, out = self._size, []
    while view:
      if not self._fill and len(view) >= size:
        out.append(self._chunk(view[:size]))
        view = view[size:]
        continue
      if self._buf is None:
        # With a prefix every chunk is a buffer of its own (handed out); else one is reused.
        self._head = 0 if self._prefix is None else len(self._prefix(self._emitted, size))
        self._buf = memoryview(np.empty(self._head + size, np.uint8))
      m = min(len(view), size - self._fill)
      at = self._head + self._fill
      self._buf[at : at + m] = view[:m]
      self._fill += m
      view = view[m:]
      if self._fill == size:
        out.append(self._take())
    return out

  def _take(self) -> bytes | memoryview:
    """The buffered chunk."""
    fill, self._fill = self._fill, 0
    if self._prefix is None:
      return self._chunk(self._buf[:fill])
    buf, head, self._buf = self._buf, self._head, None
    index = self._emitted
    self._emitted += 1
    framing = self._prefix(index, fill)
    start = head - len(framing)
    if start < 0:  # Longer than a whole chunk's: put together anew.
      return b"".join((framing, buf[head : head + fill]))
    buf[start:head] = framing
    return buf[start : head + fill]

  def _chunk(self, data: memoryview) -> bytes:
    """The next chunk of `data`, its prefix in front (one copy of `data`)."""
    index = self._emitted
    self._emitted += 1
    if self._prefix is None:
      return bytes(data)
    return b"".join((self._prefix(index, len(data)), data))

  def flush(self) -> list[bytes | memoryview]:
    """The partial last chunk, if any; one empty chunk if the stream had no bytes at all."""
    if self._fill:
      return [self._take()]
    if not self._emitted:
      return [self._chunk(memoryview(b""))]  # Every payload has a chunk to carry its header.
    return []


def num_chunks_for(total_bytes: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
  """Number of chunks `chunk` makes of `total_bytes` bytes."""
  return max(1, -(-total_bytes // chunk_size))


class ChunkAssembler:
  """Accepts chunks in any order, validating each, and hands them on in index order.

  `add` returns the chunks that are next in order as soon as they are (the one just added, and
  any held back that it unblocks), so a caller can decode them at once and drop them
  (`fragment_reader.FragmentReader`). Only chunks that arrive early are held. With keep=True it also keeps
  them all, for `result`.
  """

  def __init__(
    self,
    *,
    num_chunks: int,
    total_bytes: int,
    max_total_bytes: int,
    max_chunk_bytes: int = DEFAULT_CHUNK_SIZE,
    keep: bool = True,
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
    self._early: dict[int, bytes | memoryview] = {}  # Arrived before their predecessors.
    self._kept: list[bytes | memoryview] | None = [] if keep else None
    self._next = 0  # Chunks [0, _next) have been handed on.
    self._received = 0

  def add(self, index: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    """Checks chunk `index` (bytes, or a byte-format memoryview); returns the chunks now in order.

    Raises:
      WireError: on an index out of range, a repeated index, a chunk over the size limit, or more
        bytes than announced.
    """
    if not 0 <= index < self._num_chunks:
      raise WireError(f"Chunk index {index} out of range [0, {self._num_chunks}).")
    if index < self._next or index in self._early:
      raise WireError(f"Duplicate chunk index {index}.")
    if len(data) > self._max_chunk:
      raise WireSizeError(f"Chunk {index} has {len(data)} bytes, the limit is {self._max_chunk}.")
    if self._received + len(data) > self._total:
      raise WireError(
        f"Chunk {index} brings the payload to {self._received + len(data)} bytes, "
        f"more than the {self._total} announced."
      )
    self._received += len(data)
    self._early[index] = data  # Kept as given (e.g. a view into the received message): no copy.
    ready = []
    while self._next in self._early:
      ready.append(self._early.pop(self._next))
      self._next += 1
    if self._kept is not None:
      self._kept += ready
    return ready

  def check_complete(self) -> None:
    """Raises WireError if chunks are missing or the bytes fall short of `total_bytes`."""
    missing = [i for i in range(self._next, self._num_chunks) if i not in self._early]
    if missing:
      raise WireError(
        f"Missing {len(missing)} of {self._num_chunks} chunk(s), first indices {missing[:5]}."
      )
    if self._received != self._total:
      raise WireError(f"Received {self._received} bytes, {self._total} announced.")

  def result(self) -> bytes:
    """The payload, joined in index order (needs keep=True).

    Raises:
      WireError: if chunks are missing or the bytes fall short of `total_bytes`.
    """
    if self._kept is None:
      raise ValueError("result() needs keep=True: this assembler hands chunks on without them.")
    self.check_complete()
    return b"".join(self._kept)


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


class ArrayPool:
  """Recycles the memory of received arrays: `empty` reuses a buffer whose last array is gone.

  Why (scripts/bench_wire.py): a receiver decodes every push into fresh arrays, and the
  kernel zeroes fresh pages on first touch; glibc maps allocations above 32 MiB anew each time,
  so zeroing took ~19 % of a 64 MiB push's CPU (perf, scripts/bench_wire.py). A buffer comes back
  when every array made from it has died (a `weakref.finalize` on the array handed out, which its
  views keep alive), so nothing still in use is ever handed out twice. At most `max_free_bytes`
  of free buffers are kept; beyond that they are released. With `within_peak`, a buffer is also
  kept only while the free and the handed-out buffers together stay within the most that was ever
  handed out at once: the pool then never makes its owner hold more memory than it held at its
  busiest moment. Thread-safe; a buffer is owned by one array at a time.
  """

  def __init__(self, max_free_bytes: int, *, within_peak: bool = False):
    """Creates an empty pool.

    Raises:
      ValueError: if max_free_bytes < 0.
    """
    if max_free_bytes < 0:
      raise ValueError(f"max_free_bytes must be >= 0, got {max_free_bytes}.")
    self.max_free_bytes = max_free_bytes
    self._within_peak = within_peak
    self._free: collections.defaultdict[int, collections.deque] = collections.defaultdict(
      collections.deque
    )
    self._free_bytes = 0
    self._out_bytes = 0  # Bytes of the buffers handed out whose arrays are alive.
    self._peak_bytes = 0  # The most `_out_bytes` ever was.
    # Re-entrant: a finalizer may run inside `empty` (a garbage collection there) in this thread.
    self._lock = threading.RLock()
    self.reused = 0  # Arrays made from a recycled buffer (for tests and benchmarks).

  def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
    """A flat uninitialised array of `n` values of `dtype`, on a recycled buffer when one fits."""
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    with self._lock:
      free = self._free.get(nbytes)
      buf = free.pop() if free else None
      if buf is not None:
        self._free_bytes -= nbytes
        self.reused += 1
      self._out_bytes += nbytes
      self._peak_bytes = max(self._peak_bytes, self._out_bytes)
    if buf is None:
      buf = buffers.aligned_empty(nbytes, np.uint8)  # XLA reads it in place (buffers.py).
    # A view whose base is a memoryview, not `buf`: numpy then makes every further view's base
    # this array, so it lives as long as any of them does.
    out = np.frombuffer(memoryview(buf), dtype=dtype, count=n)
    out.flags.writeable = True  # frombuffer's arrays are read-only; `buf` is ours to write.
    weakref.finalize(out, self._give_back, buf)
    return out

  def _give_back(self, buf: np.ndarray) -> None:
    with self._lock:
      self._out_bytes -= buf.nbytes
      held = self._out_bytes + self._free_bytes + buf.nbytes
      if self._free_bytes + buf.nbytes <= self.max_free_bytes and (
        not self._within_peak or held <= self._peak_bytes
      ):
        self._free_bytes += buf.nbytes
        self._free[buf.nbytes].append(buf)

  @property
  def free_bytes(self) -> int:
    """Bytes of free buffers held now."""
    return self._free_bytes
