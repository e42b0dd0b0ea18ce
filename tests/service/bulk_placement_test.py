"""The bulk port receives chunks straight into their output arrays (transport/placement.py):
what it files is what was sent, and a hostile stream whose chunks were placed is refused whole.

Fragment 0 = {"a/w": f32[128, 64]} (32 KiB) in chunks of 4 KiB: chunks 1 to 7 lie inside the
payload, so the syncer receives them in place; the client's pulls land in place too.
"""

import dataclasses
import socket

import grpc
import ml_dtypes
import numpy as np
import pytest

from ddiloco.service import streams
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, SyncerConfig
from ddiloco.testing.wire import push_messages
from ddiloco.transport import bulk_wire, frames
from ddiloco.transport.client import SyncerClient, fragment_layouts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "tok"
FRAGMENTS = [["a/w"]]
INIT = {"a/w": np.random.default_rng(0).normal(size=(128, 64)).astype(np.float32)}
LAYOUT = fragment_layouts(FRAGMENTS, INIT)[0]
CHUNK = 4096


class _Env:
  """A served syncer with its bulk port, learner 0 registered and holding version 0, a round open."""

  def __init__(self, uplink: str = "fp32"):
    self.svc = make_syncer(
      fragment_keys=FRAGMENTS,
      init_values=INIT,
      syncer_config=SyncerConfig(min_quorum=2, use_grace=False),
      service_config=ServiceConfig(
        uplink_codec=uplink, downlink_codec="fp32", max_chunk_bytes=CHUNK, liveness_timeout_s=600
      ),
      layout_digest="L",
    )
    self.srv = serve(self.svc, token=TOKEN)
    self.client = SyncerClient(f"127.0.0.1:{self.srv.port}", token=TOKEN, max_chunk_bytes=CHUNK)
    self.client.wait_ready(10)
    self.client.register(0, layout_digest="L", num_fragments=1)
    self.held = self.pull()
    assert self.svc.core.open_round(0, 1) is not None

  def pull(self):
    return self.client.pull(
      0,
      0,
      -1,
      layout_keys=list(LAYOUT),
      shapes={k: s for k, (s, _) in LAYOUT.items()},
      dtypes={k: d for k, (_, d) in LAYOUT.items()},
    )

  def report(self, step: int, shift: float) -> Report:
    values = {k: v + np.float32(shift) for k, v in self.held.values.items()}
    return Report(
      learner_id=0,
      fragment=0,
      values=values,
      tokens=100,
      steps=2,
      anchor_version=0,
      step=step,
      round_step=1,
    )

  def frames(self, report: Report) -> list[bytes]:
    chunks = push_messages(report, "fp32", chunk_size=CHUNK, anchor_values=self.held.values)
    return [bulk_wire.LENGTH.pack(len(c)) + c for c in chunks]

  def filed(self) -> dict[str, np.ndarray] | None:
    """The values of learner 0's answer in the open round (δ), or None if it has none."""
    with self.svc.lock:
      entry = self.svc.core._rounds[0].entries.get(0)
    return None if entry is None else entry.report.values

  def send(self, data: bytes) -> tuple[grpc.StatusCode, str]:
    sock = socket.create_connection(("127.0.0.1", self.srv.bulk.port), timeout=10)
    with sock:
      sock.sendall(bulk_wire.hello(bulk_wire.OP_PUSH, TOKEN, self.client.session(0)) + data)
      sock.shutdown(socket.SHUT_WR)
      while True:
        (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(sock, 4))
        if n == bulk_wire.END:
          code, message, _ = bulk_wire.read_trailer(sock)
          return code, message
        bulk_wire.recv_exact(sock, n)

  def close(self) -> None:
    self.client.close()
    self.srv.stop(grace_s=0.5)


@pytest.fixture
def env():
  e = _Env()
  yield e
  e.close()


def test_a_push_received_in_place_files_exactly_what_was_sent(env):
  result = env.client.push(env.report(1, 0.25), "fp32", anchor_values=env.held.values)
  assert result.status == "accepted" and env.srv.bulk.calls["Push"] == 1
  want = env.held.values["a/w"] - (env.held.values["a/w"] + np.float32(0.25))
  np.testing.assert_array_equal(env.filed()["a/w"], want)
  assert env.svc.traffic()[0] == env.client.bytes_up


