"""The syncer's bulk port, its data plane (service/bulk_server.py, transport/bulk_wire.py):
pushes and pulls over it, its door, and a connection that breaks.

Each refusal test asserts the status and a precise part of the message the client reads in the
trailer, that `Status.refused` counted exactly that one refusal, and that the global model did not
move (every fragment's version and digest). Fragment 0 = {"a/w": f32[128, 64]} (32 KiB), chunks of
4 KiB: a push is 9 chunk messages.

Each class of abuse has its tests: phase deadlines a trickle cannot restart (the hello, a push's
header and chunks, a pull's sends), fairness between learners (stalled transfers of some cannot
starve another), and bounded connections (a flood of them cannot keep a learner out).
"""

import contextlib
import select
import shutil
import socket
import threading
import time

import grpc
import numpy as np
import optax
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import runtime
from ddiloco.launch.job import JobConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, SyncerConfig
from ddiloco.testing import runs
from ddiloco.testing.wire import push_messages
from ddiloco.transport import bulk_client, bulk_wire, messages, state_messages
from ddiloco.transport.client import SyncerClient, fragment_layouts
from ddiloco.transport.proto import syncer_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "tok"
DIGEST = "L"
FRAGMENTS = [["a/w"]]
INIT = {"a/w": np.random.default_rng(0).normal(size=(128, 64)).astype(np.float32)}
LAYOUT = fragment_layouts(FRAGMENTS, INIT)[0]
CHUNK = 4096
ROUND = 1
_ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}


class _Env:
  """A served syncer (bulk port on), learner 0 registered and holding version 0, a round open."""

  def __init__(self, tmp_path=None, *, tls: bool = False, init=None, learners: int = 1, **config):
    service_config = ServiceConfig(
      **{
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
        "max_chunk_bytes": CHUNK,
        "bulk_chunk_bytes": CHUNK,
        "liveness_timeout_s": 600.0,
      }
      | config
    )
    self.init = INIT if init is None else init
    self.svc = make_syncer(
      fragment_keys=FRAGMENTS,
      init_values=self.init,
      syncer_config=SyncerConfig(min_quorum=2, use_grace=False),
      service_config=service_config,
      layout_digest=DIGEST,
    )
    cert = None
    if tls:
      cert, key = runs.self_signed_certificate(str(tmp_path), san="IP:127.0.0.1")
    self.srv = serve(self.svc, token=TOKEN, tls=None if cert is None else (cert, key))
    self.client = SyncerClient(
      f"127.0.0.1:{self.srv.port}",
      token=TOKEN,
      max_chunk_bytes=CHUNK,
      tls_ca_file=cert,
    )
    self.client.wait_ready(10)
    for learner in reversed(range(learners)):  # Learner 0's registration last: `register`.
      self.register = self.client.register(learner, layout_digest=DIGEST, num_fragments=1)
    self.held = self.pull()
    assert self.svc.core.open_round(0, ROUND) is not None

  def pull(self, known: int = -1):
    return self.client.pull(
      0,
      0,
      known,
      layout_keys=["a/w"],
      shapes={"a/w": self.init["a/w"].shape},
      dtypes={"a/w": np.float32},
    )

  def report(self, step: int = 1, learner: int = 0) -> Report:
    values = {k: v + np.float32(0.01) for k, v in self.held.values.items()}
    return Report(
      learner_id=learner,
      fragment=0,
      values=values,
      tokens=100,
      steps=2,
      anchor_version=0,
      step=step,
      round_step=ROUND,
    )

  def chunks(self, learner: int = 0) -> list[bytes]:
    chunk = self.svc.config.bulk_chunk_bytes
    return list(push_messages(self.report(learner=learner), "fp32", chunk_size=chunk))

  def model(self) -> list[tuple[int, str]]:
    with self.svc.lock:
      return [(self.svc.core.version(p), self.svc.core.state(p).digest) for p in range(1)]

  def connect(self) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", self.srv.bulk.port), timeout=10)
    sock.settimeout(10)
    return sock

  def hello(
    self, op: int = bulk_wire.OP_PUSH, *, token=TOKEN, session=None, request=b"", learner: int = 0
  ):
    session = self.client.session(learner) if session is None else session
    return bulk_wire.hello(op, token, session, request)

  def pull_hello(self, learner: int = 0) -> bytes:
    request = syncer_pb2.PullRequest(learner_id=learner, fragment=0, known_version=-1)
    return self.hello(bulk_wire.OP_PULL, request=request.SerializeToString(), learner=learner)

  def close(self) -> None:
    self.client.close()
    self.srv.stop(grace_s=0.5)


