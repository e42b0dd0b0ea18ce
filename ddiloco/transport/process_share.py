"""What a multi-process learner's leader hands its other processes, in the protocol's own messages.

Process 0 of a multi-process learner alone talks to the syncer (learner_process/multihost.py). At
start it hands the others the global fragments it pulled, and before each drain of its training
loop what it drains there: push answers, merged fragments, round requests and the newest
settlement. Those travel as one byte payload over JAX's collectives
(`parallel.multihost.ProcessGroup.share`), made of the messages the syncer sent the leader, never
pickle:

  payload: magic b"DDLS" | u16 format version | u32 CRC-32 of the records | u32 record count |
           records
  record:  u8 kind | u64 body length | body, one of
    RESULT   i32 fragment | i64 report step | PushResponse (`events.push_response`)
    FOLDED   i32 fragment | i64 report step | i64 step of the newer report it was folded into
    STATE    u32 chunk count | (u64 length | FragmentChunk) per chunk: a Pull stream
    REQUEST  f64 arrival time (the leader's monotonic clock) | SyncerEvent with a RoundOpen
    SETTLE   HeartbeatResponse with versions and merged_steps
    GLOBAL   RegisterResponse with versions and fleet_step
  All integers are little-endian. Records of a kind keep their order.

Every process must hold the leader's bits: a fragment travels as a pull stream in fp32 with no
base (`state_messages.state_pieces`), exact for float32, bfloat16 and float16 values, each with its
dtype; wider floats are refused, since fp32 would round them. The reader checks the decoded values
against the state's digest (`state_messages.chunks_to_state`), and the checksum covers every other byte,
so a payload decodes to exactly what was encoded or raises `WireError`.
"""

import dataclasses
import itertools
import struct
import zlib
from collections.abc import Iterator, Sequence

from google.protobuf.message import DecodeError

from ddiloco.protocol import FragmentState, ReportResult, RoundRequest
from ddiloco.transport import events, state_messages, wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE
from ddiloco.transport.errors import WireError
from ddiloco.transport.frames import parse_chunk
from ddiloco.transport.proto import syncer_pb2

MAGIC = b"DDLS"
FORMAT_VERSION = 1
RESULT, FOLDED, STATE, REQUEST, SETTLE, GLOBAL = range(1, 7)

_HEAD = struct.Struct("<4sHII")  # Magic, format version, CRC-32 of the records, record count.
_RECORD = struct.Struct("<BQ")  # Kind, body length.
_RESULT = struct.Struct("<iq")  # Fragment, report step.
_FOLDED = struct.Struct("<iqq")  # Fragment, report step, newer report's step.
_TIME = struct.Struct("<d")
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")

# (newest version of each fragment, step of the newest report of each merged): a settlement.
Settlement = tuple[list[int], list[int]]
# (fragment, report step, the syncer's answer or the step of the newer report it was folded into).
PushOutcome = tuple[int, int, ReportResult | int]


@dataclasses.dataclass(frozen=True)
class Drained:
  """What a learner's training thread takes from its inbox at one drain (learner_process/inbox.py).

  Attributes:
    results: push outcomes, in order.
    states: merged fragments, in order.
    requests: round requests with their arrival times, in order.
    settle: the newest settlement, or None.
  """

  results: list[PushOutcome] = dataclasses.field(default_factory=list)
  states: list[FragmentState] = dataclasses.field(default_factory=list)
  requests: list[tuple[RoundRequest, float]] = dataclasses.field(default_factory=list)
  settle: Settlement | None = None

  def __bool__(self) -> bool:
    return bool(self.results or self.states or self.requests) or self.settle is not None


