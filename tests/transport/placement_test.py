"""Receiving in place (transport/placement.py) and the flat piece streams it pairs with.

The socket is left out: a chunk the placement claims is copied into the claimed memory here, as
the bulk port's `FrameReader` reads it there, and handed to the reader as a `ChunkFrame`.
"""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.codecs import Fp32
from ddiloco.fragments.run_decoder import RunDecoder
from ddiloco.protocol import Report
from ddiloco.testing.wire import push_messages
from ddiloco.transport import frames, messages, wire
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_encoder import FragmentEncoder
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2

CHUNK = 4096
RNG = np.random.default_rng(0)
# Three keys: their payloads start at odd offsets, and chunks straddle entries.
VALUES = {
  "a": RNG.standard_normal((40, 33)).astype(np.float32),
  "b/c": RNG.standard_normal(5).astype(np.float32),
  "d": RNG.standard_normal((3000,)).astype(np.float32),
}
ANCHOR = {k: v + np.float32(0.5) for k, v in VALUES.items()}
SHAPES = {k: v.shape for k, v in VALUES.items()}
DTYPES = {k: v.dtype for k, v in VALUES.items()}


def _report(values=VALUES) -> Report:
  return Report(
    learner_id=0,
    fragment=0,
    values=values,
    tokens=1,
    steps=1,
    anchor_version=0,
    step=1,
    round_step=1,
  )


def _placed(chunks, placement: Placement):
  """The chunk messages as a bulk receiver hands them on: claimed ones copied in place."""
  for message in chunks:
    head = frames.plain_head(message[: frames.PLAIN_HEAD_BYTES], len(message))
    if head is None:
      frame = frames.parse_chunk(message, syncer_pb2.PushHeader)
      placement.skip(frame.index, len(frame.data))
      yield frame
      continue
    index, at = head
    into = placement.claim(index, len(message) - at)
    if into is None:
      yield frames.ChunkFrame(None, index, memoryview(message)[at:], len(message))
      continue
    into[:] = message[at:]
    yield frames.ChunkFrame(None, index, into, len(message))


def _read(chunks, placement=None, **kw) -> Report:
  return messages.chunks_to_report(
    chunks, list(VALUES), SHAPES, DTYPES, max_chunk_bytes=CHUNK, placement=placement, **kw
  )


def test_an_empty_fragment_has_one_chunk():
  empty = list(FragmentEncoder({}, "fp32").framed(CHUNK, lambda i, n: b"[%d:%d]" % (i, n)))
  assert empty[0] == b"[0:10]" and len(empty) == 2  # The format's header only, in chunk 0.


def test_plain_head_agrees_with_protobufs_parse():
  data = bytes(range(200))
  for index in (1, 127, 128, 2**31 - 1):
    message = frames.chunk_prefix(index, len(data)) + data
    got = frames.plain_head(message[: frames.PLAIN_HEAD_BYTES], len(message))
    parsed = frames.parse_chunk(message, syncer_pb2.PushHeader)
    assert got is not None and got[0] == parsed.index == index
    assert message[got[1] :] == bytes(parsed.data)
  header = syncer_pb2.PushHeader(fragment=1).SerializeToString()
  others = [
    frames.chunk_prefix(0, len(data), header) + data,  # A header: parsed whole.
    frames.chunk_prefix(2, len(data)) + data + b"\x20\x01",  # A field after the data.
    frames.chunk_prefix(2, len(data) + 1) + data,  # Data past the message's end.
    frames.chunk_prefix(-1, len(data)) + data,  # A negative index.
    b"\x10\x02\x20\x01" + frames.chunk_prefix(0, len(data))[0:0] + b"\x1a\x05abcde",  # Unknown.
    frames.chunk_prefix(3, 0),  # No data field at all.
  ]
  for message in others:
    assert frames.plain_head(message[: frames.PLAIN_HEAD_BYTES], len(message)) is None


def _read_placed(codec: str, **read_kw):
  """A push in `codec` read with placement: (values read without it, values read with it, how
  many frames of "d" were received into its output array itself)."""
  chunks = list(push_messages(_report(), codec, chunk_size=CHUNK, anchor_values=ANCHOR))
  want = _read(chunks).values
  placement = Placement()
  handed = []

  def watched():
    for frame in _placed(chunks, placement):
      handed.append(frame)
      yield frame

  got = _read(watched(), placement, **read_kw).values
  in_place = [f for f in handed if np.shares_memory(np.frombuffer(f.data, np.uint8), got["d"])]
  return want, got, len(in_place)