@pytest.fixture
def env():
  e = _Env()
  yield e
  e.close()


def _status(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
  """Reads frames until the trailer; its status and message."""
  while True:
    (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, 4))
    if n == bulk_wire.END:
      code, message, _ = bulk_wire.read_trailer(sock)
      return code, message
    bulk_wire.recv_exact(sock, n)


def _refused(env: _Env, sock: socket.socket, code: grpc.StatusCode, words: str, before) -> None:
  """The trailer's status and message; one refusal of that code counted; the model unchanged."""
  got, message = _status(sock)
  sock.close()
  assert got == code, message
  assert words in message
  assert env.svc.refused() == {code.name: 1}
  assert env.model() == before


# -- the happy paths -----------------------------------------------------------------------------


def test_the_bulk_port_has_its_own_larger_chunk_bound(monkeypatch):
  """Register advertises the bulk port's chunk bound; the client cuts its pushes into it and the
  syncer its pulls, while a Recover's (gRPC) stays `max_chunk_bytes`."""
  sizes = {"push": [], "pull": []}
  push_pieces, state_pieces = messages.push_pieces, state_messages.state_pieces

  def spy(kind, fn):
    def wrapped(*args, **kwargs):
      sizes[kind].append(kwargs["chunk_size"])
      return fn(*args, **kwargs)

    return wrapped

  monkeypatch.setattr(messages, "push_pieces", spy("push", push_pieces))
  monkeypatch.setattr(state_messages, "state_pieces", spy("pull", state_pieces))
  e = _Env(bulk_chunk_bytes=4 * CHUNK)
  try:
    assert (e.register.max_chunk_bytes, e.register.bulk_chunk_bytes) == (CHUNK, 4 * CHUNK)
    assert e.held.version == 0 and sizes["pull"] == [4 * CHUNK]  # Pulled over the port.
    result = e.client.push(e.report(), "fp32")
    assert result.status == "accepted" and sizes["push"] == [4 * CHUNK]
    assert e.srv.bulk.calls["Push"] == 1
  finally:
    e.close()


def test_register_advertises_the_bulk_port_and_pushes_and_pulls_go_over_it(env):
  assert env.register.bulk_port == env.srv.bulk.port > 0
  assert env.client.bulk_port == env.srv.bulk.port
  assert env.held.version == 0 and env.held.digest == env.model()[0][1]
  result = env.client.push(env.report(), "fp32", anchor_values=env.held.values)
  assert (result.status, result.weight) == ("accepted", 100**2 / 2)
  assert env.srv.bulk.calls == {"Pull": 1, "Push": 1}
  assert env.pull(known=0) is None  # Nothing newer: an empty stream, OK.
  assert env.svc.refused() == {}
  up, down = env.svc.traffic()
  assert up > INIT["a/w"].nbytes and down > INIT["a/w"].nbytes


def test_a_push_of_a_learner_not_alive_is_refused_from_its_header(env):
  with env.svc.lock:
    env.svc.core.leave(0)  # Not alive: refused at the door, FAILED_PRECONDITION.
  with pytest.raises(grpc.RpcError) as e:
    env.client.push(env.report(), "fp32")
  assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  assert env.srv.bulk.calls["Push"] == 1


# -- refusals at the door ------------------------------------------------------------------------


def test_bad_token(env):
  before, sock = env.model(), env.connect()
  sock.sendall(env.hello(token="nope") + b"".join(_frames(env.chunks())))
  _refused(env, sock, grpc.StatusCode.UNAUTHENTICATED, "Wrong shared token", before)


def test_missing_and_bad_session(env):
  before, sock = env.model(), env.connect()
  sock.sendall(env.hello(session="stale") + b"".join(_frames(env.chunks())))
  _refused(env, sock, grpc.StatusCode.PERMISSION_DENIED, "Wrong session", before)


