"""The syncer's door against hostile or overflowing clients (service/door.py, service/service.py).

Pushes and pulls go over the bulk port (the data plane), the other calls over gRPC (the control
plane). One test or more per kind of abuse: stalled and surplus streams, a second syncer on a port in use,
oversized text, a churn of learner ids, calls made with another learner's id, undecodable requests,
and an unauthenticated syncer on a network address. Each asserts the exact status, that the refusal
is counted in `SyncerService.refused()`, and that the global model (every fragment's version and
digest, and the published digests) did not move.

Fragments: 0 = {"a/w": f32[64, 32]}, 1 = {"b/w": f32[300]}; learner 0 is registered by `env.client`
and round (0, 3) is open, so an int4 push of fragment 0 is 1213 bytes (service_door_test.py).
"""

import dataclasses
import logging
import socket
import time
from collections import Counter
from concurrent import futures

import grpc
import numpy as np
import pytest

from ddiloco.service.server import (
  BindError,
  InsecureServeError,
  SyncerServer,
  make_syncer,
  serve,
)
from ddiloco.service.service import SyncerService
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, RoundRequest, SyncerConfig
from ddiloco.testing.wire import report_to_chunks
from ddiloco.transport import auth, bulk_client, bulk_wire
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "tok"
DIGEST = "L"
FRAGMENTS = [["a/w"], ["b/w"]]
AUTH = auth.token_metadata(TOKEN)
RPC_TIMEOUT_S = 5
_RNG = np.random.default_rng(0)
INIT = {
  "a/w": _RNG.normal(size=(64, 32)).astype(np.float32),
  "b/w": _RNG.normal(size=(300,)).astype(np.float32),
}


@dataclasses.dataclass
class _Env:
  svc: SyncerService
  srv: SyncerServer
  channel: grpc.Channel
  stub: syncer_pb2_grpc.SyncerStub
  client: SyncerClient

  @property
  def address(self) -> str:
    return f"127.0.0.1:{self.srv.port}"

  def close(self) -> None:
    self.client.close()
    self.channel.close()
    self.srv.stop(grace_s=0.5)


def _start(**service_kwargs) -> _Env:
  """A server with learner 0 registered and round (0, 3) open."""
  kwargs = {"uplink_codec": "int4", "downlink_codec": "int4", "liveness_timeout_s": 600.0}
  svc = make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=SyncerConfig(min_quorum=1, grace_max_s=0.2),
    service_config=ServiceConfig(**(kwargs | service_kwargs)),
    layout_digest=DIGEST,
  )
  srv = serve(svc, token=TOKEN)
  client = SyncerClient(f"127.0.0.1:{srv.port}", token=TOKEN)
  client.wait_ready(10)
  client.register(0, layout_digest=DIGEST, num_fragments=2)
  with svc.lock:
    svc.core.open_round(0, 3)
  channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
  return _Env(svc, srv, channel, syncer_pb2_grpc.SyncerStub(channel), client)


@pytest.fixture
def env():
  e = _start()
  yield e
  e.close()


def _model(svc: SyncerService):
  """The global model: (version, digest) per fragment and every published digest."""
  with svc.lock:
    fragments = tuple(
      (svc.core.state(p).version, svc.core.state(p).digest) for p in range(svc.core.num_fragments)
    )
  return fragments, svc.published_digests()


def _chunks(learner: int = 0, chunk_size: int = 1 << 20, codec: str = "fp32"):
  report = Report(
    learner_id=learner,
    fragment=0,
    values={"a/w": INIT["a/w"] + 0.01},
    tokens=100,
    steps=2,
    anchor_version=0,
    step=2,
    round_step=3,
  )
  return report_to_chunks(report, codec, chunk_size=chunk_size)


