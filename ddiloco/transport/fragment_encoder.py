"""`FragmentEncoder`: a fragment checked, framed and encoded into the wire format, chunk by chunk.

The format is described in `wire`; `fragment_reader` reads it back.
"""

import math
import struct
import threading
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from ddiloco.fragments import compression
from ddiloco.fragments.codec import F32, RUN_VALUES, Codec
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, ChunkWriter, Prefix, num_chunks_for
from ddiloco.transport.wire import (
  ENTRY_TAIL,
  FILE_HEADER,
  FORMAT_VERSION,
  MAGIC,
  U8,
  U16,
  resolve_dtype,
)

# Fragments of fewer values are encoded on the calling thread alone (`encode_in_parts`'s callers):
# a thread's start and join (~0.1 ms) would cost more than half of what a second part saves.
SPLIT_VALUES = 1 << 18

# Values per run of a payload sent piece by piece (`framed`) or encoded in parts: 1 MiB of
# float32, a quarter of the calls per byte of `RUN_VALUES` for about the same cache behaviour
# (int4 of 64 MiB: 20.8 against 24.3 ms on one thread, and 14.1 against 26.0 ms on two, which
# contend for the interpreter between numpy's calls; scripts/bench_host_encode.py).
SEND_RUN_VALUES = 1 << 18