def encode_drained(drained: Drained) -> bytes:
  """The payload of one drain.

  Raises:
    ValueError: on a fragment whose values fp32 cannot carry exactly (wider than 32 bits) or that
      are not finite.
  """
  records = []
  for p, step, result in drained.results:
    if isinstance(result, ReportResult):
      body = events.push_response(result).SerializeToString()
      records.append((RESULT, [_RESULT.pack(p, step), body]))
    else:
      records.append((FOLDED, [_FOLDED.pack(p, step, result)]))
  records += [(STATE, _state_parts(state)) for state in drained.states]
  for request, arrived in drained.requests:
    body = events.round_event(request).SerializeToString()
    records.append((REQUEST, [_TIME.pack(arrived), body]))
  if drained.settle is not None:
    versions, merged_steps = drained.settle
    hb = syncer_pb2.HeartbeatResponse(versions=versions, merged_steps=merged_steps)
    records.append((SETTLE, [hb.SerializeToString()]))
  return _payload(records)


def decode_drained(payload: bytes | memoryview, layouts: Sequence[wire.Layout]) -> Drained:
  """The drain `encode_drained` made `payload` of.

  Args:
    payload: the bytes.
    layouts: per fragment, {key: (shape, dtype)} (`SyncerLink.layouts`).

  Raises:
    WireError: on a payload that is not exactly such an encoding.
  """
  results, states, requests, settle = [], [], [], None
  for kind, body in _records(payload):
    if kind == RESULT:
      p, step = _unpack(_RESULT, body[: _RESULT.size], "result")
      resp = _parse(syncer_pb2.PushResponse, body[_RESULT.size :], "push answer")
      results.append((p, step, events.report_result(resp)))
    elif kind == FOLDED:
      results.append(_unpack(_FOLDED, body, "folded result"))
    elif kind == STATE:
      states.append(_read_state(body, layouts))
    elif kind == REQUEST:
      (arrived,) = _unpack(_TIME, body[: _TIME.size], "request time")
      request = events.syncer_event(_parse(syncer_pb2.SyncerEvent, body[_TIME.size :], "request"))
      if not isinstance(request, RoundRequest):
        raise WireError(f"A round request record holds {request!r}, not a round.")
      requests.append((request, arrived))
    elif kind == SETTLE and settle is None:
      hb = _parse(syncer_pb2.HeartbeatResponse, body, "settlement")
      settle = (list(hb.versions), list(hb.merged_steps))
    else:
      raise WireError(f"Unexpected record of kind {kind} in a drain's payload.")
  return Drained(results, states, requests, settle)


def encode_global(
  states: Sequence[FragmentState], fleet_step: int, versions: Sequence[int]
) -> bytes:
  """The payload of a learner's start: the global fragments it loads, the fleet step and versions.

  Raises:
    ValueError: as `encode_drained`.
  """
  resp = syncer_pb2.RegisterResponse(versions=versions, fleet_step=fleet_step)
  records = [(GLOBAL, [resp.SerializeToString()])]
  return _payload(records + [(STATE, _state_parts(state)) for state in states])


def decode_global(
  payload: bytes | memoryview, layouts: Sequence[wire.Layout]
) -> tuple[list[FragmentState], int, list[int]]:
  """(states, fleet step, versions) of an `encode_global` payload.

  Raises:
    WireError: as `decode_drained`.
  """
  states, resp = [], None
  for kind, body in _records(payload):
    if kind == STATE:
      states.append(_read_state(body, layouts))
    elif kind == GLOBAL and resp is None:
      resp = _parse(syncer_pb2.RegisterResponse, body, "fleet step and versions")
    else:
      raise WireError(f"Unexpected record of kind {kind} in a start's payload.")
  if resp is None:
    raise WireError("A start's payload has no fleet step and versions.")
  return states, int(resp.fleet_step), [int(v) for v in resp.versions]


# -- records --------------------------------------------------------------------------------------


def _payload(records: list[tuple[int, list[bytes]]]) -> bytes:
  parts, crc = [], 0
  for kind, body in records:
    head = _RECORD.pack(kind, sum(map(len, body)))
    for part in (head, *body):
      crc = zlib.crc32(part, crc)
      parts.append(part)
  return b"".join([_HEAD.pack(MAGIC, FORMAT_VERSION, crc, len(records)), *parts])