def test_oversize_frame_is_refused_before_it_is_read(env):
  before, sock = env.model(), env.connect()
  sock.sendall(env.hello() + bulk_wire.LENGTH.pack(CHUNK + (64 << 10) + 1))
  _refused(env, sock, grpc.StatusCode.RESOURCE_EXHAUSTED, "chunk messages are at most", before)


def test_truncated_stream(env):
  before, sock = env.model(), env.connect()
  frames = _frames(env.chunks())
  sock.sendall(env.hello() + frames[0] + frames[1][:100])
  sock.shutdown(socket.SHUT_WR)
  _refused(env, sock, grpc.StatusCode.INVALID_ARGUMENT, "truncated", before)


def test_missing_chunks_end_marked(env):
  before, sock = env.model(), env.connect()
  sock.sendall(
    env.hello() + b"".join(_frames(env.chunks()[:-1])) + bulk_wire.LENGTH.pack(0xFFFFFFFF)
  )
  _refused(env, sock, grpc.StatusCode.INVALID_ARGUMENT, "Missing 1 of", before)


def test_garbage_hello(env):
  before, sock = env.model(), env.connect()
  sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
  _refused(env, sock, grpc.StatusCode.INVALID_ARGUMENT, "bad magic", before)


def test_hello_over_its_bounds(env):
  before, sock = env.model(), env.connect()
  sock.sendall(bulk_wire.MAGIC + bulk_wire.HELLO.pack(bulk_wire.OP_PUSH, 60000, 0, 0))
  _refused(env, sock, grpc.StatusCode.INVALID_ARGUMENT, "out of bounds", before)


def test_garbage_chunk_message(env):
  before, sock = env.model(), env.connect()
  sock.sendall(
    env.hello() + b"".join(_frames([b"\xff" * 64])) + bulk_wire.LENGTH.pack(bulk_wire.END)
  )
  _refused(env, sock, grpc.StatusCode.INVALID_ARGUMENT, "Malformed chunk message", before)


def test_garbage_pull_request(env):
  before, sock = env.model(), env.connect()
  sock.sendall(env.hello(bulk_wire.OP_PULL, request=b"\xff\xff\xff"))
  _refused(env, sock, grpc.StatusCode.INVALID_ARGUMENT, "Undecodable PullRequest", before)


def test_silence_before_the_hello_and_mid_push_is_cut_naming_its_phase():
  env = _Env(bulk_hello_s=0.4, stream_idle_s=0.4, stream_deadline_s=30.0)
  try:
    before, sock = env.model(), env.connect()
    _refused(
      env, sock, grpc.StatusCode.DEADLINE_EXCEEDED, "No whole bulk hello within 0.4 s", before
    )
    sock = env.connect()
    sock.sendall(env.hello() + _frames(env.chunks())[0])  # Then silence.
    got, message = _status(sock)
    sock.close()
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED and message.endswith("(chunk)"), message
    assert "after its 0.4 s grace" in message
    assert env.svc.refused() == {"DEADLINE_EXCEEDED": 2}
    assert env.srv.bulk.expired == {"hello": 1, "chunk": 1}
    counters = env.client.status().counters
    assert counters["bulk_expired_hello"] == 1 and counters["bulk_expired_chunk"] == 1
    assert env.model() == before
  finally:
    env.close()