def _assert_refused(env: _Env, call, code: grpc.StatusCode, message: str) -> None:
  """`call` fails with `code` and `message`, counted once, and the global model is unchanged."""
  model = _model(env.svc)
  refused = Counter(env.svc.refused())
  with pytest.raises(grpc.RpcError) as info:
    call()
  assert info.value.code() == code, info.value.details()
  assert message in info.value.details()
  refused[code.name] += 1
  assert Counter(env.svc.refused()) == refused
  assert _model(env.svc) == model


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    if time.monotonic() > deadline:
      pytest.fail("condition not reached")
    time.sleep(0.02)


def _bulk(env: _Env, session: str | None = None) -> tuple[bulk_client.BulkClient, str]:
  """(a client of the bulk port, where pushes and pulls go; the session to call with: learner 0's
  unless `session` says otherwise)."""
  client = bulk_client.BulkClient(
    "127.0.0.1", env.srv.bulk.port, token=TOKEN, max_frame_bytes=2 << 20
  )
  return client, env.client.session(0) if session is None else session


def _push(env: _Env, chunks, session: str | None = None) -> syncer_pb2.PushResponse:
  """A push of `chunks` (PushChunk messages, or their bytes) over the bulk port, as learner 0."""
  client, session = _bulk(env, session)
  messages = [c if isinstance(c, bytes) else c.SerializeToString() for c in chunks]
  body = client.push(bulk_wire.message_frames(messages), session, RPC_TIMEOUT_S)
  return syncer_pb2.PushResponse.FromString(body)


def _pull(env: _Env, fragment: int, session: str | None = None) -> list:
  """A pull of `fragment` over the bulk port, as learner 0: its chunk messages."""
  client, session = _bulk(env, session)
  request = syncer_pb2.PullRequest(learner_id=0, fragment=fragment, known_version=-1)
  return list(client.pull(request.SerializeToString(), session, RPC_TIMEOUT_S))


# -- 1. stalled and surplus streams -------------------------------------------------------------


class _Stalls:
  """Pushes over the bulk port that send their hello and `first` chunk message (or none), then
  nothing: their connections wait for the syncer's answer. Their hello carries learner 0's
  session (the bulk port counts them as learner 0's from it), or `session` (one that names no
  learner: they stay unclaimed)."""

  def __init__(self, env: _Env, session: str | None = None):
    self._env = env
    self._session = env.client.session(0) if session is None else session
    self.socks: list[socket.socket] = []

  def open(self, n: int, first: bytes | None = None) -> None:
    hello = bulk_wire.hello(bulk_wire.OP_PUSH, TOKEN, self._session)
    frames = b"" if first is None else b"".join(bulk_wire.message_frames([first]))
    for _ in range(n):
      sock = socket.create_connection(("127.0.0.1", self._env.srv.bulk.port), timeout=20)
      sock.sendall(hello + frames)
      self.socks.append(sock)

  def codes(self) -> Counter:
    """The status each one was answered (they wait for it)."""
    out = Counter()
    for sock in self.socks:
      sock.settimeout(20)
      (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, bulk_wire.LENGTH.size))
      assert n == bulk_wire.END
      code, _, _ = bulk_wire.read_trailer(sock)
      out[code.name] += 1
    return out

  def close(self) -> None:
    for sock in self.socks:
      sock.close()


