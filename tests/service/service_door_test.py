"""Validation at the door of the syncer service (docs/architecture.md "payload validation").

One test per bad input. Each asserts (a) the exact gRPC status of the refusal, (b) a precise part of
its message, (c) that `SyncerService.refused()` counted exactly one refusal of that status and no
other, and (d) that the global state did not move: every fragment's version and digest, and the
core's stats apart from the counters that count a refusal ("late", "duplicate", "rejected",
"dropped_tokens"), whose exact increments each test states.

Fragments: 0 = {"a/w": f32[64, 32]}, 1 = {"b/w": f32[300]}; P = 2, H = 3 (the core's default
schedule for τ = 2), so fragment 0 is due at steps 3, 6, ... and fragment 1 at 1, 4, .... Unless told
otherwise a server opens rounds (0, 3) and (1, 4) at once, and pushes answer them. Wire sizes by hand (transport/wire.py):
file header 4 + 2 + 4 = 10 bytes; an entry's framing is u16 key length + key + u8 codec + u8 dtype
length + "float32" + u8 ndim + 8 per dim + u32/u64/u64 lengths = 2 + 3 + 1 + 1 + 7 + 1 + 8·ndim + 20.
  fragment 0 in fp32: 10 + 35 + 16 + 4·2048 = 8253 bytes; int4 (block 64): 10 + 51 + 1024 + 4·32 = 1213.
  fragment 1 in fp32: 10 + 35 + 8 + 4·300 = 1253 bytes; the last 1200 are the values.
  max_wire_bytes(fragment 0) = 10 + (2 + 1 + 1 + 255 + 1 + 20) + 3 + 16 + 5·2048 = 10549.
"""

import dataclasses
import math
import time
from collections import Counter

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.service.server import (
  InProcessSyncer,
  SyncerServer,
  make_syncer,
  serve,
  serve_in_process,
)
from ddiloco.service.service import SERVICE_NAME, SyncerService
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import FragmentState, Report, RoundRequest, SyncerConfig
from ddiloco.testing.wire import report_to_chunks, serialize_fragment
from ddiloco.transport import auth, bulk_client, bulk_wire, wire
from ddiloco.transport.client import SyncerClient, fragment_layouts
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

# Every test here opens sockets (a hang must fail the test, not stall the suite).
pytestmark = pytest.mark.timeout(60)

TOKEN = "tok"
DIGEST = "L"
FRAGMENTS = [["a/w"], ["b/w"]]
AUTH = (("authorization", f"Bearer {TOKEN}"),)
RPC_TIMEOUT_S = 10
# Core counters that legitimately count a refused report; every other stat must not move.
REFUSAL_COUNTERS = ("late", "duplicate", "rejected", "dropped_tokens", "replayed", "implausible")
STEPS, TOKENS = 2, 100  # Token weight 100² / 2 = 5000 (docs/algorithm.md §4.4).
ROUNDS = {0: 3, 1: 4}  # The round each fragment's pushes answer: its first due step from 3 on.


def _init_values() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "a/w": rng.normal(size=(64, 32)).astype(np.float32),
    "b/w": rng.normal(size=(300,)).astype(np.float32),
  }


INIT = _init_values()
LAYOUTS = fragment_layouts(FRAGMENTS, INIT)


# -- servers ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Env:
  """A running syncer, a raw stub (its control plane) and a client; learner 0 registered and
  holding version 0. Raw pushes and pulls go over its bulk port (`_push`, `_pull_raw`)."""

  svc: SyncerService
  srv: SyncerServer | InProcessSyncer
  channel: grpc.Channel
  stub: syncer_pb2_grpc.SyncerStub
  client: SyncerClient
  held: dict[int, FragmentState]

  def close(self) -> None:
    self.client.close()
    self.channel.close()
    if isinstance(self.srv, InProcessSyncer):
      self.srv.stop()
    else:
      self.srv.stop(grace_s=0.5)


def _start(
  syncer_config: SyncerConfig, transport: str, *, open_rounds: bool = True, **service_kwargs
) -> _Env:
  """A server with learner 0 registered and holding version 0; rounds `ROUNDS` opened. Reached
  over its ports (`transport` "socket": gRPC and the bulk port) or the in-process transport
  ("in_process")."""
  # A long liveness timeout: no test may lose learner 0 to the liveness check midway.
  kwargs = {"uplink_codec": "int4", "downlink_codec": "int4", "liveness_timeout_s": 600.0}
  if "max_chunk_bytes" in service_kwargs:  # One chunk bound whichever carries the data.
    service_kwargs["bulk_chunk_bytes"] = service_kwargs["max_chunk_bytes"]
  service_config = ServiceConfig(**(kwargs | service_kwargs))
  svc = make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=syncer_config,
    service_config=service_config,
    layout_digest=DIGEST,
  )
  if transport == "socket":
    srv = serve(svc, token=TOKEN)
    address = f"127.0.0.1:{srv.port}"
    client = SyncerClient(address, token=TOKEN, max_chunk_bytes=service_config.max_chunk_bytes)
    channel = grpc.insecure_channel(address)
  else:
    srv = serve_in_process(svc, token=TOKEN)
    client = SyncerClient(
      channel=srv.channel(), token=TOKEN, max_chunk_bytes=service_config.max_chunk_bytes
    )
    channel = srv.channel()
  client.wait_ready(10)
  client.register(0, layout_digest=DIGEST, num_fragments=len(FRAGMENTS))
  held = {p: _pull(client, p, -1) for p in range(len(FRAGMENTS))}
  if open_rounds:
    for p, step in ROUNDS.items():
      _open_round(svc, p, step)
  return _Env(svc, srv, channel, syncer_pb2_grpc.SyncerStub(channel), client, held)


