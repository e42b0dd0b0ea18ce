"""Streaming wire paths: chunks cut and decoded across unit boundaries, in any order.

Proposed as tests/transport/wire_stream_test.py (it only needs numpy and the transport package).
"""

import re

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.codec import RUN_VALUES
from ddiloco.fragments.compression import get_codec
from ddiloco.syncer.core import Report
from ddiloco.testing.codecs import decode, encode, roundtrip
from ddiloco.testing.wire import (
  deserialize_fragment,
  received_outer_gradient,
  report_to_chunks,
  serialize_fragment,
)
from ddiloco.transport import fragment_reader, wire
from ddiloco.transport.chunks import ArrayPool, ChunkAssembler, ChunkWriter
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_encoder import serialize_chunks
from ddiloco.transport.fragment_reader import FragmentReader, read_layout
from ddiloco.transport.messages import chunks_to_report


def _bits(a):
  return (a.dtype.name, a.shape, a.tobytes())


def test_chunk_writer_cuts_exact_chunks():
  w = ChunkWriter(4)
  got = (
    w.write(b"abc") + w.write(b"defghijklm") + w.write(b"") + w.write(np.arange(2, dtype=np.uint8))
  )
  # 3 + 10 + 0 + 2 = 15 bytes: chunks abcd, efgh, ijkl complete; "m\x00\x01" is the partial last.
  assert got == [b"abcd", b"efgh", b"ijkl"]
  assert w.flush() == [b"m\x00\x01"] and w.nbytes == 15
  assert ChunkWriter(4).flush() == [b""]  # An empty stream still has its one chunk.


def test_chunk_writer_puts_each_chunks_prefix_in_front():
  def prefix(index, n):
    return f"<{index}:{n}>".encode()

  w = ChunkWriter(4, prefix)
  # A whole chunk straight from a write (efgh), the buffered ones, and the partial last.
  got = w.write(b"abc") + w.write(b"defghijkl") + w.flush()
  assert got == [b"<0:4>abcd", b"<1:4>efgh", b"<2:4>ijkl"]
  assert w.nbytes == 12  # Payload bytes only.
  assert ChunkWriter(4, prefix).flush() == [b"<0:0>"]
  tail = ChunkWriter(4, prefix)
  assert tail.write(b"abcdef") + tail.flush() == [b"<0:4>abcd", b"<1:2>ef"]


def test_chunk_writer_makes_a_prefixed_chunk_in_its_own_memory():
  # Gathered pieces are written behind room for the prefix: the chunk is that memory, not a copy,
  # and no two chunks share it (a cache keeps them all).
  w = ChunkWriter(4, lambda index, n: b"#" * (index + 1))
  got = w.write(b"ab") + w.write(b"cdef") + w.write(b"gh") + w.flush()
  assert got == [b"#abcd", b"##efgh"]
  assert all(isinstance(c, memoryview) for c in got)
  assert got[0].obj is not got[1].obj
  got[0][1:] = b"wxyz"  # Each chunk owns its memory.
  assert bytes(got[1]) == b"##efgh"

  # A short last chunk whose prefix is shorter goes in the same memory; one longer than a whole
  # chunk's is put together anew.
  for prefix, want in ((lambda i, n: b"<" * n, b"<x"), (lambda i, n: b"<" * (5 - n), b"<<<<x")):
    tail = ChunkWriter(4, prefix)
    assert tail.write(b"x") + tail.flush() == [want]