def test_stalled_pushes_cannot_starve_control_calls_nor_learners_and_are_cut_when_idle():
  # 10 pushes over the bulk port that never send a chunk (nor name a learner), against room for 4
  # such: each new one evicts the oldest, so 6 are refused at once and the 4 last hold their
  # places until their header's deadline. Heartbeat and Status (on the gRPC port) and a learner's
  # pull (named at once: a learner's place) go through meanwhile.
  env = _start(
    control_workers=2,
    max_data_streams=12,
    max_unclaimed_streams=4,
    max_rounds_streams=2,
    stream_idle_s=1.0,
    bulk_hello_s=1.0,
  )
  stalls = _Stalls(env, session="nobody's")
  try:
    model = _model(env.svc)
    stalls.open(10)
    _wait_for(lambda: env.svc.refused().get("RESOURCE_EXHAUSTED", 0) == 6)
    assert env.svc.open_streams()["data"] <= 4
    for _ in range(3):
      assert env.client.heartbeat(0, step=1).registered
      assert list(env.client.status().alive) == [0]
    assert _model(env.svc) == model
    assert env.svc.refused() == {"RESOURCE_EXHAUSTED": 6}
    state = env.client.pull(
      0, 1, -1, layout_keys=["b/w"], shapes={"b/w": (300,)}, dtypes={"b/w": np.float32}
    )
    assert state.version == 0
    # A learner's push names itself at once: it evicts the oldest stall if they are all still
    # there (7 refused, 3 cut), and is simply admitted if they were cut already (6 and 4).
    assert env.client.push(_report_for(0), "fp32").status == "accepted"
    codes = stalls.codes()
    assert codes in (
      Counter(RESOURCE_EXHAUSTED=6, DEADLINE_EXCEEDED=4),
      Counter(RESOURCE_EXHAUSTED=7, DEADLINE_EXCEEDED=3),
    )
    assert env.svc.refused() == dict(codes)
    assert env.svc.open_streams()["data"] == 0
    with env.svc.lock:
      assert env.svc.core.stats()["accepted"] == 1
  finally:
    stalls.close()
    env.close()


def _report_for(learner: int) -> Report:
  return Report(
    learner_id=learner,
    fragment=0,
    values={"a/w": INIT["a/w"] + 0.01},
    tokens=100,
    steps=2,
    anchor_version=0,
    step=2,
    round_step=3,
  )


def test_a_push_waiting_for_a_busy_syncer_is_not_evicted_nor_blamed_on_its_learner():
  # Room for one stream before it names its learner. A learner's push sends its chunks at once,
  # but its handler waits for the service's lock (a busy syncer filing or merging). Its hello's
  # session named its learner without the lock, so it holds a learner's place: a stall that comes
  # meanwhile takes the free unnamed place (and is cut at its header's deadline), and cannot evict
  # it. (It used to be evicted, and its claim then refused with "Learner 0 has 4 push and pull
  # streams open" although learner 0 had that one stream alone.)
  env = _start(max_data_streams=4, max_unclaimed_streams=1, stream_idle_s=5.0, bulk_hello_s=1.0)
  stalls = _Stalls(env, session="nobody's")
  pool = futures.ThreadPoolExecutor(1)
  try:
    with env.svc.lock:
      push = pool.submit(_push, env, _chunks())
      _wait_for(lambda: env.svc.open_streams()["data"] == 1)
      time.sleep(0.3)  # Its handler reads the first chunk, then waits for the lock.
      stalls.open(1)  # No chunk at all: the waiting push keeps its place.
      time.sleep(0.3)
      assert env.svc.admission.gate.open_streams() == (2, {0: 1})
    assert push.result(timeout=20).status == "accepted"
    assert stalls.codes() == Counter(DEADLINE_EXCEEDED=1)
    assert env.svc.refused() == {"DEADLINE_EXCEEDED": 1}
    assert env.svc.open_streams()["data"] == 0
  finally:
    pool.shutdown()
    stalls.close()
    env.close()


