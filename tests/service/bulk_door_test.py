"""The syncer's bulk port, its data plane (service/bulk_server.py, transport/bulk_wire.py):
pushes and pulls over it, its door, and a connection that breaks.

Each refusal test asserts the status and a precise part of the message the client reads in the
trailer, that `Status.refused` counted exactly that one refusal, and that the global model did not
move (every fragment's version and digest). Fragment 0 = {"a/w": f32[128, 64]} (32 KiB), chunks of
4 KiB: a push is 9 chunk messages.
"""

import contextlib
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

  def __init__(self, tmp_path=None, *, tls: bool = False, **config):
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
    self.svc = make_syncer(
      fragment_keys=FRAGMENTS,
      init_values=INIT,
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
    self.register = self.client.register(0, layout_digest=DIGEST, num_fragments=1)
    self.held = self.pull()
    assert self.svc.core.open_round(0, ROUND) is not None

  def pull(self, known: int = -1):
    return self.client.pull(
      0,
      0,
      known,
      layout_keys=list(LAYOUT),
      shapes={k: s for k, (s, _) in LAYOUT.items()},
      dtypes={k: d for k, (_, d) in LAYOUT.items()},
    )

  def report(self, step: int = 1) -> Report:
    values = {k: v + np.float32(0.01) for k, v in self.held.values.items()}
    return Report(
      learner_id=0,
      fragment=0,
      values=values,
      tokens=100,
      steps=2,
      anchor_version=0,
      step=step,
      round_step=ROUND,
    )

  def chunks(self) -> list[bytes]:
    return list(push_messages(self.report(), "fp32", chunk_size=CHUNK))

  def model(self) -> list[tuple[int, str]]:
    with self.svc.lock:
      return [(self.svc.core.version(p), self.svc.core.state(p).digest) for p in range(1)]

  def connect(self) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", self.srv.bulk.port), timeout=10)
    sock.settimeout(10)
    return sock

  def hello(self, op: int = bulk_wire.OP_PUSH, *, token=TOKEN, session=None, request=b""):
    session = self.client.session(0) if session is None else session
    return bulk_wire.hello(op, token, session, request)

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


# -- the happy paths ----------------------------------------------------------------------------


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


# -- refusals at the door -----------------------------------------------------------------------


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


def test_idle_stall_before_the_hello_and_mid_push():
  env = _Env(stream_idle_s=0.4, stream_deadline_s=30.0)
  try:
    before, sock = env.model(), env.connect()
    _refused(env, sock, grpc.StatusCode.DEADLINE_EXCEEDED, "No bulk hello", before)
    sock = env.connect()
    sock.sendall(env.hello() + _frames(env.chunks())[0])  # Then silence.
    got, message = _status(sock)
    sock.close()
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED and "No push chunk for 0.4 s" in message
    assert env.svc.refused() == {"DEADLINE_EXCEEDED": 2}
    assert env.model() == before
  finally:
    env.close()


def test_too_many_connections():
  env = _Env(max_data_streams=2, max_data_streams_per_learner=2, max_unclaimed_streams=2)
  try:
    before = env.model()
    held = [env.connect(), env.connect()]
    deadline = time.monotonic() + 5
    while env.srv.bulk.open_connections() < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
    _refused(env, env.connect(), grpc.StatusCode.RESOURCE_EXHAUSTED, "connections open", before)
    for sock in held:
      sock.close()
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


# -- a broken connection, shutdown, TLS -------------------------------------------------------------


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


# -- a learner worker over the bulk port ----------------------------------------------------------


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