def test_a_push_given_up_by_its_client_holds_its_place_until_its_handler_ends():
  # A learner's share is counted from its streams' handlers, not from its clients' view: a push
  # whose client gave up (its deadline passed, say) still counts until the syncer's handler ends,
  # and a retry meanwhile is refused as over the share (transient: the retry with backoff passes
  # once the first attempt's handler is done). Nothing leaks: the place is freed then.
  env = _Env(max_data_streams_per_learner=1, stream_idle_s=5.0)
  try:
    before, frames = env.model(), _frames(env.chunks())
    first = env.connect()
    first.sendall(env.hello() + frames[0] + frames[1][:100])  # Claimed, then mid-frame.
    _wait_for(lambda: env.svc.open_streams()["data"] == 1)
    time.sleep(0.3)  # Its handler has read the header and claimed the stream for learner 0.
    retry = env.connect()
    retry.sendall(env.hello() + b"".join(frames) + bulk_wire.LENGTH.pack(bulk_wire.END))
    got, message = _status(retry)
    retry.close()
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, message
    assert "Learner 0 has 1 push and pull streams open" in message
    assert env.svc.open_streams()["data"] == 1  # The first attempt's handler still holds it.
    first.close()  # Its client is gone: the handler reads the cut frame and ends.
    _wait_for(lambda: env.svc.open_streams()["data"] == 0)
    assert env.svc.refused() == {"RESOURCE_EXHAUSTED": 1, "INVALID_ARGUMENT": 1}
    assert env.model() == before
    result = env.client.push(env.report(), "fp32", anchor_values=env.held.values)
    assert result.status == "accepted"
    assert env.svc.open_streams()["data"] == 0
  finally:
    env.close()


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    if time.monotonic() > deadline:
      pytest.fail("condition not reached")
    time.sleep(0.02)


# -- phase deadlines a trickle cannot restart ----------------------------------------------------


def _trickle(sock: socket.socket, data: bytes, every_s: float, give_up_s: float) -> float:
  """Sends `data` a byte every `every_s` until the syncer answers (or cuts) or `give_up_s`
  passes; returns the seconds it took."""
  start = time.monotonic()
  for byte in data:
    if select.select([sock], [], [], every_s)[0] or time.monotonic() - start > give_up_s:
      break
    with contextlib.suppress(OSError):
      sock.sendall(bytes([byte]))
  return time.monotonic() - start


@pytest.mark.parametrize("phase", ["hello", "header", "chunk"])
def test_a_trickler_is_cut_within_its_phase_deadline(phase):
  # A byte every 0.3 s: an idle timer of 1 s, restarted on every byte, would never fire. Each
  # phase has 1 s of grace, and a byte earns 1/1024 s of it: the trickler is cut about 1 s in.
  env = _Env(bulk_hello_s=1.0, stream_idle_s=1.0, bulk_min_rate=1024, stream_deadline_s=30.0)
  try:
    before, sock = env.model(), env.connect()
    frames = _frames(env.chunks())
    sent = {"hello": b"", "header": env.hello(), "chunk": env.hello() + frames[0]}[phase]
    sock.sendall(sent)
    trickled = {"hello": env.hello(), "header": frames[0], "chunk": frames[1]}[phase]
    took = _trickle(sock, trickled, every_s=0.3, give_up_s=8.0)
    assert took < 3.0, f"not cut within its {phase} phase's deadline ({took:.1f} s)"
    _refused(env, sock, grpc.StatusCode.DEADLINE_EXCEEDED, f"({phase})", before)
    assert env.srv.bulk.expired == {phase: 1}
  finally:
    env.close()


_BIG = {"a/w": np.random.default_rng(1).normal(size=(1024, 1024)).astype(np.float32)}  # 4 MiB


def _big_env(**config) -> _Env:
  """Fragment 0 of 4 MiB in chunks of 64 KiB, chunk grace 1 s, at least 256 KiB/s."""
  kwargs = {"max_chunk_bytes": 64 << 10, "bulk_chunk_bytes": 64 << 10, "stream_idle_s": 1.0}
  return _Env(init=_BIG, bulk_min_rate=256 << 10, stream_deadline_s=30.0, **(kwargs | config))


def _pull_socket(env: _Env) -> socket.socket:
  """A pull's connection with a small receive buffer, its hello sent."""
  sock = socket.socket()
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
  sock.settimeout(10)
  sock.connect(("127.0.0.1", env.srv.bulk.port))
  sock.sendall(env.pull_hello())
  return sock


def test_a_pull_whose_client_stops_reading_is_cut_at_its_grace():
  env = _big_env()
  try:
    sock = _pull_socket(env)  # Reads nothing.
    _wait_for(lambda: env.srv.bulk.expired, timeout_s=8.0)
    assert sum(env.srv.bulk.expired.values()) == 1
    assert env.svc.refused() == {"DEADLINE_EXCEEDED": 1}
    _wait_for(lambda: env.srv.bulk.open_connections() == 0)
    assert env.svc.open_streams()["data"] == 0
    sock.close()
  finally:
    env.close()