def test_a_bf16_push_is_filed_as_sent():
  """The bf16 uplink's δ is filed as the bfloat16 it was sent in (`chunks_to_report(as_sent=)`):
  its widening is the decoded δ, bit for bit."""
  env = _Env(uplink="bf16")
  try:
    report = env.report(1, 0.25)
    result = env.client.push(report, "bf16", anchor_values=env.held.values)
    assert result.status == "accepted" and env.srv.bulk.calls["Push"] == 1
    filed = env.filed()["a/w"]
    want = (env.held.values["a/w"] - report.values["a/w"]).astype(ml_dtypes.bfloat16)
    assert filed.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(filed.view(np.uint16), want.view(np.uint16))
  finally:
    env.close()


def test_an_answer_encoded_on_the_devices_goes_over_the_bulk_port_as_encoded(env):
  # A learner whose devices encode δ (learner/snapshot.py) hands the push only the encoding: no
  # θ on the host (values {}). The bulk port must send those bytes, not encode the values again.
  delta = np.full(INIT["a/w"].shape, np.float32(-0.125))
  encoded = {"a/w": (delta.reshape(-1).view(np.uint8), np.empty(0, np.float32))}
  report = dataclasses.replace(env.report(1, 0.0), values={})
  result = env.client.push(report, "fp32", anchor_values=env.held.values, encoded=encoded)
  assert result.status == "accepted" and env.srv.bulk.calls["Push"] == 1
  np.testing.assert_array_equal(env.filed()["a/w"], delta)
  assert env.svc.traffic()[0] == env.client.bytes_up


def test_a_stream_cut_inside_a_placed_chunk_is_refused_and_files_nothing(env):
  sent = env.frames(env.report(1, 0.25))
  code, message = env.send(b"".join(sent[:3]) + sent[3][:1000])  # Chunk 3: in place, cut.
  assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in message
  assert env.filed() is None and env.svc.refused() == {"INVALID_ARGUMENT": 1}
  result = env.client.push(env.report(2, 0.5), "fp32", anchor_values=env.held.values)
  assert result.status == "accepted"
  want = env.held.values["a/w"] - (env.held.values["a/w"] + np.float32(0.5))
  np.testing.assert_array_equal(env.filed()["a/w"], want)


def test_placed_chunks_then_one_too_many_is_refused_and_files_nothing(env):
  sent = env.frames(env.report(1, 0.25))
  extra = frames.chunk_prefix(len(sent), 8) + bytes(8)
  data = b"".join([*sent, bulk_wire.LENGTH.pack(len(extra)) + extra])
  code, message = env.send(data + bulk_wire.LENGTH.pack(bulk_wire.END))
  assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in message
  assert env.filed() is None and env.svc.refused() == {"INVALID_ARGUMENT": 1}


def test_a_frame_whose_length_disagrees_with_its_data_is_refused(env):
  sent = env.frames(env.report(1, 0.25))
  message = sent[2][4:]  # Chunk 2's message; its frame says one byte more, then a stray byte.
  bad = bulk_wire.LENGTH.pack(len(message) + 1) + message + b"\x00"
  code, text = env.send(b"".join([*sent[:2], bad, *sent[3:]]) + bulk_wire.LENGTH.pack(0xFFFFFFFF))
  assert code == grpc.StatusCode.INVALID_ARGUMENT and "Malformed chunk message" in text
  assert env.filed() is None and env.svc.refused() == {"INVALID_ARGUMENT": 1}


def test_a_pull_that_fails_mid_frame_is_cut_and_its_retry_is_served(env, monkeypatch):
  state_pieces = streams.state_messages.state_pieces

  def broken(state, codec, frame, **kw):
    yield frame(b"head", 100)
    yield b"only part of the frame"
    raise ValueError("encoder failed")

  monkeypatch.setattr(streams.state_messages, "state_pieces", broken)
  with pytest.raises(grpc.RpcError) as cut:  # A trailer would be read as the frame's bytes.
    env.pull()
  assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "broke" in cut.value.details()
  monkeypatch.setattr(streams.state_messages, "state_pieces", state_pieces)
  state = env.pull()  # The learner's retry, over the bulk port.
  assert state.version == 0 and state.digest == env.held.digest
  np.testing.assert_array_equal(state.values["a/w"], INIT["a/w"])