def test_one_learner_holds_at_most_its_share_of_data_streams():
  env = _start(max_data_streams=8, max_data_streams_per_learner=2, stream_idle_s=0.5)
  stalls = _Stalls(env)
  try:
    model = _model(env.svc)
    stalls.open(4, first=_chunks(chunk_size=256)[0].SerializeToString())  # A header, then nothing.
    assert stalls.codes() == Counter(RESOURCE_EXHAUSTED=2, DEADLINE_EXCEEDED=2)
    assert env.svc.refused() == {"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 2}
    assert _model(env.svc) == model
  finally:
    stalls.close()
    env.close()


def test_a_push_trickling_past_its_total_deadline_is_cut():
  env = _start(stream_idle_s=1.0, stream_deadline_s=1.0)
  try:
    chunks = _chunks(chunk_size=256)  # 8253 bytes in 33 chunks, one every 0.1 s: 3.3 s.
    assert len(chunks) == 33

    def trickle():  # Each frame sent as it comes (a memoryview is never gathered).
      for frame in bulk_wire.message_frames([c.SerializeToString() for c in chunks]):
        time.sleep(0.05)
        yield memoryview(frame)

    client, session = _bulk(env)
    _assert_refused(
      env,
      lambda: client.push(trickle(), session, 20.0),
      grpc.StatusCode.DEADLINE_EXCEEDED,
      "The call was open for more than 1 s. (transfer)",
    )
  finally:
    env.close()


def test_rounds_streams_are_bounded_and_one_per_learner():
  env = _start(max_rounds_streams=2)
  streams = []
  try:
    for i in (1, 2, 3):
      env.client.register(i, layout_digest=DIGEST, num_fragments=2)
    for i in (1, 2):
      streams.append(env.client.rounds(i))
      assert next(iter(streams[-1])) == RoundRequest(0, 3, 0)
    _assert_refused(
      env,
      lambda: next(iter(env.client.rounds(3))),
      grpc.StatusCode.RESOURCE_EXHAUSTED,
      "2 Rounds streams are open, one per learner; no room for learner 3.",
    )
    # A learner's new subscription replaces its own: always room for it.
    replacement = env.client.rounds(1)
    assert next(iter(replacement)) == RoundRequest(0, 3, 0)
    assert list(streams[0]) == [(0, 0), (1, 0)]  # The old one ended after its initial events.
    assert env.svc.open_streams()["rounds"] == 2
    streams.append(replacement)
  finally:
    for s in streams:
      s.cancel()
    env.close()


# -- 2. a second syncer on the same port --------------------------------------------------------


def test_a_second_syncer_cannot_bind_a_port_in_use(env):
  model = _model(env.svc)
  other = make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=SyncerConfig(min_quorum=1),
    service_config=ServiceConfig(),
    layout_digest=DIGEST,
  )
  with pytest.raises(BindError, match=f"^port {env.srv.port} is in use: cannot serve") as info:
    serve(other, address=env.address, token=TOKEN)
  assert isinstance(info.value, OSError) and "\n" not in str(info.value)
  # The first syncer serves on, untouched, and its port is not shared.
  assert env.client.heartbeat(0, step=1).registered
  assert _model(env.svc) == model and env.svc.refused() == {}
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    with pytest.raises(OSError):
      s.bind(("127.0.0.1", env.srv.port))


# -- 3. unbounded text ------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("fields", "message"),
  [
    ({"host": "h" * 1_000_000}, "Field host has 1000000 characters; at most 255 are accepted."),
    ({"layout_digest": "L" * 129}, "Field layout_digest has 129 characters; at most 128"),
  ],
  ids=["host", "layout_digest"],
)
def test_register_with_oversized_text(env, fields, message):
  request = syncer_pb2.RegisterRequest(
    **({"learner_id": 5, "layout_digest": DIGEST, "num_fragments": 2} | fields)
  )
  _assert_refused(
    env,
    lambda: env.stub.Register(request, timeout=RPC_TIMEOUT_S, metadata=AUTH),
    grpc.StatusCode.INVALID_ARGUMENT,
    message,
  )
  assert 5 not in env.svc.members()


def test_push_header_with_an_oversized_codec(env):
  chunks = _chunks()
  chunks[0].header.codec = "c" * 5000
  _assert_refused(
    env,
    lambda: _push(env, chunks),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Push header: Field codec has 5000 characters; at most 16 are accepted.",
  )


def test_logged_client_text_is_clipped(env, caplog):
  with caplog.at_level(logging.INFO, logger="ddiloco.service.service"):
    env.client.register(6, layout_digest=DIGEST, num_fragments=2, host="h" * 255)
  (line,) = [r.getMessage() for r in caplog.records if "learner 6 registered" in r.getMessage()]
  assert len(line) < 120 and "h" * 64 in line and "h" * 65 not in line