def test_a_pull_read_below_the_minimum_rate_is_cut():
  # 100 KiB/s, each 64 KiB chunk message sent within a second (a per-send idle timer of 1 s never
  # fires), against a minimum of 256 KiB/s: the whole call falls behind its budget (1 s of grace
  # plus 4 s per MiB acknowledged) after ~170 KB, about 2 s in.
  env = _big_env()
  try:
    sock = _pull_socket(env)
    start, got = time.monotonic(), 0
    sock.settimeout(0.01)
    while not env.srv.bulk.expired and time.monotonic() - start < 10.0:
      time.sleep(0.16)
      # 16 KiB a tick, in as many reads as the small receive buffer needs (one read gets at most
      # what it holds, a few KiB: the rate would fall below 64 KiB a second and the per-send
      # timer, not the rate budget, would cut the pull).
      want = 16 << 10
      try:
        while want:
          n = len(sock.recv(want))
          if not n:
            break
          got, want = got + n, want - n
      except TimeoutError:
        pass
      except ConnectionResetError:  # The syncer cut the pull.
        _wait_for(lambda: env.srv.bulk.expired)
        break
    took = time.monotonic() - start
    assert took < 6.0 and got < 1 << 20, f"cut after {took:.1f} s and {got} bytes"
    assert env.srv.bulk.expired == {"transfer": 1}
    assert env.svc.refused() == {"DEADLINE_EXCEEDED": 1}
    sock.close()
  finally:
    env.close()


def test_a_slow_link_above_the_minimum_rate_is_not_cut():
  # 1 MiB/s, four times the minimum, for 4 MiB: 4 s, past every grace, and the pull succeeds.
  env = _big_env()
  try:
    sock = _pull_socket(env)
    start, frames, code = time.monotonic(), 0, None
    while code is None:
      (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, 4))
      if n == bulk_wire.END:
        code, message, _ = bulk_wire.read_trailer(sock)
        break
      bulk_wire.recv_exact(sock, n)
      frames += 1
      time.sleep(max(0.0, start + frames * (n / (1 << 20)) - time.monotonic()))
    assert code == grpc.StatusCode.OK, message
    assert time.monotonic() - start > 3.0 and env.svc.refused() == {}
    sock.close()
  finally:
    env.close()


# -- fairness between learners -------------------------------------------------------------------


def _stall(env: _Env, learner: int) -> socket.socket:
  """A push of `learner` that sends its hello and header, then nothing."""
  sock = env.connect()
  sock.sendall(env.hello(learner=learner) + _frames(env.chunks(learner))[0])
  return sock


def test_stalled_pushes_of_some_learners_cannot_starve_another():
  # Four places for learners, two per learner; learners 1 and 2 fill them with pushes stalled
  # mid-body (their chunk deadline is far). Learner 0, with nothing open, takes the newest place
  # of a learner holding two for its push; that learner stalls another in the place freed, and
  # learner 0 takes one again for its pull. Both succeed; the two stalls cut are answered
  # RESOURCE_EXHAUSTED, saying why.
  env = _Env(
    learners=3,
    max_data_streams=4,
    max_data_streams_per_learner=2,
    max_unclaimed_streams=2,
    stream_idle_s=20.0,
  )
  try:
    full = (4, {1: 2, 2: 2})
    stalls = []
    for n, learner in enumerate((1, 2, 1, 2), 1):  # Each named before the next comes (with two
      stalls.append(_stall(env, learner))  # unclaimed places, a third silent one evicts one).
      _wait_for(lambda n=n: sum(env.svc.admission.gate.open_streams()[1].values()) == n)
    assert env.svc.admission.gate.open_streams() == full
    result = env.client.push(env.report(), "fp32", anchor_values=env.held.values)
    assert result.status == "accepted"
    _wait_for(lambda: env.svc.admission.gate.open_streams()[0] == 3)
    _, held = env.svc.admission.gate.open_streams()
    stalls.append(_stall(env, 1 if held.get(1, 0) < 2 else 2))  # The one that lost a place.
    _wait_for(lambda: env.svc.admission.gate.open_streams() == full)
    assert env.pull(known=-1).version == 0
    cut = [sock for sock in stalls if select.select([sock], [], [], 5.0)[0]]
    assert len(cut) == 2
    for sock in cut:
      code, message = _status(sock)
      assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cut to make room" in message
    assert env.svc.refused() == {"RESOURCE_EXHAUSTED": 2}
    assert env.svc.admission.gate.open_streams()[0] == 3
    for sock in stalls:
      sock.close()
  finally:
    env.close()