def test_a_placed_push_decodes_to_the_same_values_in_place():
  want, got, in_place = _read_placed("fp32")
  for k in VALUES:
    np.testing.assert_array_equal(got[k], want[k])
  # "d" (12000 bytes) spans whole chunks: those were received into its output array itself.
  assert in_place >= 2


def test_a_placed_bf16_push_kept_as_sent_is_received_into_its_bfloat16_arrays():
  want, got, in_place = _read_placed("bf16", as_sent=True, check_finite=False)
  for k in VALUES:
    assert got[k].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[k].astype(np.float32), want[k])
  # "d" (6000 bytes of bf16) spans a whole chunk: received into its output array itself.
  assert in_place >= 1


def test_chunks_out_of_order_stop_placement_and_still_decode():
  chunks = list(push_messages(_report(), "fp32", chunk_size=CHUNK, anchor_values=ANCHOR))
  order = [0, 2, 1, *range(3, len(chunks))]
  placement = Placement()
  got = _read(_placed([chunks[i] for i in order], placement), placement).values
  want = _read(chunks).values
  for k in VALUES:
    np.testing.assert_array_equal(got[k], want[k])
  assert placement.claim(len(chunks), 10) is None  # Stopped for good.


def test_entries_in_another_order_decode_into_fresh_arrays():
  """A valid stream whose entries are not in key order: the offered arrays do not match where the
  entries start, so each gets a fresh array; placed bytes land in unused memory, never in a
  value."""
  body = b"".join(
    [
      wire.FILE_HEADER.pack(wire.MAGIC, wire.FORMAT_VERSION, 3),
      *(
        _entry(k)
        for k in ("d", "b/c", "a")  # Reverse order.
      ),
    ]
  )
  header = messages.push_header(_report(), "fp32", len(body), -(-len(body) // CHUNK), True)
  pieces = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
  chunks = [
    frames.chunk_prefix(i, len(p), header.SerializeToString() if i == 0 else None) + p
    for i, p in enumerate(pieces)
  ]
  placement = Placement()
  got = _read(_placed(chunks, placement), placement).values
  for k, theta in VALUES.items():
    np.testing.assert_array_equal(got[k], ANCHOR[k] - theta)


def _entry(key: str) -> bytes:
  delta = (ANCHOR[key] - VALUES[key]).astype("<f4")
  enc = FragmentEncoder({key: ANCHOR[key]}, "fp32")
  head = enc._entries[0][1]
  return head + delta.tobytes()


def test_a_placed_stream_with_extra_bytes_is_refused():
  chunks = list(push_messages(_report(), "fp32", chunk_size=CHUNK, anchor_values=ANCHOR))
  extra = frames.chunk_prefix(len(chunks), 8) + b"\0" * 8  # One chunk more than announced.
  placement = Placement()
  with pytest.raises(WireError, match="out of range"):
    _read(_placed([*chunks, extra], placement), placement)


def test_in_place_values_are_still_checked_for_nan():
  out = np.zeros(64, np.float32)
  out[5] = np.nan
  decoder = RunDecoder(Fp32(), out, check=True)
  decoder.feed(memoryview(out).cast("B"))  # The bytes are already there.
  assert decoder.close() == 1
  quiet = RunDecoder(Fp32(), out.copy(), check=False)
  quiet.feed(memoryview(out).cast("B"))  # Elsewhere: copied.
  assert quiet.close() == 0


def test_placement_claims_only_whole_ranges_of_offered_arrays():
  placement = Placement()
  out = np.zeros(10, np.float32)
  placement.offer(100, out)
  assert placement.claim(0, 100) is None  # Stream bytes [0, 100): before the array.
  view = placement.claim(1, 40)  # [100, 140): all of it.
  assert view is not None and len(view) == 40
  assert placement.claim(2, 1) is None  # [140, 141): past it.
  with pytest.raises(ValueError):
    placement.offer(0, np.zeros(4, ">f4"))