# -- 4. members that left are forgotten ---------------------------------------------------------


def test_member_table_stays_bounded_under_a_churn_of_learner_ids():
  env = _start(max_members=4)
  try:
    model = _model(env.svc)
    for i in range(100, 150):
      env.client.register(i, layout_digest=DIGEST, num_fragments=2)
      assert env.client.leave(i)
      assert len(env.svc.members()) <= 4
    assert 0 in env.svc.members()  # Alive: never forgotten for room.
    # A forgotten learner registers again and works as before.
    assert 100 not in env.svc.members()
    env.client.register(100, layout_digest=DIGEST, num_fragments=2)
    assert env.client.heartbeat(100, step=1).registered
    # Full of alive learners (0, 100, 1, 2): a new id is refused, counted; known ids still register.
    for i in (1, 2):
      env.client.register(i, layout_digest=DIGEST, num_fragments=2)
    assert len(env.svc.members()) == 4
    refused = Counter(env.svc.refused())
    with pytest.raises(grpc.RpcError) as info:
      env.client.register(9, layout_digest=DIGEST, num_fragments=2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 learners are registered and alive; no room for learner 9." in info.value.details()
    refused["RESOURCE_EXHAUSTED"] += 1
    assert Counter(env.svc.refused()) == refused
    env.client.register(1, layout_digest=DIGEST, num_fragments=2)
    assert _model(env.svc) == model
  finally:
    env.close()


def test_departed_members_are_forgotten_after_the_retention():
  env = _start(member_retention_s=0.0, heartbeat_interval_s=0.05)
  try:
    env.client.register(7, layout_digest=DIGEST, num_fragments=2)
    assert env.client.leave(7)
    _wait_for(lambda: 7 not in env.svc.members())  # The merge thread's sweep.
    assert 0 in env.svc.members()
    # Its next call finds it unregistered: it registers again, as after a syncer restart.
    assert not env.client.heartbeat(7, step=1).registered
    env.client.register(7, layout_digest=DIGEST, num_fragments=2)
    assert env.client.heartbeat(7, step=1).registered
  finally:
    env.close()


# -- 5. per-learner sessions --------------------------------------------------------------------

_MISSING = "Missing 'ddiloco-session' metadata for learner 0"
_WRONG = "Wrong session for learner 0"


def _calls(env: _Env, session: str | None):
  """Every call made as learner 0, with `session`: pushes and pulls over the bulk port (the
  session in their hello), the rest over gRPC (as metadata)."""
  metadata = AUTH + auth.session_metadata(session)
  return {
    "push": lambda: _push(env, _chunks(), session=session or ""),
    "pull": lambda: _pull(env, 0, session=session or ""),
    "heartbeat": lambda: env.stub.Heartbeat(
      syncer_pb2.HeartbeatRequest(learner_id=0, step=50), timeout=RPC_TIMEOUT_S, metadata=metadata
    ),
    "leave": lambda: env.stub.Leave(
      syncer_pb2.LeaveRequest(learner_id=0), timeout=RPC_TIMEOUT_S, metadata=metadata
    ),
    "rounds": lambda: next(
      env.stub.Rounds(
        syncer_pb2.RoundsRequest(learner_id=0), timeout=RPC_TIMEOUT_S, metadata=metadata
      )
    ),
  }


@pytest.mark.parametrize("method", ["push", "pull", "heartbeat", "leave", "rounds"])
@pytest.mark.parametrize(
  ("session", "message"), [(None, _MISSING), ("not-the-session", _WRONG)], ids=["missing", "wrong"]
)
def test_calls_as_another_learner_are_denied(env, method, session, message):
  with env.svc.lock:
    last_seen = env.svc._members.get(0).last_seen
  _assert_refused(env, _calls(env, session)[method], grpc.StatusCode.PERMISSION_DENIED, message)
  with env.svc.lock:
    assert 0 in env.svc.core.alive()  # Not made to leave, nor kept alive by the caller.
    assert env.svc._members.get(0).last_seen == last_seen
    assert env.svc.core.stats()["accepted"] == 0


def test_a_new_registration_voids_the_old_session(env):
  old = env.client.learner_metadata(0)
  other = SyncerClient(env.address, token=TOKEN)
  try:
    other.register(0, layout_digest=DIGEST, num_fragments=2)  # A restarted learner 0.
    assert other.learner_metadata(0) != old
    _assert_refused(
      env,
      lambda: env.stub.Heartbeat(
        syncer_pb2.HeartbeatRequest(learner_id=0), timeout=RPC_TIMEOUT_S, metadata=old
      ),
      grpc.StatusCode.PERMISSION_DENIED,
      _WRONG,
    )
    assert other.heartbeat(0, step=1).registered
    # The stale client registers again on the refusal (as the worker does) and works.
    env.client.register(0, layout_digest=DIGEST, num_fragments=2)
    assert env.client.heartbeat(0, step=1).registered
  finally:
    other.close()


# -- 6. undecodable requests --------------------------------------------------------------------


@pytest.mark.parametrize(
  ("method", "streaming"),
  [
    ("Register", False),
    ("Heartbeat", False),
    ("Leave", False),
    ("Status", False),
    ("Rounds", True),
  ],
)
@pytest.mark.parametrize("garbage", [b"\x0a\xff", b"\xff\xff\xff\xff"], ids=["short", "tag"])
def test_undecodable_request_bytes(env, method, streaming, garbage):
  make = env.channel.unary_stream if streaming else env.channel.unary_unary
  call = make(f"/ddiloco.v1.Syncer/{method}", request_serializer=None, response_deserializer=None)

  def send():
    response = call(garbage, timeout=RPC_TIMEOUT_S, metadata=env.client.learner_metadata(0))
    return list(response) if streaming else response

  _assert_refused(env, send, grpc.StatusCode.INVALID_ARGUMENT, "Undecodable")


def test_register_with_a_host_that_is_not_utf8(env):
  call = env.channel.unary_unary(
    "/ddiloco.v1.Syncer/Register", request_serializer=None, response_deserializer=None
  )
  garbage = b"\x32\x02\xff\xfe"  # Field 6 (host), 2 bytes that are not UTF-8.
  _assert_refused(
    env,
    lambda: call(garbage, timeout=RPC_TIMEOUT_S, metadata=AUTH),
    grpc.StatusCode.INVALID_ARGUMENT,
    "Undecodable RegisterRequest (4 bytes)",
  )


# -- 7. no token on a network address ---------------------------------------------------------


def _bare_service() -> SyncerService:
  return make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=SyncerConfig(min_quorum=1),
    service_config=ServiceConfig(),
    layout_digest=DIGEST,
  )


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", ":0"])
def test_no_token_on_a_network_address_is_refused(address):
  svc = _bare_service()
  model = _model(svc)
  with pytest.raises(InsecureServeError, match="without a shared token"):
    serve(svc, address=address)
  assert _model(svc) == model and svc.refused() == {}


def test_insecure_flag_serves_without_a_token_and_warns(caplog):
  svc = _bare_service()
  with caplog.at_level(logging.WARNING, logger="ddiloco.service.server"):
    srv = serve(svc, address="0.0.0.0:0", insecure=True)
  try:
    assert any("WITHOUT authentication" in r.getMessage() for r in caplog.records)
    client = SyncerClient(f"127.0.0.1:{srv.port}")
    try:
      client.register(0, layout_digest=DIGEST, num_fragments=2)
      assert list(client.status().alive) == [0]
    finally:
      client.close()
  finally:
    srv.stop(grace_s=0.5)


def test_loopback_without_a_token_is_still_served():
  srv = serve(_bare_service(), address="localhost:0")
  srv.stop(grace_s=0.5)