def _pull(client: SyncerClient, p: int, known: int, held: FragmentState | None = None):
  layout = LAYOUTS[p]
  return client.pull(
    0,
    p,
    known,
    layout_keys=list(layout),
    shapes={k: s for k, (s, _) in layout.items()},
    dtypes={k: d for k, (_, d) in layout.items()},
    base_lookup=None if held is None else (lambda v: held.values),
  )


def _open_round(svc: SyncerService, p: int, step: int) -> RoundRequest:
  """Opens round (p, step) as the merge thread's clock would (no learner is streaming rounds)."""
  with svc.lock:
    request = svc.core.open_round(p, step)
    version = svc.core.version(p)
  assert request == RoundRequest(p, step, version)
  return request


def _wait_version(svc: SyncerService, p: int, version: int, timeout_s: float = 10.0) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    with svc.lock:
      if svc.core.version(p) >= version:
        return
    time.sleep(0.01)
  pytest.fail(f"fragment {p} never reached version {version}")


# The door's rules are the service's, the same over either transport: their tests run over the
# in-process one. The tests of what a transport carries (empty, reordered and oversized streams,
# tokens, the health service, server streams, a merge) run over both, the sockets (gRPC and the
# bulk port) in the integration tier: the same answers from both.
BOTH_TRANSPORTS = pytest.mark.parametrize(
  "transport",
  ["in_process", pytest.param("socket", marks=pytest.mark.integration)],
  indirect=True,
  scope="module",
)


@pytest.fixture(scope="module")
def transport(request):
  """The in-process transport, or the one `BOTH_TRANSPORTS` names."""
  return getattr(request, "param", "in_process")


@pytest.fixture(scope="module")
def door(transport):
  """The shared server for refusals that change nothing (K = 1, as in the service's smoke example)."""
  env = _start(SyncerConfig(min_quorum=1, grace_max_s=0.2), transport)
  yield env
  env.close()


@pytest.fixture(scope="module")
def small_chunks(transport):
  """A server taking chunks of at most 4096 bytes, far below gRPC's message limit (4096 + 64 KiB)."""
  env = _start(SyncerConfig(min_quorum=1, grace_max_s=0.2), transport, max_chunk_bytes=4096)
  yield env
  env.close()


@pytest.fixture(scope="module")
def closed(transport):
  """Rounds (0, 3) and (0, 6) merged (fragment 0 at version 2), none of fragment 0 open; with
  keep_versions 2, versions {1, 2} are kept."""
  env = _start(SyncerConfig(min_quorum=1, use_grace=False, keep_versions=2), transport)
  for version, round_step in ((0, 3), (1, 6)):
    if version:
      _open_round(env.svc, 0, round_step)
    # A non-delta fp32 push anchored at the round's base joins the round and merges at once.
    report = _report(anchor=version, step=round_step, round_step=round_step)
    assert _push(env, _chunks(report, "fp32")).status == "accepted"
    _wait_version(env.svc, 0, version + 1)
  with env.svc.lock:
    assert [r.fragment for r in env.svc.core.rounds.open_requests()] == [1]
  yield env
  env.close()


@pytest.fixture(scope="module")
def open_round(transport):
  """K = 2 with one learner: learner 0's answer (step 2) to round (0, 3) waits in the open round."""
  env = _start(SyncerConfig(min_quorum=2, grace_max_s=0.2), transport)
  result = env.client.push(_report(), "int4", anchor_values=env.held[0].values)
  assert (result.status, result.weight) == ("accepted", TOKENS**2 / STEPS)
  yield env
  env.close()


# -- requests -----------------------------------------------------------------------------------


def _report(
  *, fragment: int = 0, learner: int = 0, anchor: int = 0, step: int = 2, round_step=None
) -> Report:
  """θ = Θ^(0) + small noise: a plausible outer gradient (docs/algorithm.md §3), answering round
  `round_step` (default `ROUNDS[fragment]`)."""
  rng = np.random.default_rng(100 + step)
  values = {
    k: (INIT[k] + 0.01 * rng.normal(size=INIT[k].shape)).astype(np.float32)
    for k in FRAGMENTS[fragment]
  }
  return Report(
    learner_id=learner,
    fragment=fragment,
    values=values,
    tokens=TOKENS,
    steps=STEPS,
    anchor_version=anchor,
    step=step,
    round_step=ROUNDS[fragment] if round_step is None else round_step,
  )


def _chunks(report: Report, codec: str = "int4", *, anchor_values=None, chunk_size: int = 1 << 20):
  return report_to_chunks(report, codec, chunk_size=chunk_size, anchor_values=anchor_values)


def _raw_chunks(data: bytes, *, fragment: int, codec: str, chunk_size: int = 1 << 20):
  """A hand-made push of `data` (anchor -1, not a delta) with an honest header."""
  pieces = [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]
  header = syncer_pb2.PushHeader(
    learner_id=0,
    fragment=fragment,
    anchor_version=-1,
    tokens=TOKENS,
    steps=STEPS,
    step=2,
    round_step=ROUNDS[fragment],
    codec=codec,
    total_bytes=len(data),
    num_chunks=len(pieces),
  )
  out = [syncer_pb2.PushChunk(header=header, index=0, data=pieces[0])]
  return out + [syncer_pb2.PushChunk(index=i, data=d) for i, d in enumerate(pieces[1:], start=1)]