# -- bounded connections -------------------------------------------------------------------------


def test_a_flood_of_silent_connections_is_bounded_and_a_learner_still_gets_in():
  # Room for two connections that have not named their learner: each new one evicts the
  # oldest, answered RESOURCE_EXHAUSTED; threads and connections stay bounded, and the learner's
  # push and pull (which name it in their hello) get in.
  # (The connection cap is above the flood: it is another test's.)
  env = _Env(
    max_data_streams=4, max_unclaimed_streams=2, bulk_hello_s=20.0, max_bulk_connections=16
  )
  try:
    threads = threading.active_count()
    flood = [env.connect() for _ in range(12)]
    _wait_for(  # Every one accepted, ten evicted and closed.
      lambda: (
        env.svc.refused().get("RESOURCE_EXHAUSTED", 0) == 10
        and env.srv.bulk.open_connections() <= 2
      )
    )
    assert threading.active_count() <= threads + 4  # Two connections' threads, and slack.
    result = env.client.push(env.report(), "fp32", anchor_values=env.held.values)
    assert result.status == "accepted" and env.pull(known=-1).version == 0
    answered = [_status(sock) for sock in flood if select.select([sock], [], [], 5.0)[0]]
    assert len(answered) >= 10
    assert all(c == grpc.StatusCode.RESOURCE_EXHAUSTED and "oldest" in m for c, m in answered)
    assert env.svc.refused() == {"RESOURCE_EXHAUSTED": len(answered)}
    for sock in flood:
      sock.close()
  finally:
    env.close()


def test_a_connection_beyond_the_limit_is_closed_at_once_and_counted():
  env = _Env(
    learners=3,
    max_data_streams=2,
    max_data_streams_per_learner=2,
    max_unclaimed_streams=2,
    max_bulk_connections=4,
  )
  try:
    before, held = env.model(), []
    for learner in (1, 2):  # Each named before the next comes (else it could evict it).
      held.append(_stall(env, learner))
      _wait_for(lambda n=learner: sum(env.svc.admission.gate.open_streams()[1].values()) == n)
    held += [env.connect(), env.connect()]  # Two silent.
    _wait_for(lambda: env.srv.bulk.open_connections() == 4)
    _refused(env, env.connect(), grpc.StatusCode.RESOURCE_EXHAUSTED, "4 connections open", before)
    assert env.srv.bulk.dropped == {"connections": 1}
    assert env.client.status().counters["bulk_dropped_connections"] == 1
    for sock in held:
      sock.close()
  finally:
    env.close()


# -- a broken connection, shutdown, TLS ----------------------------------------------------------


def test_a_push_whose_connection_broke_fails_unavailable_and_its_retry_goes_over_the_port(
  monkeypatch,
):
  """No route to fall back on and none to stay away from: the call fails UNAVAILABLE (the
  learner's sender retries it with backoff), and the next one goes over the bulk port."""
  env = _Env()
  try:
    push = bulk_client.BulkClient.push
    broken = []

    def once_broken(self, *args, **kwargs):  # A connection reset mid-push, once.
      if not broken:
        broken.append(True)
        raise bulk_client.BulkUnavailable("connection reset by peer")
      return push(self, *args, **kwargs)

    monkeypatch.setattr(bulk_client.BulkClient, "push", once_broken)
    with pytest.raises(grpc.RpcError) as e:
      env.client.push(env.report(), "fp32", anchor_values=env.held.values)
    assert (e.value.code(), e.value.details()) == (
      grpc.StatusCode.UNAVAILABLE,
      "connection reset by peer",
    )
    assert env.srv.bulk.calls["Push"] == 0 and env.svc.core.stats()["accepted"] == 0
    result = env.client.push(env.report(), "fp32", anchor_values=env.held.values)
    assert result.status == "accepted" and env.srv.bulk.calls["Push"] == 1
    assert env.client.bulk_port == env.srv.bulk.port
  finally:
    env.close()


