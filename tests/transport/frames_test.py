"""Chunk messages without protobuf objects: hand-made and hand-parsed, byte-exact.

`frames.chunk_prefix` + data must be what protobuf serializes, `frames.parse_chunk` must read
what protobuf reads (and refuse what it cannot), and `messages.push_pieces` must send the bytes
of `report_to_chunks`' messages.
"""

import re

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.syncer.core import FragmentState, Report
from ddiloco.testing.wire import (
  pull_messages,
  push_messages,
  received_outer_gradient,
  report_to_chunks,
  serialize_fragment,
)
from ddiloco.transport import bulk_wire, frames, messages, state_messages, wire
from ddiloco.transport.chunks import ChunkAssembler
from ddiloco.transport.errors import WireError
from ddiloco.transport.fragment_encoder import FragmentEncoder, serialize_chunks
from ddiloco.transport.proto import syncer_pb2

_PUSH_HEADER = syncer_pb2.PushHeader(
  learner_id=7,
  fragment=3,
  anchor_version=-1,
  tokens=4096,
  step_time_s=0.25,
  codec="int4",
  round_step=12,
)
_FRAGMENT_HEADER = syncer_pb2.FragmentHeader(fragment=1, version=9, digest="d", base_version=-1)


def _report(values, anchor_version=0):
  return Report(
    learner_id=2,
    fragment=0,
    values=values,
    tokens=300,
    steps=3,
    anchor_version=anchor_version,
    step=11,
    step_time_s=0.5,
    round_step=10,
  )