def _push(env: _Env, chunks, metadata=None) -> syncer_pb2.PushResponse:
  """A raw push of PushChunk messages with the token and learner 0's session (unless `metadata`
  says otherwise): over the bulk port, or the in-process carrier's path."""
  metadata = env.client.learner_metadata(0) if metadata is None else metadata
  messages = [c.SerializeToString() for c in chunks]
  if isinstance(env.srv, InProcessSyncer):
    push = env.channel.stream_unary(bulk_wire.PUSH_METHOD)
    body = push(iter(messages), timeout=RPC_TIMEOUT_S, metadata=metadata)
  else:
    bulk, session = _bulk(env, metadata)
    body = bulk.push(bulk_wire.message_frames(messages), session, RPC_TIMEOUT_S)
  return syncer_pb2.PushResponse.FromString(body)


def _pull_raw(env: _Env, fragment: int, known: int) -> list[syncer_pb2.FragmentChunk]:
  """A raw pull as learner 0: its FragmentChunk messages."""
  request = syncer_pb2.PullRequest(learner_id=0, fragment=fragment, known_version=known)
  metadata = env.client.learner_metadata(0)
  if isinstance(env.srv, InProcessSyncer):
    pull = env.channel.unary_stream(bulk_wire.PULL_METHOD, request_serializer=_serialize)
    messages = bulk_wire.messages_of(pull(request, timeout=RPC_TIMEOUT_S, metadata=metadata))
  else:
    bulk, session = _bulk(env, metadata)
    messages = bulk.pull(request.SerializeToString(), session, RPC_TIMEOUT_S)
  return [syncer_pb2.FragmentChunk.FromString(bytes(m)) for m in messages]


def _serialize(message) -> bytes:
  return message.SerializeToString()


def _bulk(env: _Env, metadata) -> tuple[bulk_client.BulkClient, str]:
  """A client of `env`'s bulk port with the token in `metadata`, and the session in it: what a
  bulk hello carries in place of gRPC's metadata."""
  values = dict(metadata)
  token = values.get(auth.AUTH_METADATA_KEY, "").removeprefix("Bearer ")
  bulk = bulk_client.BulkClient(
    "127.0.0.1", env.srv.bulk.port, token=token or None, max_frame_bytes=2 << 20
  )
  return bulk, values.get(auth.SESSION_METADATA_KEY, "")


# -- the four checks ----------------------------------------------------------------------------


def _snapshot(svc: SyncerService) -> tuple[tuple, dict, Counter]:
  """(version and digest of every fragment, stats but refusal counters, refusal counters)."""
  with svc.lock:
    core = svc.core
    states = [core.state(p) for p in range(core.num_fragments)]
    fragments = tuple((s.version, s.digest) for s in states)
    stats = core.stats()
  counted = Counter({k: stats.pop(k) for k in REFUSAL_COUNTERS})
  return fragments, stats, counted


def _assert_refused(
  env: _Env, call, code: grpc.StatusCode, message: str, **counter_increments: int
) -> None:
  """Runs `call`, which must fail with `code` and `message`, and checks (c) and (d)."""
  fragments, stats, counted = _snapshot(env.svc)
  refused = Counter(env.svc.refused())
  with pytest.raises(grpc.RpcError) as info:
    call()
  assert info.value.code() == code, info.value.details()
  assert message in info.value.details()
  refused[code.name] += 1
  assert Counter(env.svc.refused()) == refused
  fragments_after, stats_after, counted_after = _snapshot(env.svc)
  assert fragments_after == fragments
  assert stats_after == stats
  assert counted_after - counted == Counter(counter_increments)
  assert counted_after == counted + Counter(counter_increments)  # No counter went down either.


# -- 1. malformed chunk streams -----------------------------------------------------------------

# The assembler's rules (an index out of range, twice or missing; more or fewer bytes than the
# header announced) are transport/chunks.py's and tested with it (tests/transport/wire_test.py);
# here are the service's own (a push starts with chunk 0 and its header) and one wire error, which
# the door answers as it answers any.

# Fragment 0 in int4 (1213 bytes, see the module docstring) cut into 256-byte chunks: 5 chunks.
_SMALL = 256


def _five_chunks():
  chunks = _chunks(_report(), chunk_size=_SMALL)
  assert len(chunks) == 5 and chunks[0].header.total_bytes == 1213
  return chunks


@BOTH_TRANSPORTS
def test_empty_push_stream(door):
  _assert_refused(
    door,
    lambda: _push(door, []),
    grpc.StatusCode.INVALID_ARGUMENT,
    "A push must start with chunk 0 carrying the header.",
  )


def test_first_chunk_without_header(door):
  chunks = _five_chunks()
  chunks[0].ClearField("header")
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "A push must start with chunk 0 carrying the header.",
  )


def test_first_chunk_index_not_zero(door):
  chunks = _five_chunks()
  chunks[0].index = 1
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "A push must start with chunk 0 carrying the header.",
  )


def test_later_chunk_carrying_a_header(door):
  chunks = _five_chunks()
  chunks[2].header.CopyFrom(chunks[0].header)
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Chunk 2 carries a header; only the first chunk may.",
  )


