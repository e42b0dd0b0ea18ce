"""Wire format, chunking and Report/FragmentState streams: exact round trips and every bad input."""

import re
import struct

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.syncer.core import FragmentState, Report
from ddiloco.testing.wire import (
  deserialize_fragment,
  received_outer_gradient,
  report_to_chunks,
  serialize_fragment,
  state_to_chunks,
)
from ddiloco.transport import (
  ChunkAssembler,
  WireError,
  chunks_to_report,
  chunks_to_state,
  max_wire_bytes,
  received_values,
)
from ddiloco.transport.chunks import chunk, reassemble

MiB = 1 << 20


def _values(seed=0):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((33, 17)).astype(np.float32)
  w[0, :3] = [-0.0, np.float32(1e-45), np.float32(3.4e38)]  # -0, a denormal, near float32 max.
  return {
    "b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
    "w": w,
  }


def _layout(values):
  keys = sorted(values)
  return keys, [values[k].shape for k in keys], [values[k].dtype.name for k in keys]


def _bits_equal(a, b):
  assert a.dtype == b.dtype and a.shape == b.shape
  return a.tobytes() == b.tobytes()


def _raises(msg):
  return pytest.raises(WireError, match=re.escape(msg))


# -- round trips ------------------------------------------------------------------------------------


def test_report_fp32_round_trip_is_bit_exact():
  vals = _values()
  r = Report(
    learner_id=3,
    fragment=7,
    values=vals,
    tokens=4096,
    steps=24,
    anchor_version=5,
    step=123,
    step_time_s=0.25,
    round_step=120,
  )
  chunks = report_to_chunks(r, "fp32")
  assert len(chunks) == 1 and chunks[0].header.num_chunks == 1 and not chunks[0].header.delta
  back = chunks_to_report(chunks, *_layout(vals))
  assert (back.learner_id, back.fragment, back.tokens, back.steps) == (3, 7, 4096, 24)
  assert (back.anchor_version, back.step, back.step_time_s, back.round_step) == (5, 123, 0.25, 120)
  assert sorted(back.values) == ["b", "w"]
  for k in vals:
    assert _bits_equal(back.values[k], vals[k]), k


def test_state_fp32_round_trip_is_bit_exact_and_digest_checked():
  vals = _values(1)
  state = FragmentState(2, 9, vals, values_digest(vals))
  chunks = state_to_chunks(state, "fp32")
  assert chunks[0].header.digest == state.digest and chunks[0].header.base_version == -1
  back = chunks_to_state(chunks, *_layout(vals))
  assert (back.fragment, back.version, back.digest) == (2, 9, state.digest)
  for k in vals:
    assert _bits_equal(back.values[k], vals[k]), k


def test_three_mib_fragment_is_four_chunks_of_at_most_one_mib():
  vals = {"w": np.ones((768, 1024), np.float32)}  # 786432 values = exactly 3 MiB of float32.
  r = Report(
    learner_id=0, fragment=0, values=vals, tokens=1, steps=1, anchor_version=0, step=0, round_step=0
  )
  chunks = report_to_chunks(r, "fp32")
  # Framing: file header 10 + entry 2 (key len) + 1 ("w") + 1 (codec) + 1 + 7 ("float32")
  # + 1 (ndim) + 16 (dims) + 20 (block, lengths) = 59 bytes beyond the 3 MiB payload.
  assert chunks[0].header.total_bytes == 3 * MiB + 59
  assert [len(c.data) for c in chunks] == [MiB, MiB, MiB, 59]
  assert [c.index for c in chunks] == [0, 1, 2, 3]
  assert [c.HasField("header") for c in chunks] == [True, False, False, False]
  # Chunks may arrive in any order after the header chunk.
  back = chunks_to_report(
    [chunks[0], chunks[3], chunks[1], chunks[2]], ["w"], [(768, 1024)], ["f4"]
  )
  assert _bits_equal(back.values["w"], vals["w"])