@pytest.mark.parametrize(
  ("message_type", "header"),
  [(syncer_pb2.PushChunk, _PUSH_HEADER), (syncer_pb2.FragmentChunk, _FRAGMENT_HEADER)],
)
@pytest.mark.parametrize("index", [0, 1, 127, 128, 300_000, 2**31 - 1, -1])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 1 << 20])
def test_prefix_plus_data_is_protobufs_serialization(message_type, header, index, size):
  data = bytes(range(256)) * (size // 256) + bytes(size % 256)
  with_header = message_type(index=index, data=data)
  with_header.header.CopyFrom(header)
  for msg, head in (
    (with_header, header.SerializeToString()),
    (message_type(index=index, data=data), None),
  ):
    made = frames.chunk_prefix(index, size, head) + data
    assert made == msg.SerializeToString()
    frame = frames.parse_chunk(made, type(header))
    assert frame.index == index and bytes(frame.data) == data and frame.nbytes == len(made)
    assert frame.header == (header if head is not None else None)


def test_parse_chunk_views_the_data_and_follows_protobufs_rules():
  data = b"\x00\x01" * 1000
  made = frames.chunk_prefix(5, len(data)) + data
  frame = frames.parse_chunk(made, syncer_pb2.PushHeader)
  assert frame.data.obj is made  # A view into the received bytes: no copy.
  # Unknown fields of every wire type are skipped, the last index and data win, headers merge.
  extra = (
    b"\x20\x96\x01"  # field 4, varint 150
    + b"\x29"
    + bytes(8)  # field 5, 64-bit
    + b"\x35"
    + bytes(4)  # field 6, 32-bit
    + b"\x3a\x02hi"  # field 7, 2 bytes
  )
  h1 = syncer_pb2.PushHeader(learner_id=1, codec="fp32").SerializeToString()
  h2 = syncer_pb2.PushHeader(fragment=4).SerializeToString()
  msg = (
    frames.chunk_prefix(1, 2, h1)
    + b"ab"
    + extra
    + frames.chunk_prefix(9, 1, h2)[:0]
    + b"\x0a"
    + bytes([len(h2)])
    + h2
    + b"\x10\x09\x1a\x01c"
  )
  ref = syncer_pb2.PushChunk.FromString(msg)
  frame = frames.parse_chunk(msg, syncer_pb2.PushHeader)
  assert (frame.index, bytes(frame.data), frame.header) == (ref.index, ref.data, ref.header)
  assert (frame.header.learner_id, frame.header.fragment, frame.index) == (1, 4, 9)
  # An int32 index sent as a 64-bit varint keeps its low 32 bits, as protobuf does.
  big = b"\x10" + frames._varint((1 << 40) + 5)
  assert frames.parse_chunk(big, syncer_pb2.PushHeader).index == 5
  assert syncer_pb2.PushChunk.FromString(big).index == 5


@pytest.mark.parametrize(
  ("msg", "error"),
  [
    (b"\x1a\x05abc", "field 3 runs past the end"),
    (b"\x1a", "truncated varint"),
    (b"\x10" + b"\xff" * 11, "varint longer than 10 bytes"),
    (b"\x18\x01", "field 3 has wire type 0"),
    (b"\x12\x01a", "field 2 has wire type 2"),
    (b"\x0b", "wire type 3 of field 1"),
    (b"\x02\x00", "field number 0"),
    (b"\x29\x00", "field 5 runs past the end"),
    (b"\x0a\x02\xff\xff", "undecodable header"),
  ],
)
def test_parse_chunk_refuses_malformed_messages(msg, error):
  with pytest.raises(WireError, match=re.escape(error)):
    frames.parse_chunk(msg, syncer_pb2.PushHeader)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("chunk_size", [7, 1000, 1 << 20])
def test_push_pieces_are_report_to_chunks_serialized(codec, chunk_size):
  rng = np.random.default_rng(0)
  vals = {
    "w": rng.standard_normal((40, 30)).astype(np.float32),
    "b": rng.standard_normal(9).astype(ml_dtypes.bfloat16),
  }
  anchor = {k: (v.astype(np.float32) + 0.5).astype(v.dtype) for k, v in vals.items()}
  for base in (None, anchor):
    report = _report(vals)
    want = report_to_chunks(report, codec, block_size=5, chunk_size=chunk_size, anchor_values=base)
    got = list(
      push_messages(report, codec, block_size=5, chunk_size=chunk_size, anchor_values=base)
    )
    assert got == [m.SerializeToString() for m in want]
    back = messages.chunks_to_report(
      got,
      ["b", "w"],
      [(9,), (40, 30)],
      ["bfloat16", "float32"],
      max_chunk_bytes=chunk_size,
    )
    if base is None:
      expect = wire.received_values(vals, codec, block_size=5)
    else:  # The outer gradient δ = Θ^(anchor) − θ, read as it is.
      expect = received_outer_gradient(vals, base, codec, block_size=5)
    assert back.outer_gradient == (base is not None)
    assert all(back.values[k].tobytes() == expect[k].tobytes() for k in vals)
    assert (back.tokens, back.steps, back.step, back.step_time_s) == (300, 3, 11, 0.5)
    assert back.round_step == 10


def test_push_pieces_fail_at_once_on_bad_input_and_midway_on_nan():
  vals = {"w": np.zeros(1000, np.float32)}
  frame = bulk_wire.frame_head
  with pytest.raises(ValueError, match="A delta push needs anchor_version >= 0"):
    messages.push_pieces(_report(vals, anchor_version=-1), "fp32", frame, anchor_values=vals)
  with pytest.raises(ValueError, match="base keys differ"):
    messages.push_pieces(_report(vals), "fp32", frame, anchor_values={"v": vals["w"]})
  run = 1 << 18  # Values per run of an fp32 payload sent as pieces (fragment_encoder.py).
  bad = {"w": np.zeros(run + 1000, np.float32)}
  bad["w"][run + 10] = np.nan  # In the second run of values the encoder checks.
  stream = push_messages(_report(bad), "fp32", chunk_size=1 << 16)  # No error yet.
  # 51 bytes of framing, then the first run of 16 * 65536 bytes: chunks 0-15 are whole before the
  # encoder reaches the second run.
  sent = []
  with pytest.raises(ValueError, match=re.escape("'w': Refusing to encode 1 non-finite value(s)")):
    for m in stream:
      sent.append(m)
  assert len(sent) == 16


def test_encoder_announces_the_exact_size():
  rng = np.random.default_rng(1)
  vals = {"a": rng.standard_normal(1001).astype(np.float16), "z/long key": np.zeros((2, 3, 4))}
  for codec in ("fp32", "bf16", "int8", "int4"):
    enc = FragmentEncoder(vals, codec, block_size=7)
    data = serialize_fragment(vals, codec, block_size=7)
    assert enc.nbytes == len(data) and enc.num_chunks(100) == -(-len(data) // 100)
    assert b"".join(enc.chunks(100)) == data
  assert FragmentEncoder({}, "fp32").nbytes == 10  # The file header alone.


def test_assembler_keeps_views_without_copying():
  msg = b"0123456789"
  views = [memoryview(msg)[0:4], memoryview(msg)[4:8], memoryview(msg)[8:]]
  asm = ChunkAssembler(num_chunks=3, total_bytes=10, max_total_bytes=10, max_chunk_bytes=4)
  assert asm.add(1, views[1]) == []
  ready = asm.add(0, views[0]) + asm.add(2, views[2])
  assert [r is v for r, v in zip(ready, views)] == [True, True, True]
  assert asm.result() == msg


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int4"])
@pytest.mark.parametrize("chunk_size", [7, 1000, 1 << 20])
def test_state_pieces_are_protobufs_pull_stream(codec, chunk_size):
  # The Pull stream a service sends without a serializer: byte for byte the FragmentChunk messages
  # protobuf would make of the wire format's pieces, header (with the receiver's digest) on chunk 0.
  rng = np.random.default_rng(1)
  vals = {"w": rng.standard_normal((40, 30)).astype(np.float32)}
  older = {"w": (vals["w"] - 0.25).astype(np.float32)}
  state = FragmentState(fragment=2, version=5, values=vals, digest=values_digest(vals))
  for base in (None, FragmentState(fragment=2, version=4, values=older, digest="")):
    base_values = None if base is None else base.values
    pieces = list(
      serialize_chunks(vals, codec, block_size=5, base=base_values, chunk_size=chunk_size)
    )
    received = wire.received_values(vals, codec, block_size=5, base=base_values)
    header = syncer_pb2.FragmentHeader(
      fragment=2,
      version=5,
      digest=values_digest(received),
      codec=codec,
      total_bytes=sum(map(len, pieces)),
      num_chunks=len(pieces),
      base_version=-1 if base is None else 4,
    )
    want = [syncer_pb2.FragmentChunk(index=i, data=d) for i, d in enumerate(pieces)]
    want[0].header.CopyFrom(header)
    want = [m.SerializeToString() for m in want]
    got = list(pull_messages(state, codec, block_size=5, chunk_size=chunk_size, base=base))
    assert got == want
    cached = state_messages.encoded_state_messages(
      pieces,
      fragment=2,
      version=5,
      digest=header.digest,
      codec=codec,
      base_version=header.base_version,
    )
    assert cached == want
    back = state_messages.chunks_to_state(
      got, ["w"], [(40, 30)], ["float32"], base_lookup=lambda v: older, max_chunk_bytes=chunk_size
    )
    assert back.version == 5 and back.values["w"].tobytes() == received["w"].tobytes()
