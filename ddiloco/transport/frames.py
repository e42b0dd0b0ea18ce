"""Chunk messages (PushChunk, FragmentChunk of syncer.proto) made and parsed by hand, byte-exact.

On the Push path protobuf is bypassed for the payload (scripts/bench_wire.py): `chunk_prefix` makes
the fields in front of a chunk's bytes, the bytes protobuf itself would produce, so a serialized
message is made in one piece, and `parse_chunk` reads a received message's fields by hand with its
data a view into the received bytes. Protobuf's own message objects would copy every payload byte
twice on each side. Only the small header submessage goes through protobuf.
"""

import dataclasses

from google.protobuf.message import DecodeError

from ddiloco.transport.errors import WireError

# PushChunk and FragmentChunk share their field numbers (syncer.proto): 1 header, 2 index, 3 data.
_HEADER_TAG, _INDEX_TAG, _DATA_TAG = b"\x0a", b"\x10", b"\x1a"
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


@dataclasses.dataclass(frozen=True)
class ChunkFrame:
  """The fields of one chunk message (PushChunk or FragmentChunk).

  Attributes:
    header: the header submessage if the chunk carries one, else None.
    index: the chunk's position.
    data: its slice of the payload; a view into the received message when parsed from bytes.
    nbytes: size of the serialized message.
  """

  header: object | None
  index: int
  data: memoryview
  nbytes: int


def _varint(value: int) -> bytes:
  """Protobuf's base-128 varint of a non-negative integer below 2**64."""
  out = bytearray()
  while value > 0x7F:
    out.append((value & 0x7F) | 0x80)
    value >>= 7
  out.append(value)
  return bytes(out)


def chunk_prefix(index: int, nbytes: int, header: bytes | None = None) -> bytes:
  """The serialized fields of a chunk message that come before its data's bytes.

  `chunk_prefix(i, len(d), h) + d` is the message `PushChunk(header=H, index=i, data=d)` (or a
  FragmentChunk) with H serialized as `h`, byte for byte as protobuf writes it: fields in number
  order, proto3 defaults (index 0, empty data) left out, an int32 index as a 64-bit varint.

  Args:
    index: the chunk's index (int32).
    nbytes: the length of its data.
    header: the serialized header submessage, or None for a chunk without one.
  """
  parts = []
  if header is not None:
    parts += [_HEADER_TAG, _varint(len(header)), header]
  if index:
    parts += [_INDEX_TAG, _varint(index & 0xFFFF_FFFF_FFFF_FFFF)]
  if nbytes:
    parts += [_DATA_TAG, _varint(nbytes)]
  return b"".join(parts)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
  value = shift = 0
  while pos < len(view):
    byte = view[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value & 0xFFFF_FFFF_FFFF_FFFF, pos
    shift += 7
    if shift >= 70:
      raise WireError("Malformed chunk message: a varint longer than 10 bytes.")
  raise WireError("Malformed chunk message: truncated varint.")


def parse_chunk(message: bytes | memoryview, header_type: type) -> ChunkFrame:
  """Reads a serialized PushChunk or FragmentChunk by hand; its data is a view (no copy).

  Follows protobuf's parsing rules: unknown fields are skipped, the last index and data win,
  header occurrences merge, an int32 index keeps its low 32 bits.

  Args:
    message: the message's bytes.
    header_type: `syncer_pb2.PushHeader` or `syncer_pb2.FragmentHeader`.

  Raises:
    WireError: on a malformed message (truncated, bad wire type, undecodable header).
  """
  view = memoryview(message).cast("B")
  pos, end = 0, len(view)
  headers, index, data = [], 0, view[0:0]
  while pos < end:
    key, pos = _read_varint(view, pos)
    field, wire_type = key >> 3, key & 7
    if field == 0:
      raise WireError("Malformed chunk message: field number 0.")
    if wire_type == _WIRE_VARINT:
      value, pos = _read_varint(view, pos)
    elif wire_type == _WIRE_LEN:
      length, pos = _read_varint(view, pos)
      if length > end - pos:
        raise WireError(f"Malformed chunk message: field {field} runs past the end.")
      value, pos = view[pos : pos + length], pos + length
    elif wire_type in (_WIRE_I64, _WIRE_I32):
      pos += 8 if wire_type == _WIRE_I64 else 4
      if pos > end:
        raise WireError(f"Malformed chunk message: field {field} runs past the end.")
      value = None
    else:
      raise WireError(f"Malformed chunk message: wire type {wire_type} of field {field}.")
    expected = {1: _WIRE_LEN, 2: _WIRE_VARINT, 3: _WIRE_LEN}.get(field, wire_type)
    if wire_type != expected:
      raise WireError(f"Malformed chunk message: field {field} has wire type {wire_type}.")
    if field == 1:
      headers.append(value)
    elif field == 2:
      index = (value & 0xFFFF_FFFF) - ((value & 0x8000_0000) << 1)  # int32, two's complement.
    elif field == 3:
      data = value
  header = None
  if headers:
    try:
      header = header_type.FromString(b"".join(headers))
    except DecodeError as e:
      raise WireError(f"Malformed chunk message: undecodable header: {e}") from e
  return ChunkFrame(header, index, data, end)


# Bytes that hold a chunk message's fields before its data when they are only an index and the
# data's length (`chunk_prefix` of a chunk past the first): two tags and two varints.
PLAIN_HEAD_BYTES = 22


def plain_head(head: bytes | memoryview, nbytes: int) -> tuple[int, int] | None:
  """(index, offset of the data) of a serialized chunk message of `nbytes` bytes whose first bytes
  are `head` (at least `min(nbytes, PLAIN_HEAD_BYTES)` of them), if its fields are an int32 index
  >= 0 (or none) and then its data running to the message's end, as `chunk_prefix` writes chunks
  past the first; None for any other message, which `parse_chunk` then reads whole. What both
  give for such a message is the same: protobuf's parse of it.
  """
  view = memoryview(head).cast("B")
  index, pos = 0, 0
  try:
    if len(view) > pos and view[pos] == _INDEX_TAG[0]:
      index, pos = _read_varint(view, pos + 1)
      if index > 0x7FFF_FFFF:
        return None  # A negative int32, or one past its range: parse_chunk's rules apply.
    if len(view) <= pos or view[pos] != _DATA_TAG[0]:
      return None
    length, pos = _read_varint(view, pos + 1)
  except WireError:
    return None
  return (index, pos) if pos + length == nbytes else None


def as_frame(chunk: object, header_type: type) -> ChunkFrame:
  """A ChunkFrame of a chunk given as a frame, its serialized bytes, or a protobuf message.

  Raises:
    WireError: if serialized bytes are malformed.
  """
  if isinstance(chunk, ChunkFrame):
    return chunk
  if isinstance(chunk, bytes | bytearray | memoryview):
    return parse_chunk(chunk, header_type)
  header = chunk.header if chunk.HasField("header") else None
  return ChunkFrame(header, chunk.index, memoryview(chunk.data), chunk.ByteSize())