def test_assembler_hands_chunks_on_in_order_without_keeping_them():
  asm = ChunkAssembler(
    num_chunks=3, total_bytes=5, max_total_bytes=5, max_chunk_bytes=2, keep=False
  )
  assert asm.add(2, b"e") == []  # Early: held until 0 and 1 are in.
  assert asm.add(0, b"ab") == [b"ab"]
  assert asm.add(1, b"cd") == [b"cd", b"e"]
  asm.check_complete()
  with pytest.raises(ValueError, match="needs keep=True"):
    asm.result()
  with pytest.raises(WireError, match=re.escape("Duplicate chunk index 1.")):
    asm.add(1, b"cd")


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("chunk_size", [1, 7, 13, 4096])
def test_serialize_chunks_join_to_the_one_shot_bytes(codec, chunk_size):
  rng = np.random.default_rng(0)
  vals = {
    "a": rng.standard_normal(1001).astype(np.float32),
    "b": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
  }
  base = {k: (v.astype(np.float32) + 0.5).astype(v.dtype) for k, v in vals.items()}
  pieces = list(serialize_chunks(vals, codec, block_size=7, base=base, chunk_size=chunk_size))
  one = serialize_fragment(vals, codec, block_size=7, base=base)
  assert b"".join(pieces) == one
  assert all(len(p) == chunk_size for p in pieces[:-1]) and 0 < len(pieces[-1]) <= chunk_size


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
def test_report_over_seven_byte_chunks_in_any_order(codec):
  # 7-byte chunks split fp32 (4-byte) and bf16 (2-byte) values and the framing across chunks.
  rng = np.random.default_rng(1)
  vals = {
    "w": rng.standard_normal(301).astype(np.float32),
    "h": rng.standard_normal(9).astype(np.float16),
  }
  anchor = {k: (v + np.float32(0.25)).astype(v.dtype) for k, v in vals.items()}
  r = Report(
    learner_id=0, fragment=0, values=vals, tokens=1, steps=1, anchor_version=0, step=0, round_step=0
  )
  chunks = report_to_chunks(r, codec, block_size=5, chunk_size=7, anchor_values=anchor)
  rest = chunks[1:]
  rng.shuffle(rest)
  back = chunks_to_report(
    [chunks[0], *rest],
    ["h", "w"],
    [(9,), (301,)],
    ["float16", "float32"],
    max_chunk_bytes=7,
  )
  want = received_outer_gradient(vals, anchor, codec, block_size=5)
  assert back.outer_gradient
  assert {k: _bits(v) for k, v in back.values.items()} == {k: _bits(v) for k, v in want.items()}


def test_reader_fed_byte_by_byte_equals_one_shot():
  vals = {"w": np.linspace(-1, 1, 2 * RUN_VALUES + 3, dtype=np.float32)}  # Three runs, odd tail.
  data = serialize_fragment(vals, "int4", block_size=7)
  lay = wire.make_layout(["w"], [vals["w"].shape], ["float32"])
  reader = FragmentReader(lay, codec_name="int4")
  for i in range(0, len(data), 1 << 15):
    reader.feed(data[i : i + (1 << 15)])
  got = reader.finish()["w"]
  assert _bits(got) == _bits(deserialize_fragment(data, ["w"], [vals["w"].shape], ["float32"])["w"])
  small = serialize_fragment({"w": vals["w"][:10]}, "bf16")
  reader = FragmentReader(wire.make_layout(["w"], [(10,)], ["float32"]))
  for b in small:
    reader.feed(bytes([b]))
  assert _bits(reader.finish()["w"]) == _bits(
    wire.received_values({"w": vals["w"][:10]}, "bf16")["w"]
  )


@pytest.mark.parametrize("block_size", [1, 7, 64, RUN_VALUES + 1])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_encode_runs_concatenate_to_encode(codec, block_size):
  x = np.random.default_rng(2).standard_normal(RUN_VALUES * 2 + 5).astype(np.float32)
  c = get_codec(codec, block_size)
  runs = [(p.tobytes(), s.tobytes()) for p, s in c.encode_runs(x)]
  enc = encode(c, x)
  assert b"".join(p for p, _ in runs) == enc.payload and b"".join(s for _, s in runs) == enc.scales
  np.testing.assert_array_equal(decode(c, enc), roundtrip(c, x))


def test_nan_in_a_later_chunk_is_refused_with_the_exact_count():
  vals = {"w": np.zeros(1000, np.float32)}
  r = Report(
    learner_id=0, fragment=0, values=vals, tokens=1, steps=1, anchor_version=0, step=0, round_step=0
  )
  chunks = report_to_chunks(r, "fp32", chunk_size=1024)
  data = bytearray(chunks[2].data)
  # Chunk 2 starts at stream byte 2048; values start at 51, so byte 103 of it begins value 525.
  data[103:111] = np.array([np.nan, np.inf], np.float32).tobytes()
  chunks[2].data = bytes(data)
  with pytest.raises(
    WireError, match=re.escape("'w': 2 non-finite value(s) (NaN/Inf) after decoding as float32.")
  ):
    chunks_to_report(chunks, ["w"], [(1000,)], ["float32"], max_chunk_bytes=1024)


def test_array_pool_reuses_a_buffer_only_once_every_view_is_gone():
  pool = ArrayPool(max_free_bytes=64)
  a = pool.empty(10, np.float32)
  assert (a.shape, a.dtype, a.flags.writeable) == ((10,), np.float32, True)
  a[:] = 7.0
  view = a.reshape(2, 5)[1]  # A view of a view: keeps the buffer in use.
  del a
  assert pool.free_bytes == 0
  b = pool.empty(10, np.float32)  # Nothing free: a new buffer.
  assert not np.shares_memory(b, view) and pool.reused == 0
  del view
  assert pool.free_bytes == 40  # 10 float32 came back.
  c = pool.empty(20, ml_dtypes.bfloat16)  # 40 bytes too, another dtype: the same buffer.
  assert (pool.reused, pool.free_bytes, c.dtype) == (1, 0, ml_dtypes.bfloat16)
  assert pool.empty(3, np.float32).size == 3 and pool.reused == 1  # No 12-byte buffer is free.
  assert pool.free_bytes == 12  # That temporary array died at once: its 12 bytes came back.
  del b
  assert pool.free_bytes == 12 + 40
  del c
  assert pool.free_bytes == 52  # 52 + 40 would pass the 64-byte cap: that buffer is released.
  with pytest.raises(ValueError, match="max_free_bytes"):
    ArrayPool(max_free_bytes=-1)