@BOTH_TRANSPORTS
def test_reordered_chunks_are_reassembled_by_index(transport):
  """Not a refusal: `ChunkAssembler` takes chunks in any order by design (transport/chunks.py).

  Proof that the payload is put together right: the merge of the permuted fp32 push is bit-identical
  to a reference core's merge of the same report handed over in process.
  """
  env = _start(SyncerConfig(min_quorum=1, use_grace=False), transport)
  try:
    report = _report()
    chunks = _chunks(report, "fp32", chunk_size=2048)  # 8253 bytes: 5 chunks.
    assert len(chunks) == 5
    response = _push(env, [chunks[i] for i in (0, 3, 1, 4, 2)])
    assert (response.status, response.weight) == ("accepted", TOKENS**2 / STEPS)
    _wait_version(env.svc, 0, 1)
    assert env.svc.refused() == {}
    reference = make_syncer(
      fragment_keys=FRAGMENTS,
      init_values=INIT,
      syncer_config=SyncerConfig(min_quorum=1, use_grace=False),
      service_config=ServiceConfig(uplink_codec="int4", downlink_codec="int4"),
      layout_digest=DIGEST,
    )
    reference.core.register(0)
    reference.core.mark_delivered(0, 0, 0)
    reference.core.open_round(0, ROUNDS[0])
    assert reference.core.report(report).status == "accepted"
    (event,) = reference.core.closer.flush()
    assert env.svc.published_digests()[(0, 1)] == event.digest
  finally:
    env.close()


# -- 2. unknown fragment and learners -----------------------------------------------------------


@pytest.mark.parametrize("fragment", [2, -1])
def test_unknown_fragment(door, fragment):
  chunks = _chunks(_report())
  chunks[0].header.fragment = fragment
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    f"Unknown fragment {fragment}; this syncer holds 0..1.",
  )


def test_learner_never_registered(door):
  chunks = _chunks(_report(learner=99))
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.NOT_FOUND,
    "Learner 99 is not registered; call Register first.",
  )


def test_learner_that_left(door):
  door.client.register(7, layout_digest=DIGEST, num_fragments=2)
  assert door.client.leave(7)
  chunks = _chunks(_report(learner=7))
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.FAILED_PRECONDITION,
    "Learner 7 is not alive at the syncer (left or timed out); register again.",
  )


# -- 3. payload that does not fit the fragment's layout -----------------------------------------

# Wrong keys, shapes and dtypes are the reader's rules (tests/transport/wire_test.py); the door
# answers them INVALID_ARGUMENT as any wire error, whatever the text says.


def test_unknown_key_whose_name_reads_like_a_size_error(door):
  data = serialize_fragment({"Oversized": np.zeros((64, 32), np.float32)}, "int4")
  assert len(data) < 10549  # Small: no size limit is involved.
  chunks = _raw_chunks(data, fragment=0, codec="int4")
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Unknown key 'Oversized': not in this fragment's layout.",
  )


# -- 4. non-finite values -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_value_in_fp32_push(door, bad):
  # The serializer refuses NaN/Inf, so patch value 17 of fragment 1 (the last 1200 bytes are its
  # 300 float32 values, see the module docstring).
  chunks = _chunks(_report(fragment=1), "fp32")
  data = bytearray(chunks[0].data)
  assert len(data) == 1253
  offset = len(data) - 4 * 300 + 4 * 17
  data[offset : offset + 4] = np.float32(bad).tobytes()
  chunks[0].data = bytes(data)
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    # The core's filing checks every value (fused with RDA's norm), not the decoder: one pass.
    "rejected: 'b/w' has non-finite values (1 NaN/Inf of 300)",
    rejected=1,
  )


@pytest.mark.parametrize(
  ("scale", "message", "rejected"),
  [
    (math.nan, "Malformed encoding: 'b/w': Scales must be finite and non-negative.", 0),
    # Finite, but q · scale overflows float32 for every |q| >= 2 of the block: the core's filing
    # refuses the values (it checks every value, fused with RDA's norm).
    (3.0e38, "rejected: 'b/w' has non-finite values (", 1),
  ],
  ids=["nan_scale", "overflowing_scale"],
)
# compression.decode multiplies q · scale outside an errstate: numpy warns before the refusal.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_bad_scale_in_int4_push(door, scale, message, rejected):
  # Fragment 1 in int4: ceil(300 / 64) = 5 float32 scales close the payload; patch the first.
  chunks = _chunks(_report(fragment=1), "int4")
  data = bytearray(chunks[0].data)
  offset = len(data) - 4 * 5
  data[offset : offset + 4] = np.float32(scale).tobytes()
  chunks[0].data = bytes(data)
  counted = {"rejected": rejected} if rejected else {}
  _assert_refused(
    door, lambda: _push(door, chunks), grpc.StatusCode.INVALID_ARGUMENT, message, **counted
  )


# -- 5. sizes -----------------------------------------------------------------------------------


def test_total_bytes_beyond_what_the_fragment_can_need(door):
  assert wire.max_wire_bytes(LAYOUTS[0]) == 10549
  chunks = _chunks(_report())
  chunks[0].header.total_bytes = 100 * 10549
  chunks[0].header.num_chunks = 2  # Room for 2 MiB, so only the fragment bound trips.
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Push of 1054900 bytes in 2 chunks: fragment 0 never needs more than 10549 bytes",
  )