def _entry_head(key: str, shape: tuple[int, ...], dtype: str, codec: Codec) -> bytes:
  """The framing of one entry, up to its payload (see the format in `wire`'s module docstring)."""
  kb, db = key.encode("utf-8"), dtype.encode("ascii")
  if len(kb) > 0xFFFF or len(shape) > 0xFF:
    raise ValueError(f"{key!r}: key longer than 65535 bytes or more than 255 dims.")
  payload_len, scales_len = codec.nbytes(math.prod(shape))
  return b"".join(
    [
      U16.pack(len(kb)),
      kb,
      U8.pack(codec.wire_id),
      U8.pack(len(db)),
      db,
      U8.pack(len(shape)),
      struct.pack(f"<{len(shape)}Q", *shape),
      ENTRY_TAIL.pack(codec.block_size if codec.quantized else 0, payload_len, scales_len),
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
    received: Mapping[str, np.ndarray] | None = None,
    finite: bool = False,
    encoded: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
  ):
    """Checks and frames `values`.

    Args:
      values: {key: float array}; the dtype recorded for each key is the array's own.
      codec_name: "fp32", "bf16", "int8" or "int4" (docs/algorithm.md §5).
      block_size: values per absmax scale block for int8/int4.
      base: if given, `values − base` is encoded (a delta, docs/algorithm.md §5); dtypes recorded are still those
        of `values`.
      received: per key, a flat array of the value's size: as each run is encoded, it is filled
        with what a receiver makes of the bytes, `cast(base + decoded)` (`read_layout` with the
        base), bit for bit, from the encoding itself (`Codec.encode_run_into`); no decoding
        pass. For a sender that must hold what its receivers hold (the lossy downlink); needs
        `base`.
      finite: the caller vouches that `values` are finite (the syncer's published versions,
        checked when merged; receivers check them again): with "fp32" and no base, a float32
        array's own bytes are the payload, handed out as they are (no copy, no pass over them).
      encoded: per key, its payload (uint8) and float32 scales, already encoded in this codec
        (a learner's devices encode δ: fragments/device_codec.py); `values` then only name the
        keys, shapes and dtypes, and no base is taken. Their sizes are checked here.

    Raises:
      ValueError: on an unknown codec, a base with other keys or shapes, or a key/shape the format
        cannot hold.
    """
    self._codec = compression.get_codec(codec_name, block_size)
    if base is not None and set(base) != set(values):
      raise ValueError(f"base keys differ from values keys: {sorted(set(base) ^ set(values))[:3]}.")
    if received is not None and (base is None or set(received) != set(values)):
      raise ValueError("`received` needs a base and one output array per key.")
    if encoded is not None and (base is not None or set(encoded) != set(values)):
      raise ValueError("`encoded` needs one (payload, scales) per key and no base.")
    self._received = received
    self._as_is = finite and base is None and self._codec.exact and self._codec.unit_bytes == 4
    self._encoded = encoded
    self._entries = []
    self.nbytes = FILE_HEADER.size
    for key in sorted(values):
      x = np.asarray(values[key])
      b = None if base is None else np.asarray(base[key])
      if b is not None and b.shape != x.shape:
        raise ValueError(f"{key!r}: base shape {b.shape} != values shape {x.shape}.")
      shape = tuple(int(d) for d in x.shape)
      if received is not None and (received[key].ndim != 1 or received[key].size != x.size):
        raise ValueError(f"{key!r}: `received` needs a flat array of {x.size} values.")
      head = _entry_head(key, shape, resolve_dtype(x.dtype).name, self._codec)
      if encoded is not None:
        sizes = tuple(np.asarray(a).nbytes for a in encoded[key])
        if sizes != self._codec.nbytes(x.size):
          raise ValueError(
            f"{key!r}: encoded as {sizes} bytes, expected {self._codec.nbytes(x.size)}."
          )
      self._entries.append((key, head, x, b))
      self.nbytes += len(head) + sum(self._codec.nbytes(x.size))

  def pieces(self, run_values: int | None = None) -> Iterator[bytes | np.ndarray]:
    """The serialized fragment, piece by piece in order (no full-size buffer).

    A piece may be overwritten once the next is asked for. `run_values`: as `Codec.encode_runs`.

    Raises:
      ValueError: while iterating, on a NaN/Inf value (named by key).
    """
    codec = self._codec
    yield FILE_HEADER.pack(MAGIC, FORMAT_VERSION, len(self._entries))
    for key, head, x, b in self._entries:
      yield head
      if self._own_bytes(x, b):
        flat = x.reshape(-1)
        if self._as_is:
          yield memoryview(flat).cast("B")  # fp32 of float32, vouched finite: the bytes themselves.
        else:
          yield from _checked_runs(key, flat, run_values or RUN_VALUES)
        continue
      if self._encoded is not None:
        payload, scales = self._encoded[key]
        yield np.asarray(payload, np.uint8).reshape(-1)
        if scales.size:
          yield np.asarray(scales, F32).reshape(-1)
        continue
      scales = np.empty(codec.nbytes(x.size)[1] // 4, F32)
      filled = 0
      out = None if self._received is None else self._received[key]
      try:
        # With `received`, what a receiver decodes, base added, is written while the run is in
        # cache (`Codec.encode_run_into`).
        for payload, run_scales in codec.encode_runs(x, base=b, into=out, run_values=run_values):
          yield payload
          scales[filled : filled + run_scales.size] = run_scales
          filled += run_scales.size
      except ValueError as e:
        raise ValueError(f"{key!r}: {e}") from e
      if scales.size:
        yield scales  # The format puts an entry's scales after its whole payload.

  def _own_bytes(self, x: np.ndarray, b: np.ndarray | None) -> bool:
    """Whether `x`'s payload is its own bytes: fp32 of a C-contiguous float32 array, no base."""
    return (
      b is None
      and self._encoded is None
      and self._codec.exact
      and self._codec.unit_bytes == 4
      and isinstance(x, np.ndarray)
      and x.dtype == F32
      and x.flags.c_contiguous
    )

  def chunks(self, chunk_size: int = DEFAULT_CHUNK_SIZE, prefix: Prefix | None = None):
    """The serialized fragment cut into chunks of `chunk_size`, made one by one: `bytes`, or with
    a prefix, memoryviews of each chunk's own memory.

    Every byte is copied once, into its chunk (`ChunkWriter`), with `prefix(index, n)` in front of
    the chunk's n bytes if given. There is always at least one chunk.

    Raises:
      ValueError: at once if chunk_size < 1; while iterating, as `pieces`.
    """
    writer = ChunkWriter(chunk_size, prefix)
    return self._chunks_of(writer)

  def _chunks_of(self, writer: ChunkWriter) -> Iterator[bytes | memoryview]:
    for piece in self.pieces():
      yield from writer.write(piece)
    yield from writer.flush()
    if writer.nbytes != self.nbytes:  # The framing and the codecs disagree: a bug, not bad input.
      raise AssertionError(f"Serialized {writer.nbytes} bytes, announced {self.nbytes}.")

  def framed(self, chunk_size: int, head: Prefix) -> Iterator[bytes | memoryview]:
    """The serialized fragment cut into chunks of `chunk_size`, with `head(index, n)` in front of
    each chunk's n bytes, as one flat stream of pieces, nothing copied.

    For a sender that writes each piece to a socket as it comes (the bulk port: one kernel copy
    per byte, from the encoder's cache-sized runs). The `bytes` pieces stay valid; a memoryview
    piece may be overwritten once the next piece is asked for, so it must be sent first. There is
    always at least one chunk.

    Raises:
      ValueError: at once if chunk_size < 1; while iterating, as `pieces`.
    """
    if chunk_size < 1:
      raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    return self._framed(chunk_size, head)

  def _framed(self, chunk_size: int, head: Prefix) -> Iterator[bytes | memoryview]:
    index, left, done = 0, 0, 0
    for piece in self.pieces(SEND_RUN_VALUES):
      view = memoryview(piece).cast("B")
      while view:
        if not left:
          left = min(chunk_size, self.nbytes - done)
          yield head(index, left)
          index += 1
        m = min(left, len(view))
        yield piece if isinstance(piece, bytes) and m == len(piece) else view[:m]
        view, left, done = view[m:], left - m, done + m
    if not index:
      yield head(0, 0)  # Every payload has a chunk to carry its header.
    if done != self.nbytes or left:  # The framing and the codecs disagree: a bug.
      raise AssertionError(f"Serialized {done} bytes, announced {self.nbytes}.")

  def num_chunks(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """How many chunks `chunks(chunk_size)` makes."""
    return num_chunks_for(self.nbytes, chunk_size)


def _checked_runs(key: str, flat: np.ndarray, run: int) -> Iterator[memoryview]:
  """A float32 array's own bytes run by run, each run checked for NaN/Inf as it is handed out.

  A finite float32 dot product of a run with itself proves the run finite (a NaN or ±Inf makes
  it NaN or Inf), and costs one read of the run, which the sender's copy then finds in cache;
  only a run whose dot product is not finite (also an overflow of finite values) is checked value
  by value. No copy is made.

  Raises:
    ValueError: on a NaN/Inf, before the run that holds it is handed out.
  """
  for start in range(0, flat.size, run):
    piece = flat[start : start + run]
    with np.errstate(over="ignore", invalid="ignore"):  # Judged below, not warned about.
      dot = float(np.dot(piece, piece))
    if not math.isfinite(dot) and not np.isfinite(piece).all():
      bad = int(np.count_nonzero(~np.isfinite(flat)))
      raise ValueError(
        f"{key!r}: Refusing to encode {bad} non-finite value(s) (NaN/Inf or beyond float32 range)."
      )
    yield memoryview(piece).cast("B")


def serialize_chunks(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  received: Mapping[str, np.ndarray] | None = None,
) -> Iterator[bytes]:
  """`FragmentEncoder(...)`'s serialized fragment cut into chunks of `chunk_size`, made one by one as iterated.

  Every byte is copied once, into its chunk, and no joined copy is made: a sender that wraps each
  chunk in its message as it comes holds one chunk of `bytes` at a time. `received`: as
  `FragmentEncoder`'s.

  Yields:
    The chunks in order; one empty chunk for an empty payload (there is always one).

  Raises:
    ValueError: at once on a bad codec, base, key or shape, or if chunk_size < 1; while iterating,
      on a NaN/Inf value.
  """
  encoder = FragmentEncoder(values, codec_name, block_size=block_size, base=base, received=received)
  return encoder.chunks(chunk_size)


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


def encode_in_parts(
  values: Mapping[str, np.ndarray],
  codec_name: str,
  *,
  block_size: int = 64,
  base: Mapping[str, np.ndarray] | None = None,
  workers: int,
  received: Mapping[str, np.ndarray] | None = None,
  allocate: Callable[[list[tuple[int, np.dtype]]], list[np.ndarray]] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Each key's payload and scales of `values` (− `base`) in `codec_name`, encoded in `workers`
  parts of about equal size, each on its own thread (numpy releases the GIL in its loops).

  A value's bytes, scales and decoded value depend only on its own block, so parts cut at block
  (and payload unit: int4's byte) boundaries give the bytes of one encoding of the whole, which
  `FragmentEncoder(..., encoded=)` then frames. The calling thread encodes the first part.

  Args:
    values, base, received: as `FragmentEncoder`'s (`received` filled part by part).
    codec_name, block_size: the codec.
    workers: parts (threads), >= 1.
    allocate: makes the output arrays from (count, dtype) specs, a payload's (uint8) and its
      scales' (float32) per key in sorted key order (a pool's); default `np.empty`.

  Raises:
    ValueError: on workers < 1, or on a value the codec refuses (a NaN/Inf: named by key and
      counted over its whole array, as `FragmentEncoder.pieces` says it).
  """
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}.")
  codec = compression.get_codec(codec_name, block_size)
  keys = sorted(values)
  sizes = {k: int(np.size(values[k])) for k in keys}
  specs = []
  for k in keys:
    payload, scales = codec.nbytes(sizes[k])
    specs += [(payload, np.dtype(np.uint8)), (scales // 4, np.dtype(np.float32))]
  arrays = allocate(specs) if allocate is not None else [np.empty(n, d) for n, d in specs]
  encoded = {k: (arrays[2 * i], arrays[2 * i + 1]) for i, k in enumerate(keys)}
  grain = math.lcm(block_size if codec.quantized else 1, codec.values_per_unit)
  share = -(-sum(sizes.values()) // workers)
  parts: list[list[tuple[str, int, int]]] = [[] for _ in range(workers)]
  done = 0
  for k in keys:
    start = 0
    while start < sizes[k]:
      w = min(done // share, workers - 1)
      cut = (w + 1) * share - done  # Values left to this worker's share.
      stop = sizes[k] if w == workers - 1 else min(sizes[k], start + cut)
      stop = min(sizes[k], -(-stop // grain) * grain)
      parts[w].append((k, start, stop))
      done += stop - start
      start = stop
  failed: list[tuple[str, BaseException]] = []

  def encode(part: list[tuple[str, int, int]]) -> None:
    key = ""
    try:
      for key, start, stop in part:
        x = np.ravel(np.asarray(values[key]))[start:stop]
        b = None if base is None else np.ravel(np.asarray(base[key]))[start:stop]
        into = None if received is None else received[key][start:stop]
        payload, scales = encoded[key]
        at = start // codec.values_per_unit * codec.unit_bytes
        s_at = start // block_size if codec.quantized else 0
        runs = codec.encode_runs(x, base=b, into=into, run_values=SEND_RUN_VALUES)
        for run_payload, run_scales in runs:
          payload[at : at + run_payload.size] = run_payload
          scales[s_at : s_at + run_scales.size] = run_scales
          at, s_at = at + run_payload.size, s_at + run_scales.size
    except BaseException as e:  # Re-raised on the calling thread, below.
      failed.append((key, e))

  helpers = [threading.Thread(target=encode, args=(part,), daemon=True) for part in parts[1:]]
  for t in helpers:
    t.start()
  encode(parts[0])
  for t in helpers:
    t.join()
  if failed:
    key, error = min(failed, key=lambda f: f[0])
    if not isinstance(error, ValueError):
      raise error
    # The key's whole array again on this thread, for the error counted over all of it.
    b = None if base is None else base[key]
    try:
      for _ in codec.encode_runs(values[key], base=b):
        pass
    except ValueError as e:
      raise ValueError(f"{key!r}: {e}") from e
    raise ValueError(f"{key!r}: {error}") from error
  return encoded