def test_array_pool_keeps_at_most_max_free_bytes():
  pool = ArrayPool(max_free_bytes=100)
  arrays = [pool.empty(16, np.float32) for _ in range(3)]  # 64 bytes each.
  del arrays
  assert pool.free_bytes == 64  # A second 64-byte buffer would pass 100: released instead.


def test_array_pool_within_peak_keeps_what_was_out_at_once_and_no_more():
  pool = ArrayPool(max_free_bytes=1 << 20, within_peak=True)
  round_1 = [pool.empty(16, np.float32) for _ in range(3)]  # 3 x 64 bytes out at once: the peak.
  del round_1
  assert pool.free_bytes == 3 * 64  # All kept: free and out together stay within 192 bytes.
  round_2 = [pool.empty(16, np.float32) for _ in range(3)]
  assert (pool.reused, pool.free_bytes) == (3, 0)  # No fresh memory.
  small = pool.empty(8, np.float32)  # 32 fresh bytes: the peak is now 224.
  del round_2
  assert pool.free_bytes == 3 * 64
  del small  # 32 + 192 free is within the 224 held at the peak.
  assert pool.free_bytes == 224
  big = pool.empty(64, np.float32)  # 256 bytes, none free of that size: out + free is 480.
  del big  # Kept, it would make 480 bytes held while the peak out at once was 256.
  assert pool.free_bytes == 224


def test_reader_decodes_into_the_allocator_arrays():
  made = []

  def alloc(n, dtype):
    made.append(np.full(n, -1.0, dtype))
    return made[-1]

  values = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
  base = {k: np.full_like(v, 0.5) for k, v in values.items()}
  report = Report(
    learner_id=0,
    fragment=0,
    values=values,
    tokens=1,
    steps=1,
    anchor_version=0,
    step=1,
    round_step=1,
  )
  chunks = report_to_chunks(report, "fp32", chunk_size=7, anchor_values=base)
  got = chunks_to_report(
    chunks,
    ["a", "b"],
    {"a": (2, 3), "b": (4,)},
    {"a": np.float32, "b": np.float32},
    alloc=alloc,
  )
  assert [m.size for m in made] == [6, 4]  # One array per key, in layout order.
  for k, m in zip(("a", "b"), made):
    assert np.shares_memory(got.values[k], m)
    np.testing.assert_array_equal(got.values[k], base[k] - values[k])  # δ, exact in fp32.


@pytest.mark.parametrize("sizes", [[10], [3, 7], [4, 4, 2], [1] * 10, [9, 1], [25], [0, 10, 0]])
def test_recut_gives_views_of_one_size_copying_only_what_spans_two_pieces(sizes):
  data = bytes(range(sum(sizes)))
  pieces, at = [], 0
  for n in sizes:
    pieces.append(memoryview(data)[at : at + n])
    at += n
  runs = list(fragment_reader._recut(pieces, 4))
  assert b"".join(bytes(r) for r in runs) == data
  assert all(len(r) == 4 for r in runs[:-1]) and 0 < len(runs[-1]) <= 4
  ends = np.cumsum(sizes)
  for i, r in enumerate(runs):  # A run inside one piece is a view of it; one across two, a copy.
    lo, hi = 4 * i, 4 * i + len(r)
    inside = any(end - n <= lo and hi <= end for end, n in zip(ends, sizes))
    assert (r.obj is data) == inside


@pytest.mark.parametrize("chunk", [1, 333, 4096 + 3])
def test_int4_pieces_decode_as_one_payload(chunk):
  values = {"w": np.random.default_rng(chunk).standard_normal(300_001).astype(np.float32)}
  pieces = list(serialize_chunks(values, "int4", chunk_size=chunk))
  layout = {"w": ((300_001,), np.dtype(np.float32))}
  whole = read_layout(b"".join(pieces), layout, codec_name="int4", max_bytes=None, base=None)
  cut = read_layout(pieces, layout, codec_name="int4", max_bytes=None, base=None)
  np.testing.assert_array_equal(cut["w"].view(np.uint32), whole["w"].view(np.uint32))
