"""Receiving a stream's payload bytes straight into the arrays they decode to (the bulk port).

An fp32 payload of a float32 array with no base decodes to its own bytes: decoding is a copy. A
receiver that knows where a chunk's bytes belong can read them from the socket into the output
array itself (the kernel's one copy), and decoding then finds them in place and copies nothing.
`Placement` is the meeting point of the two ends of a receive, which run in two threads:

- the reader of the fragment (`fragment_reader.FragmentReader`, handler thread) `offer`s each
  output array with the stream offset its payload will start at, once the stream's header has
  been checked (it predicts the offsets of an encoding in the sender's layout, key order);
- the socket reader (bulk port, its own thread) `claim`s each chunk as it arrives, in order: it
  gets the bytes of an offered array the chunk's data covers, or None (read it into a buffer as
  usual). It passes the chunk on as a `frames.ChunkFrame` whose data is that memory.

Nothing is trusted: the reader checks every entry's framing as always, and uses an offered array
only if the entry's payload really starts where it was predicted; a placed chunk is handed to the
reader like any other, whose in-place decode is then a no-op (`RunDecoder`). A chunk out of order,
or one whose data cannot be told apart without parsing the whole message, stops placement for the
rest of the stream (`stop`): it is then read and decoded as before. A refused stream's arrays are
dropped with it. Only this stream's own arrays are ever written.
"""

import threading

import numpy as np


class Placement:
  """Output arrays offered by a stream's reader, claimed chunk by chunk by its socket reader."""

  def __init__(self):
    self._lock = threading.Lock()
    self._ranges: list[tuple[int, int, memoryview]] = []  # (stream start, end, the array's bytes)
    self._next = 0  # Index of the chunk expected next, in order.
    self._offset = 0  # Stream offset of its first data byte.
    self._stopped = False

  def offer(self, start: int, out: np.ndarray) -> None:
    """Stream bytes [start, start + out.nbytes) are `out`'s bytes, in order (the reader)."""
    if out.dtype.byteorder == ">" or not out.flags.c_contiguous:
      raise ValueError("Only native C-contiguous arrays receive bytes in place.")
    with self._lock:
      if not self._stopped:
        # Through uint8: a dtype numpy cannot export (bfloat16) has bytes all the same.
        self._ranges.append((start, start + out.nbytes, memoryview(out.reshape(-1).view(np.uint8))))

  def claim(self, index: int, nbytes: int) -> memoryview | None:
    """Where chunk `index`, of `nbytes` data bytes, is received: memory of an offered array
    covering all of it, or None. Called for every chunk in arrival order (`skip` when the chunk
    must be read whole anyway); a chunk out of order stops placement."""
    with self._lock:
      start = self._advance(index, nbytes)
      if start is None:
        return None
      for lo, hi, view in self._ranges:
        if lo <= start and start + nbytes <= hi:
          return view[start - lo : start - lo + nbytes]
    return None

  def skip(self, index: int, nbytes: int) -> None:
    """Chunk `index` of `nbytes` data bytes arrived and is read into a buffer of its own."""
    with self._lock:
      self._advance(index, nbytes)

  def stop(self) -> None:
    """No more chunks are placed (a chunk that could not be parsed, or the stream's end)."""
    with self._lock:
      self._stopped = True
      self._ranges = []

  def _advance(self, index: int, nbytes: int) -> int | None:
    if self._stopped or index != self._next:
      self._stopped, self._ranges = True, []
      return None
    start = self._offset
    self._next, self._offset = index + 1, start + nbytes
    return start