@BOTH_TRANSPORTS
def test_chunks_announced_larger_than_the_limit(small_chunks):
  # A client cutting fp32 fragment 0 (8253 bytes) into 8192-byte chunks announces 2 chunks, and
  # 2 · 4096 < 8253: refused from the header alone, before any bytes are buffered.
  chunks = _chunks(_report(), "fp32", chunk_size=8192)
  assert [len(c.data) for c in chunks] == [8192, 61]
  _assert_refused(
    small_chunks,
    lambda: _push(small_chunks, chunks),
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Push of 8253 bytes in 2 chunks: fragment 0 never needs more than 10549 bytes, "
    "chunks at most 4096.",
  )


@BOTH_TRANSPORTS
def test_single_chunk_above_the_limit(small_chunks):
  # The header announces 3 chunks (3 · 4096 >= 8253, so it passes), but chunk 0 alone has 8192.
  chunks = _chunks(_report(), "fp32", chunk_size=8192)
  chunks[0].header.num_chunks = 3
  chunks.append(syncer_pb2.PushChunk(index=2, data=b""))
  _assert_refused(
    small_chunks,
    lambda: _push(small_chunks, chunks),
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Chunk 0 has 8192 bytes, the limit is 4096.",
  )


# -- 6. authentication --------------------------------------------------------------------------

_NO_TOKEN = ()
_WRONG_TOKEN = (("authorization", "Bearer not-the-token"),)
_MISSING = "Missing 'authorization' metadata: this syncer requires a shared token."
_WRONG = "Wrong shared token."


@BOTH_TRANSPORTS
@pytest.mark.parametrize(
  ("metadata", "message"), [(_NO_TOKEN, _MISSING), (_WRONG_TOKEN, _WRONG)], ids=["missing", "wrong"]
)
def test_push_without_the_token(door, metadata, message):
  chunks = _chunks(_report(), anchor_values=door.held[0].values)
  _assert_refused(
    door,
    lambda: _push(door, chunks, metadata=metadata),
    grpc.StatusCode.UNAUTHENTICATED,
    message,
  )


@BOTH_TRANSPORTS
@pytest.mark.parametrize(
  ("metadata", "message"), [(_NO_TOKEN, _MISSING), (_WRONG_TOKEN, _WRONG)], ids=["missing", "wrong"]
)
def test_status_without_the_token(door, metadata, message):
  _assert_refused(
    door,
    lambda: door.stub.Status(syncer_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S, metadata=metadata),
    grpc.StatusCode.UNAUTHENTICATED,
    message,
  )


@BOTH_TRANSPORTS
def test_health_check_needs_no_token(door):
  refused = door.svc.refused()
  health = health_pb2_grpc.HealthStub(door.channel)
  response = health.Check(
    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=RPC_TIMEOUT_S
  )
  assert response.status == health_pb2.HealthCheckResponse.SERVING
  assert door.svc.refused() == refused


# -- 7. registration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("request_fields", "code", "message"),
  [
    (
      {"layout_digest": "other", "num_fragments": 2},
      grpc.StatusCode.FAILED_PRECONDITION,
      "Layout digest 'other' differs from the syncer's 'L'",
    ),
    (
      {"layout_digest": DIGEST, "num_fragments": 3},
      grpc.StatusCode.FAILED_PRECONDITION,
      "Learner has 3 fragments, the syncer 2.",
    ),
    (
      {"layout_digest": DIGEST, "num_fragments": 2, "learner_id": -1},
      grpc.StatusCode.INVALID_ARGUMENT,
      "learner_id must be >= 0, got -1.",
    ),
  ],
  ids=["layout_digest", "num_fragments", "negative_learner_id"],
)
def test_register_refused(door, request_fields, code, message):
  request = syncer_pb2.RegisterRequest(**({"learner_id": 5} | request_fields))
  alive = door.svc.core.alive()
  _assert_refused(
    door,
    lambda: door.stub.Register(request, timeout=RPC_TIMEOUT_S, metadata=AUTH),
    code,
    message,
  )
  assert door.svc.core.alive() == alive


# -- 8. codecs and header fields ----------------------------------------------------------------


def test_codec_other_than_the_negotiated_one(door):
  chunks = _chunks(_report(), "int8", anchor_values=door.held[0].values)
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Codec 'int8': this syncer takes 'int4' (or exact 'fp32').",
  )


def test_header_codec_differs_from_the_payload_codec(door):
  chunks = _chunks(_report(), "int8")
  chunks[0].header.codec = "int4"
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "'a/w': encoded with 'int8', the header says 'int4'.",
  )


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("tokens", -1, "Push refused: negative counter: tokens=-1."),
    ("tokens", 2**63 - 1, "Push refused: implausible counter: tokens=9223372036854775807"),
    ("new_tokens", 2**62, "Push refused: implausible counter: new_tokens="),
    ("steps", 2**63 - 1, "Push refused: implausible counter: steps="),
    ("step", 2**41, "Push refused: implausible counter: step=2199023255552 exceeds"),
    ("step_time_s", math.nan, "Push refused: step_time_s must be finite and >= 0, got nan."),
    ("step_time_s", math.inf, "Push refused: step_time_s must be finite and >= 0, got inf."),
    ("anchor_version", -2, "Header ids out of range"),
  ],
)
def test_header_field_out_of_range(door, field, value, message):
  chunks = _chunks(_report())
  setattr(chunks[0].header, field, value)
  _assert_refused(door, lambda: _push(door, chunks), grpc.StatusCode.INVALID_ARGUMENT, message)