def _records(payload: bytes | memoryview) -> Iterator[tuple[int, memoryview]]:
  """(kind, body) of each record, checked for framing and checksum; bodies are views."""
  view = memoryview(payload).cast("B")
  magic, version, crc, count = _unpack(_HEAD, view[: _HEAD.size], "payload header")
  if magic != MAGIC:
    raise WireError(f"Bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a learner's share.")
  if version != FORMAT_VERSION:
    raise WireError(
      f"Unsupported share format version {version}; this build reads {FORMAT_VERSION}."
    )
  if zlib.crc32(view[_HEAD.size :]) != crc:
    raise WireError(f"Checksum mismatch: the {len(view)}-byte payload is corrupted or truncated.")
  pos = _HEAD.size
  for i in range(count):
    kind, n = _unpack(_RECORD, view[pos : pos + _RECORD.size], f"record {i} header")
    pos += _RECORD.size
    if n > len(view) - pos:
      raise WireError(f"Truncated payload: record {i} needs {n} bytes, {len(view) - pos} are left.")
    yield kind, view[pos : pos + n]
    pos += n
  if pos != len(view):
    raise WireError(f"{len(view) - pos} trailing bytes after the last of {count} records.")


def _unpack(s: struct.Struct, data: memoryview, what: str) -> tuple:
  if len(data) != s.size:
    raise WireError(f"Malformed payload: {what} has {len(data)} bytes, expected {s.size}.")
  return s.unpack(data)


def _parse(message_type: type, data: memoryview, what: str):
  try:
    return message_type.FromString(bytes(data))
  except DecodeError as e:
    raise WireError(f"Malformed payload: undecodable {what}: {e}") from e


def _state_parts(state: FragmentState) -> list[bytes]:
  """A fragment as a STATE record's body: an exact fp32 Pull stream, each message length-framed."""
  for key, value in state.values.items():
    dtype = wire.resolve_dtype(value.dtype)
    if dtype.itemsize > 4:
      raise ValueError(f"Fragment {state.fragment} {key!r}: {dtype} does not travel exactly.")
  count = 0

  def frame(head: bytes, n: int) -> bytes:
    nonlocal count
    count += 1
    return _LENGTH.pack(len(head) + n) + head

  # A piece's memory may be reused once the next is asked for: each is copied as it comes.
  pieces = state_messages.state_pieces(state, "fp32", frame, chunk_size=DEFAULT_CHUNK_SIZE)
  parts = [bytes(piece) for piece in pieces]
  return [_COUNT.pack(count), *parts]


def _read_state(body: memoryview, layouts: Sequence[wire.Layout]) -> FragmentState:
  """A STATE record's fragment, decoded into the layout of the fragment its header names."""
  (count,) = _unpack(_COUNT, body[: _COUNT.size], "chunk count")
  pos, chunks = _COUNT.size, []
  for i in range(count):
    (n,) = _unpack(_LENGTH, body[pos : pos + _LENGTH.size], f"chunk {i} length")
    pos += _LENGTH.size
    if n > len(body) - pos:
      raise WireError(f"Truncated fragment: chunk {i} needs {n} bytes, {len(body) - pos} left.")
    chunks.append(body[pos : pos + n])
    pos += n
  if pos != len(body) or not chunks:
    raise WireError(f"Malformed fragment record: {count} chunks in {len(body)} bytes.")
  first = parse_chunk(chunks[0], syncer_pb2.FragmentHeader)
  p = first.header.fragment if first.header is not None else -1
  if not 0 <= p < len(layouts):
    raise WireError(f"A fragment record names fragment {p}; the layout has {len(layouts)}.")
  lay = layouts[p]
  return state_messages.chunks_to_state(
    itertools.chain([first], chunks[1:]),
    list(lay),
    {k: s for k, (s, _) in lay.items()},
    {k: d for k, (_, d) in lay.items()},
    max_chunk_bytes=DEFAULT_CHUNK_SIZE,
  )