@pytest.mark.parametrize("block_size", [64, 7])
def test_int4_report_round_trip_within_block_bound(block_size):
  rng = np.random.default_rng(2)
  w = rng.standard_normal(1000).astype(np.float32)
  r = Report(
    learner_id=1,
    fragment=0,
    values={"w": w},
    tokens=8,
    steps=2,
    anchor_version=0,
    step=0,
    round_step=0,
  )
  chunks = report_to_chunks(r, "int4", block_size=block_size)
  back = chunks_to_report(chunks, ["w"], [(1000,)], ["float32"]).values["w"]
  # Block-wise absmax: scale s = absmax/7, rounding error <= s/2 = absmax/14 per block (+1 ulp slack).
  n_blocks = -(-1000 // block_size)
  padded = np.zeros(n_blocks * block_size, np.float32)
  padded[:1000] = w
  bound = np.repeat(np.abs(padded.reshape(n_blocks, -1)).max(1) / 14, block_size)[:1000]
  assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
  assert np.abs(back - w).max() > 0  # Really lossy.
  # The sender can predict the receiver's values bit for bit (docs/algorithm.md §5: adopt the dequantized value).
  assert _bits_equal(back, received_values({"w": w}, "int4", block_size=block_size)["w"])


def test_bf16_state_round_trip_within_half_ulp_and_digest_of_received_values():
  rng = np.random.default_rng(3)
  vals = {"w": rng.standard_normal((10, 10)).astype(np.float32)}
  state = FragmentState(0, 1, vals, values_digest(vals))
  chunks = state_to_chunks(state, "bf16")
  back = chunks_to_state(chunks, ["w"], [(10, 10)], ["float32"])
  # bf16 keeps 8 significant bits (7 stored): round-to-nearest relative error <= 2^-8.
  rel = np.abs(back.values["w"] - vals["w"]) / np.abs(vals["w"])
  assert rel.max() <= 2.0**-8 and rel.max() > 2.0**-10
  assert back.digest == values_digest(received_values(vals, "bf16")) != state.digest


def test_int8_outer_gradient_push_is_read_as_sent():
  rng = np.random.default_rng(4)
  anchor = {"w": rng.standard_normal(256).astype(np.float32)}
  theta = {"w": anchor["w"] + np.float32(1e-3) * rng.standard_normal(256).astype(np.float32)}
  r = Report(
    learner_id=2,
    fragment=1,
    values=theta,
    tokens=1,
    steps=1,
    anchor_version=4,
    step=9,
    round_step=8,
  )
  chunks = report_to_chunks(r, "int8", anchor_values=anchor)
  assert chunks[0].header.delta
  back = chunks_to_report(chunks, ["w"], [(256,)], ["float32"])  # δ needs no anchor to read.
  assert back.outer_gradient and back.anchor_version == 4
  want = received_outer_gradient(theta, anchor, "int8")["w"]
  assert _bits_equal(back.values["w"], want)
  # The error scales with δ (~1e-3), not with θ (~1): int8 step is absmax(δ)/127 per block.
  assert np.abs(back.values["w"] - (anchor["w"] - theta["w"])).max() < 1e-4


def test_int4_delta_state_verifies_digest_on_both_sides():
  base_vals = {"w": np.linspace(-1, 1, 100, dtype=np.float32)}
  new_vals = {"w": base_vals["w"] + np.float32(0.01)}
  base = FragmentState(0, 3, base_vals, values_digest(base_vals))
  state = FragmentState(0, 5, new_vals, values_digest(new_vals))
  chunks = state_to_chunks(state, "int4", base=base)
  assert chunks[0].header.base_version == 3
  back = chunks_to_state(
    chunks, ["w"], [(100,)], ["float32"], base_lookup={3: base_vals}.__getitem__
  )
  adopted = received_values(new_vals, "int4", base=base_vals)
  assert back.digest == values_digest(adopted) and _bits_equal(back.values["w"], adopted["w"])


# -- chunking -----------------------------------------------------------------------------------


def test_chunk_and_reassemble():
  data = bytes(range(256)) * 10  # 2560 bytes.
  pieces = chunk(data, 1000)
  assert [len(p) for p in pieces] == [1000, 1000, 560]
  assert chunk(b"", 1000) == [b""]
  got = reassemble(
    [(2, pieces[2]), (0, pieces[0]), (1, pieces[1])],
    num_chunks=3,
    total_bytes=2560,
    max_total_bytes=4096,
    max_chunk_bytes=1000,
  )
  assert got == data
  with pytest.raises(ValueError, match="chunk_size must be >= 1"):
    chunk(data, 0)


@pytest.mark.parametrize(
  ("indexed", "num_chunks", "total", "msg"),
  [
    ([(0, b"ab"), (0, b"cd")], 2, 4, "Duplicate chunk index 0."),
    ([(0, b"ab")], 2, 4, "Missing 1 of 2 chunk(s), first indices [1]."),
    ([(0, b"ab"), (2, b"cd")], 2, 4, "Chunk index 2 out of range [0, 2)."),
    ([(0, b"ab"), (1, b"c")], 2, 4, "Received 3 bytes, 4 announced."),
    ([(0, b"ab"), (1, b"cde")], 2, 4, "Chunk 1 has 3 bytes, the limit is 2."),
    ([(0, b"ab"), (1, b"cd")], 2, 3, "Chunk 1 brings the payload to 4 bytes, more than the 3"),
    ([], 2, 100, "Oversized payload: 100 bytes announced, the limit is 10."),
    ([], 5, 4, "5 chunks announced for only 4 bytes."),
    ([], 0, 4, "num_chunks must be >= 1, got 0."),
    ([], 1, 4, "4 bytes cannot fit in 1 chunks of at most 2 bytes."),
  ],
)
def test_reassemble_rejects(indexed, num_chunks, total, msg):
  with _raises(msg):
    reassemble(
      indexed, num_chunks=num_chunks, total_bytes=total, max_total_bytes=10, max_chunk_bytes=2
    )


def test_assembler_rejects_chunk_after_duplicate_before_buffering_more():
  asm = ChunkAssembler(num_chunks=2, total_bytes=4, max_total_bytes=4, max_chunk_bytes=2)
  asm.add(1, b"cd")
  with _raises("Duplicate chunk index 1."):
    asm.add(1, b"cd")
  asm.add(0, b"ab")
  assert asm.result() == b"abcd"


# -- bad payloads ---------------------------------------------------------------------------------

_W = {"w": np.arange(4, dtype=np.float32)}
_L = (["w"], [(4,)], ["float32"])
# Offsets in serialize_fragment(_W, "fp32"): file header 10 bytes; entry framing 2+1+1+1+7+1+8+20 = 41
# bytes; payload 16 bytes at 51..67; total 67.
_PAYLOAD_AT = 51


def _fp32_bytes():
  data = serialize_fragment(_W, "fp32")
  assert len(data) == 67 and data[_PAYLOAD_AT:] == _W["w"].tobytes()
  return data


def test_bad_magic_and_version():
  data = _fp32_bytes()
  with _raises("Bad magic b'XXWF', expected b'DDWF'"):
    deserialize_fragment(b"XX" + data[2:], *_L)
  with _raises("Unsupported format version 2; this build reads 1."):
    deserialize_fragment(data[:4] + struct.pack("<H", 2) + data[6:], *_L)


def test_truncated_and_trailing():
  data = _fp32_bytes()
  with _raises("Truncated data: 'w' payload needs 16 bytes at offset 51, only 15 left."):
    deserialize_fragment(data[:-1], *_L)
  with _raises("Truncated data: file header needs 10 bytes at offset 0, only 3 left."):
    deserialize_fragment(data[:3], *_L)
  with _raises("1 trailing bytes after the last entry."):
    deserialize_fragment(data + b"\0", *_L)


def test_unknown_missing_and_duplicate_keys():
  data = _fp32_bytes()
  with _raises("Unknown key 'w': not in this fragment's layout."):
    deserialize_fragment(data, ["v"], [(4,)], ["float32"])
  with _raises("Missing 1 key(s) of the layout: ['z']."):
    deserialize_fragment(data, ["w", "z"], [(4,), (1,)], ["float32", "float32"])
  entry = data[10:]
  twice = data[:4] + struct.pack("<HI", 1, 2) + entry + entry
  with _raises("Duplicate key 'w' in payload."):
    deserialize_fragment(twice, ["w", "z"], [(4,), (1,)], ["float32", "float32"])
  with _raises("Payload has 2 entries, the layout only 1."):
    deserialize_fragment(twice, *_L)


def test_wrong_shape_dtype_codec():
  data = _fp32_bytes()
  with _raises("'w': shape (4,), expected (2, 2)."):
    deserialize_fragment(data, ["w"], [(2, 2)], ["float32"])
  with _raises("'w': dtype 'float32', expected 'bfloat16'."):
    deserialize_fragment(data, ["w"], [(4,)], ["bfloat16"])
  with _raises("'w': encoded with 'fp32', the header says 'int8'."):
    deserialize_fragment(data, *_L, codec_name="int8")


def test_nan_and_inf_after_decoding():
  data = _fp32_bytes()
  bad = np.array([0, np.nan, 0, 0], np.float32).tobytes()
  with _raises("'w': 1 non-finite value(s) (NaN/Inf) after decoding as float32."):
    deserialize_fragment(data[:_PAYLOAD_AT] + bad, *_L)
  # Finite in float32, but 1e6 overflows float16 (max 65504): Inf in the layout dtype.
  h = serialize_fragment({"w": np.array([1.0, 2.0], np.float16)}, "fp32")
  big = h[:-8] + np.array([1e6, 1.0], np.float32).tobytes()
  with _raises("'w': 1 non-finite value(s) (NaN/Inf) after decoding as float16."):
    deserialize_fragment(big, ["w"], [(2,)], ["float16"])


def test_oversized_and_lying_lengths():
  data = _fp32_bytes()
  with _raises("Oversized payload: 67 bytes, the limit is 66."):
    deserialize_fragment(data, *_L, max_bytes=66)
  # Default limit: 10 + (2+1+1+255+1+20) + 1 + 8 + 5*4 = 319 bytes for this layout.
  assert max_wire_bytes({"w": ((4,), np.dtype("float32"))}) == 319
  with _raises("Oversized payload: 320 bytes, the limit is 319."):
    deserialize_fragment(data + bytes(253), *_L)
  # Payload length field claims 20 bytes instead of 16.
  lying = data[:35] + struct.pack("<Q", 20) + data[43:] + bytes(4)
  with _raises("'w': payload/scales of 20/0 bytes, expected 16/0 for fp32 of shape (4,)."):
    deserialize_fragment(lying, *_L)


def _push(values, **kw):
  r = Report(
    learner_id=0,
    fragment=0,
    values=values,
    tokens=1,
    steps=1,
    anchor_version=0,
    step=0,
    round_step=0,
  )
  return report_to_chunks(r, "fp32", **kw)


def test_push_stream_errors():
  vals = {"w": np.zeros(1000, np.float32)}  # 4000 payload bytes + 51 framing = 4051 bytes.
  chunks = _push(vals, chunk_size=1024)
  assert [len(c.data) for c in chunks] == [1024, 1024, 1024, 979]
  lay = (["w"], [(1000,)], ["float32"])
  kw = {"max_chunk_bytes": 1024}
  assert chunks_to_report(chunks, *lay, **kw).values["w"].shape == (1000,)
  with _raises("Missing 1 of 4 chunk(s), first indices [2]."):
    chunks_to_report([chunks[0], chunks[1], chunks[3]], *lay, **kw)
  dup = type(chunks[2])(index=1, data=chunks[2].data)
  with _raises("Duplicate chunk index 1."):
    chunks_to_report([chunks[0], chunks[1], dup, chunks[3]], *lay, **kw)
  with _raises("The first chunk must be index 0 with a header, got index 1."):
    chunks_to_report(chunks[1:], *lay, **kw)
  with _raises("Chunk 0 carries a header; only the first chunk may."):
    chunks_to_report([chunks[0], chunks[0]], *lay, **kw)
  with _raises("Empty chunk stream"):
    chunks_to_report([], *lay, **kw)
  with _raises("4051 bytes cannot fit in 4 chunks of at most 512 bytes."):
    chunks_to_report(chunks, *lay, max_chunk_bytes=512)
  fat = type(chunks[1])(index=1, data=chunks[1].data + b"\0")
  with _raises("Chunk 1 has 1025 bytes, the limit is 1024."):
    chunks_to_report([chunks[0], fat, chunks[2], chunks[3]], *lay, **kw)
  # Wrong counts in the header: too few chunks for the bytes, or more announced than sent.
  wrong = type(chunks[0])()
  wrong.CopyFrom(chunks[0])
  wrong.header.num_chunks = 3
  with _raises("4051 bytes cannot fit in 3 chunks of at most 1024 bytes."):
    chunks_to_report([wrong, *chunks[1:]], *lay, **kw)
  wrong.header.num_chunks = 5
  with _raises("Missing 1 of 5 chunk(s), first indices [4]."):
    chunks_to_report([wrong, *chunks[1:]], *lay, **kw)
  wrong.header.total_bytes = 4050
  with _raises("Chunk 3 brings the payload to 4051 bytes, more than the 4050 announced."):
    chunks_to_report([wrong, *chunks[1:]], *lay, **kw)
  # An oversized announcement is refused before any further chunk is read.
  huge = type(chunks[0])()
  huge.CopyFrom(chunks[0])
  huge.header.total_bytes = 1 << 40

  def stream():
    yield huge
    raise AssertionError("read past an oversized header")

  with _raises("Oversized payload: 1099511627776 bytes announced, the limit is"):
    chunks_to_report(stream(), *lay, **kw)


def test_push_header_errors():
  chunks = _push(_W)
  for field, value, msg in [
    ("codec", "int2", "Unknown codec 'int2'"),
    ("steps", -1, "Bad header: negative counter: steps=-1."),
    ("round_step", -1, "Bad header: negative counter: round_step=-1."),
    ("tokens", 2**63 - 1, "Bad header: implausible counter: tokens=9223372036854775807 exceeds"),
    ("step_time_s", float("nan"), "Bad header: step_time_s must be finite and >= 0, got nan."),
    ("learner_id", -2, "Header ids out of range: learner_id -2"),
    ("codec", "int8", "'w': encoded with 'fp32', the header says 'int8'."),
  ]:
    bad = type(chunks[0])()
    bad.CopyFrom(chunks[0])
    setattr(bad.header, field, value)
    with _raises(msg):
      chunks_to_report([bad], *_L)


def test_outer_gradient_push_needs_an_anchor_version():
  r = Report(
    learner_id=0, fragment=0, values=_W, tokens=1, steps=1, anchor_version=2, step=0, round_step=0
  )
  chunks = report_to_chunks(r, "fp32", anchor_values=_W)
  chunks[0].header.anchor_version = -1  # A hand-made header: δ against no version.
  with _raises("An outer gradient (delta) push needs anchor_version >= 0."):
    chunks_to_report(chunks, *_L)
  with pytest.raises(ValueError, match="A delta push needs anchor_version >= 0"):
    report_to_chunks(
      Report(learner_id=0, fragment=0, values=_W, tokens=1, steps=1, anchor_version=-1, step=0),
      "fp32",
      anchor_values=_W,
    )


def test_state_digest_mismatch():
  state = FragmentState(0, 1, _W, values_digest(_W))
  chunks = state_to_chunks(state, "fp32")
  chunks[0].header.digest = "0" * 32
  with _raises(f"Digest mismatch for fragment 0 v1: received values hash to {state.digest}"):
    chunks_to_state(chunks, *_L)


def test_sender_refuses_nan():
  with pytest.raises(ValueError, match="non-finite"):
    serialize_fragment({"w": np.array([np.nan], np.float32)}, "int4")