# -- 9. late, never-opened and duplicate answers -----------------------------------------------


def test_push_for_a_closed_round_is_aborted(closed):
  # Anchored at the current version 2, but round (0, 6) has merged: lateness is by round.
  chunks = _chunks(_report(anchor=2, step=7, round_step=6), "fp32")
  _assert_refused(
    closed,
    lambda: _push(closed, chunks),
    grpc.StatusCode.ABORTED,
    "late: round (0, 6) is closed",
    late=1,
    dropped_tokens=TOKENS,
  )


def test_late_delta_push_with_a_kept_anchor_is_aborted(closed):
  # Version 1 is still kept (keep_versions 2), so the payload would decode; its round is closed.
  with closed.svc.lock:
    anchor = closed.svc.core.state_at(0, 1).values
  chunks = _chunks(_report(anchor=1, step=7, round_step=6), anchor_values=anchor)
  _assert_refused(
    closed,
    lambda: _push(closed, chunks),
    grpc.StatusCode.ABORTED,
    "late: round (0, 6) is closed",
    late=1,
    dropped_tokens=TOKENS,
  )


def test_late_delta_push_whose_anchor_is_no_longer_kept_is_aborted(closed):
  # Version 0 fell out of the kept versions {1, 2}, so this delta could not even be decoded: the
  # service decides "late" from the header alone, before reading the payload.
  with closed.svc.lock, pytest.raises(KeyError):
    closed.svc.core.state_at(0, 0)
  chunks = _chunks(_report(anchor=0, step=4, round_step=3), anchor_values=closed.held[0].values)
  _assert_refused(
    closed,
    lambda: _push(closed, chunks),
    grpc.StatusCode.ABORTED,
    "late: round (0, 3) is closed",
    late=1,
    dropped_tokens=TOKENS,
  )


def test_late_push_with_a_garbage_payload_is_aborted_from_the_header(closed):
  # Decided before the payload is read: an answer to a closed round is dropped whatever it carries.
  header = _chunks(_report(anchor=0, step=4, round_step=3))[0].header
  header.total_bytes, header.num_chunks = 3, 1
  chunks = [syncer_pb2.PushChunk(header=header, index=0, data=b"bad")]
  _assert_refused(
    closed,
    lambda: _push(closed, chunks),
    grpc.StatusCode.ABORTED,
    "late: round (0, 3) is closed",
    late=1,
    dropped_tokens=TOKENS,
  )


def test_push_for_a_round_never_opened(door):
  # Round (0, 3) is the newest of fragment 0: (0, 6) was never opened, so nothing can answer it.
  chunks = _chunks(_report(round_step=6), "fp32")
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "rejected: round (0, 6) was never opened",
    rejected=1,
  )


def test_push_for_a_step_below_the_newest_round_that_never_had_one(door):
  # Round (0, 3) is open and is fragment 0's first: step 2 had no round of fragment 0.
  chunks = _chunks(_report(round_step=2), "fp32")
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "rejected: round (0, 2) was never opened",
    rejected=1,
  )


def test_push_answering_no_round(door):
  # A report made without a pending request carries round_step -1: it answers no round at all.
  chunks = _chunks(_report(), "fp32")
  chunks[0].header.round_step = -1
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Bad header: negative counter: round_step=-1.",
  )


def test_delta_push_whose_anchor_a_restored_checkpoint_no_longer_keeps(transport):
  """Round (0, 9) is open, but the push's anchor, version 0, is gone (SyncerCore.kept).

  The server's core is restored from a checkpoint written with keep_versions 2 after two merges of
  fragment 0, so only versions 1 and 2 are kept. The outer gradient needs no anchor to be read; it
  was taken against version 0, not the round's base 2, so it is accepted with weight 0 and the
  global model does not move.
  """
  env = _start(SyncerConfig(min_quorum=1, use_grace=False, keep_versions=4), transport)
  try:
    source = make_syncer(
      fragment_keys=FRAGMENTS,
      init_values=INIT,
      syncer_config=SyncerConfig(min_quorum=1, use_grace=False, keep_versions=2),
      service_config=ServiceConfig(uplink_codec="int4", downlink_codec="int4"),
      layout_digest=DIGEST,
    ).core
    source.register(0)
    for version, round_step in ((0, 3), (1, 6)):
      source.mark_delivered(0, 0, version)
      source.open_round(0, round_step)
      report = _report(anchor=version, step=round_step, round_step=round_step)
      assert source.report(report).status == "accepted"
      assert [e.version for e in source.closer.flush()] == [version + 1]
    assert source.open_round(0, 9) == RoundRequest(0, 9, 2)
    with env.svc.lock:
      env.svc.core.load_state_dict(source.state_dict())
      assert env.svc.core.version(0) == 2 and 0 in env.svc.core.alive()
      assert not env.svc.core.kept(0, 0)
    chunks = _chunks(_report(anchor=0, step=10, round_step=9), anchor_values=env.held[0].values)
    _assert_weighs_zero(env, chunks, "answered against version 0")
  finally:
    env.close()