def test_stop_joins_every_bulk_thread():
  env = _Env()
  sock = env.connect()  # An open connection, idle: stop must cut it.
  env.close()
  sock.close()
  assert not [t.name for t in threading.enumerate() if t.name.startswith("syncer-bulk")]
  with pytest.raises(OSError), contextlib.closing(env.connect()):
    pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_on_both_ports(tmp_path):
  env = _Env(tmp_path, tls=True)
  try:
    assert env.client.bulk_port == env.srv.bulk.port
    assert env.client.push(env.report(), "fp32", anchor_values=env.held.values).weight > 0
    assert env.srv.bulk.calls == {"Pull": 1, "Push": 1}
    plain = env.connect()  # A plaintext hello is no TLS handshake: the connection just ends.
    plain.sendall(env.hello())
    with contextlib.suppress(ConnectionResetError):  # Closed, reset, or a TLS alert.
      assert not plain.recv(64).startswith(bulk_wire.LENGTH.pack(bulk_wire.END))
    plain.close()
    assert env.svc.refused() == {}
  finally:
    env.close()


# -- a learner worker over the bulk port ---------------------------------------------------------


def test_a_learner_worker_trains_over_the_bulk_port(tmp_path):
  """A real worker (lock-step, P = 2) against a served syncer: every push and pull goes over the
  bulk port, its merges apply, and its fragments are bit-identical with the syncer's."""
  job = JobConfig(
    run=RunConfig(
      model=configs.transformer_config("tiny", vocab_size=256, max_len=8, **_ONE_BLOCK),
      data=text_data.TextDataConfig(seq_len=8, batch_size=8),
      schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
      syncer=SyncerConfig(use_grace=False, outer_optimizer=lambda: optax.sgd(0.7), clock="slowest"),
      learner=LearnerConfig(blocking=True),
      inner_opt=InnerOptConfig(warmup_steps=1, decay_steps=50),
      service=ServiceConfig(
        uplink_codec="fp32",
        downlink_codec="fp32",
        heartbeat_interval_s=0.05,
        liveness_timeout_s=600,
      ),
      num_learners=1,
      eval_batches=1,
    )
  )
  factory = job.factory()
  svc = make_syncer(
    fragment_keys=factory.layout.fragments,
    init_values=factory.global_init_values(),
    syncer_config=job.run.the_syncer(),
    schedule=job.run.the_schedule(),
    service_config=job.run.the_service(),
    layout_digest=factory.layout.digest,
    embedding_keys=factory.embedding_keys(),
  )
  srv = serve(svc)
  client = SyncerClient(f"127.0.0.1:{srv.port}", deadline_s=10.0)
  try:
    worker, writer = runtime.make_learner_worker(
      job, learner_id=0, client=client, workdir=str(tmp_path / "w"), connect_timeout_s=30.0
    )
    worker.connect()
    summary = worker.run(8)
    writer.close()
    assert client.bulk_port == srv.bulk.port
    assert summary["digest_mismatches"] == 0 and summary["applies"]
    pushes = summary["push_status"].get("accepted", 0)
    assert pushes >= 2 and srv.bulk.calls["Push"] == sum(summary["push_status"].values())
    assert srv.bulk.calls["Pull"] >= 2 + len(summary["applies"]) - 1
    with svc.lock:
      states = [svc.core.state(p) for p in range(2)]
    assert sum(st.version for st in states) > 0
    for p, state in enumerate(states):
      if worker.learner.kernel.anchor[p] == state.version:
        assert worker.learner.device.applied_digest[p] == state.digest
    assert svc.refused() == {}
  finally:
    client.close()
    srv.stop(grace_s=0.5)


def _frames(chunks: list[bytes]) -> list[bytes]:
  return [bulk_wire.LENGTH.pack(len(c)) + c for c in chunks]