def _assert_weighs_zero(env: _Env, chunks, reason: str) -> None:
  """The push is accepted with weight 0 (`reason`) and changes no fragment."""
  fragments, stats, counted = _snapshot(env.svc)
  resp = _push(env, chunks)
  assert (resp.status, resp.weight) == ("accepted", 0.0)
  assert reason in resp.reason
  fragments_after, stats_after, counted_after = _snapshot(env.svc)
  assert fragments_after == fragments and counted_after == counted
  assert stats_after["zero_weight_reports"] == stats["zero_weight_reports"] + 1
  with env.svc.lock:
    env.svc.core.closer.flush()  # Nothing to merge: a weight-0 answer is never a quorum.
  assert _snapshot(env.svc)[0] == fragments


def test_delta_push_anchored_at_a_version_lost_in_a_syncer_restart(tmp_path, transport):
  """After a restore republished fragment 0, an outer gradient against a lost version weighs 0.

  Version 2 is lost; the learner re-registered and has not pulled since, so its answer weighs 0
  (and would, having pulled: its anchor is not the round's base). It is read, never merged.
  """
  from ddiloco.checkpoint import syncer as ckpt_lib

  env = _start(SyncerConfig(min_quorum=1, use_grace=False, keep_versions=4), transport)
  try:
    source = make_syncer(
      fragment_keys=FRAGMENTS,
      init_values=INIT,
      syncer_config=SyncerConfig(min_quorum=1, use_grace=False, keep_versions=4),
      service_config=ServiceConfig(uplink_codec="int4", downlink_codec="int4"),
      layout_digest=DIGEST,
    ).core
    source.register(0)
    journal = ckpt_lib.MergeJournal(str(tmp_path / ckpt_lib.JOURNAL_NAME))
    checkpointer = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
    for version, round_step in ((0, 3), (1, 6)):
      source.mark_delivered(0, 0, version)
      source.open_round(0, round_step)
      report = _report(anchor=version, step=round_step, round_step=round_step)
      assert source.report(report).status == "accepted"
      (event,) = source.closer.flush()
      journal.append(event)
      if version == 0:
        checkpointer.save(1, source.state_dict())
        checkpointer.wait()
    journal.close()
    with env.svc.lock:
      info = ckpt_lib.restore_core(env.svc.core, checkpointer, journal.path)
    checkpointer.close()
    assert info.republished == {0: (1, 2, 3)}
    env.client.register(0, layout_digest=DIGEST, num_fragments=len(FRAGMENTS))
    _open_round(env.svc, 0, 9)  # Past the restored rounds: a fresh round, based on version 3.
    chunks = _chunks(_report(anchor=2, step=10, round_step=9), anchor_values=env.held[0].values)
    _assert_weighs_zero(env, chunks, "has not received fragment 0 since registering")
  finally:
    env.close()


@pytest.mark.parametrize("step", [3, 5], ids=["next_step", "newer_step"])
def test_duplicate_push(open_round, step):
  # One answer per learner and round, even a newer θ: only a restarted learner may answer again.
  chunks = _chunks(_report(step=step), anchor_values=open_round.held[0].values)
  _assert_refused(
    open_round,
    lambda: _push(open_round, chunks),
    grpc.StatusCode.ALREADY_EXISTS,
    "duplicate: learner 0 already answered round (0, 3)",
    duplicate=1,
  )


@pytest.mark.parametrize("merged", [False, True], ids=["round_open", "round_merged"])
def test_replayed_push_is_filed_once(open_round, merged):
  # A learner that lost the reply sends the same answer again (a retry): it gets the first
  # answer's result, and nothing is filed, merged or booked twice.
  env = open_round
  if merged:  # Learner 1's answer completes the quorum: the round merges.
    env.client.register(1, layout_digest=DIGEST, num_fragments=len(FRAGMENTS))
    with env.svc.lock:
      env.svc.core.mark_delivered(1, 0, 0)
    env.client.push(_report(learner=1), "int4", anchor_values=env.held[0].values)
    deadline = time.monotonic() + 10
    while env.svc.core.version(0) == 0 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert env.svc.core.version(0) == 1
  fragments, stats, counted = _snapshot(env.svc)
  book = env.svc.core.ledger()
  for _ in range(2):
    result = env.client.push(_report(), "int4", anchor_values=env.held[0].values)
    assert (result.status, result.weight, result.round_version) == (
      "accepted",
      TOKENS**2 / STEPS,
      1,
    )
  fragments_after, stats_after, counted_after = _snapshot(env.svc)
  assert (fragments_after, stats_after) == (fragments, stats)
  assert counted_after - counted == Counter(replayed=2)
  assert env.svc.core.ledger() == book
  assert env.svc.core.stats()["merges"] == int(merged)


# -- 10. versions from the future ---------------------------------------------------------------


def test_delta_push_anchored_after_the_current_version(door):
  current = door.svc.core.version(0)
  chunks = _chunks(_report(anchor=current + 5), anchor_values=door.held[0].values)
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    f"rejected: anchor_version {current + 5} outside [-1, {current}]",
    rejected=1,
  )


def test_push_anchored_after_the_current_version(door):
  current = door.svc.core.version(0)
  chunks = _chunks(_report(anchor=current + 5), "fp32")
  _assert_refused(
    door,
    lambda: _push(door, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    f"rejected: anchor_version {current + 5} outside [-1, {current}]",
    rejected=1,
  )


def test_pull_of_a_version_newer_than_the_syncers(door):
  current = door.svc.core.version(1)
  _assert_refused(
    door,
    lambda: _pull_raw(door, 1, current + 1),
    grpc.StatusCode.OUT_OF_RANGE,
    f"Learner holds version {current + 1} of fragment 1, newer than the syncer's {current}.",
  )


def test_pull_of_an_unknown_fragment(door):
  _assert_refused(
    door,
    lambda: _pull_raw(door, 2, -1),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Unknown fragment 2; this syncer holds 0..1.",
  )


# -- 11. the Rounds stream ----------------------------------------------------------------------


def test_rounds_stream_of_an_unregistered_learner(door):
  _assert_refused(
    door,
    lambda: next(iter(door.client.rounds(99))),
    grpc.StatusCode.NOT_FOUND,
    "Learner 99 is not registered; call Register first.",
  )


@BOTH_TRANSPORTS
def test_rounds_stream_announces_open_rounds_new_rounds_and_published_versions(transport):
  """The merge thread's step clock ("slowest": learner 0's heartbeat step) opens the rounds due."""
  env = _start(
    SyncerConfig(min_quorum=1, use_grace=False, clock="slowest"), transport, open_rounds=False
  )
  stream = None
  try:
    _open_round(env.svc, 0, 3)
    stream = env.client.rounds(0)
    events = iter(stream)
    # At subscription: the rounds open now, then every fragment's current version.
    assert [next(events) for _ in range(3)] == [RoundRequest(0, 3, 0), (0, 0), (1, 0)]
    # Learner 0 reaches schedule step 4: fragment 1 is due (its offset is 1, H = 3).
    env.client.heartbeat(0, step=4)
    assert next(events) == RoundRequest(1, 4, 0)
    # Its answer merges at once (K = 1, no grace): version 1 of fragment 1 is announced.
    result = env.client.push(_report(fragment=1, step=4), "int4", anchor_values=env.held[1].values)
    assert (result.status, result.weight, result.round_version) == ("accepted", 5000.0, 1)
    assert next(events) == (1, 1)
    result = env.client.push(_report(step=4), "int4", anchor_values=env.held[0].values)
    assert (result.status, result.round_version) == ("accepted", 1)
    assert next(events) == (0, 1)
    # Step 6: fragment 0 is due again; its new round is based on the version just published.
    env.client.heartbeat(0, step=6)
    assert next(events) == RoundRequest(0, 6, 1)
    with env.svc.lock:
      stats = env.svc.core.stats()
      digests = [env.svc.core.state(p).digest for p in range(2)]
    assert (stats["rounds_opened"], stats["overrun_rounds"], stats["merges"]) == (3, 0, 2)
    assert [env.svc.published_digests()[(p, 1)] for p in range(2)] == digests
    assert env.svc.refused() == {}
  finally:
    if stream is not None:
      stream.cancel()
    env.close()


@BOTH_TRANSPORTS
def test_rounds_stream_is_replaced_by_a_new_subscription_and_ends_when_the_learner_leaves(door):
  door.client.register(8, layout_digest=DIGEST, num_fragments=2)
  first = iter(door.client.rounds(8))
  with door.svc.lock:
    opened = door.svc.core.rounds.open_requests()
    versions = [door.svc.core.version(p) for p in range(2)]
  initial = [*opened, *enumerate(versions)]
  assert [next(first) for _ in initial] == initial
  second = iter(door.client.rounds(8))
  assert [next(second) for _ in initial] == initial
  assert list(first) == []  # Ended by the new subscription.
  assert door.client.leave(8)
  assert list(second) == []  # Ended by Leave.


# -- 12. after all that, the door still opens ---------------------------------------------------


@BOTH_TRANSPORTS
def test_valid_push_still_merges(door):
  """Kept last in the file: the shared server, after every refusal above, merges a good push."""
  refused = door.svc.refused()
  assert door.svc.core.version(1) == 0
  result = door.client.push(_report(fragment=1, step=20), "int4", anchor_values=door.held[1].values)
  assert (result.status, result.weight) == ("accepted", TOKENS**2 / STEPS)
  _wait_version(door.svc, 1, 1)
  # The learner receives version 1 as an int4 delta on its version 0 and checks the digest.
  state = _pull(door.client, 1, 0, held=door.held[1])
  assert state.version == 1
  assert state.digest == door.svc.published_digests()[(1, 1)]
  with door.svc.lock:
    assert state.digest == door.svc.core.state(1).digest
    assert door.svc.core.version(0) == 0
    assert door.svc.core.stats()["merges"] == 1
  assert door.svc.refused() == refused


def test_a_failing_merge_loop_never_holds_the_lock(monkeypatch, transport):
  # A bug in the merge loop is logged and retried, but the loop releases its lock between tries:
  # every RPC still answers and stop() (what a signal calls) returns.
  env = _start(SyncerConfig(min_quorum=1, grace_max_s=0.2), transport)
  try:
    calls = []

    def broken_poll():
      calls.append(time.monotonic())
      raise RuntimeError("merge loop bug")

    versions = list(env.client.status().versions)
    monkeypatch.setattr(env.svc.core.closer, "poll", broken_poll)
    monkeypatch.setattr(
      env.svc.core.closer, "next_deadline", lambda: 0.0
    )  # "Overdue": retry at once.
    with env.svc.lock:
      env.svc.lock.notify_all()
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert len(calls) >= 3
    for _ in range(5):
      assert list(env.client.status().versions) == versions
    t0 = time.monotonic()
    env.svc.stop(flush=False)
    assert time.monotonic() - t0 < 10
  finally:
    env.close()
