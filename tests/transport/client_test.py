"""SyncerClient against a served syncer: pushes streamed as raw chunk messages, pulls decoded as
they arrive, byte counts, and a report that cannot be encoded midway."""

import grpc
import numpy as np
import pytest

from ddiloco.distributed.server import make_syncer, serve
from ddiloco.distributed.service_config import ServiceConfig
from ddiloco.fragments.codec import RUN_VALUES
from ddiloco.syncer.core import Report, RoundRequest, SyncerConfig
from ddiloco.testing.wire import report_to_chunks, state_to_chunks
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "t"
CHUNK = 1 << 16
# 2 runs of the encoder (RUN_VALUES float32 each) and a bit: 8 chunks of 64 KiB and a short one.
N = 2 * RUN_VALUES + 100
INIT = {"w": np.random.default_rng(0).standard_normal(N).astype(np.float32)}
SHAPES, DTYPES = {"w": (N,)}, {"w": np.float32}
ROUND = 3  # One fragment, τ = 2: the core's schedule has H = 3, so fragment 0 is due at step 3.


@pytest.fixture(params=[True, False], ids=["bulk", "grpc"])
def env_both(request):
  """`env`'s syncer, the client pushing over the bulk port or over gRPC alone."""
  yield from _env(bulk=request.param)


@pytest.fixture
def env():
  yield from _env(bulk=True)


def _env(*, bulk: bool):
  svc = make_syncer(
    fragment_keys=[["w"]],
    init_values=INIT,
    # min_quorum=2 with one learner: pushes file into the round and never merge.
    syncer_config=SyncerConfig(min_quorum=2, use_grace=False),
    # The bulk port in gRPC's chunk size: the byte counts below hold over both.
    service_config=ServiceConfig(
      uplink_codec="fp32",
      downlink_codec="fp32",
      max_chunk_bytes=CHUNK,
      bulk_chunk_bytes=CHUNK,
      liveness_timeout_s=600.0,
    ),
    layout_digest="D",
  )
  srv = serve(svc, token=TOKEN)
  client = SyncerClient(f"127.0.0.1:{srv.port}", token=TOKEN, max_chunk_bytes=CHUNK, bulk=bulk)
  client.wait_ready(10)
  client.register(0, layout_digest="D", num_fragments=1)
  with svc.lock:
    assert svc.core.open_round(0, ROUND) == RoundRequest(0, ROUND, 0)
  yield svc, srv, client
  client.close()
  srv.stop(grace_s=0.5)


def _pull(client, known=-1):
  return client.pull(0, 0, known, layout_keys=["w"], shapes=SHAPES, dtypes=DTYPES)


def _report(values, step=1):
  return Report(
    learner_id=0,
    fragment=0,
    values=values,
    tokens=64,
    steps=2,
    anchor_version=0,
    step=step,
    round_step=ROUND,
  )


def test_pull_then_delta_push_are_filed_exactly(env):
  svc, _, client = env
  state = _pull(client)
  assert state.version == 0 and state.values["w"].tobytes() == INIT["w"].tobytes()
  assert _pull(client, known=0) is None  # Already the newest: an empty stream.
  # 10 + 35 + 8 + 4 N bytes = 524741 of payload: 9 chunks; their messages add the framing.
  pull_bytes = sum(c.ByteSize() for c in state_to_chunks(state, "fp32", chunk_size=CHUNK))
  assert client.bytes_down == pull_bytes
  theta = {"w": INIT["w"] - np.float32(0.5)}
  result = client.push(_report(theta), "fp32", anchor_values=state.values)
  assert (result.status, result.weight) == ("accepted", 64**2 / 2)
  sent = report_to_chunks(_report(theta), "fp32", chunk_size=CHUNK, anchor_values=INIT)
  assert len(sent) == 9 and client.bytes_up == sum(c.ByteSize() for c in sent)
  assert svc.traffic() == (client.bytes_up, client.bytes_down)
  assert svc.core.stats()["open_rounds"] == 1


def test_generated_stub_still_pushes_protobuf_messages(env):
  # The service takes raw bytes for Push; protobuf clients send the same bytes.
  svc, srv, client = env
  _pull(client)
  chunks = report_to_chunks(
    _report({"w": INIT["w"] + 1}), "fp32", chunk_size=CHUNK, anchor_values=INIT
  )
  with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
    stub = syncer_pb2_grpc.SyncerStub(channel)
    resp = stub.Push(iter(chunks), timeout=10, metadata=client.learner_metadata(0))
  assert isinstance(resp, syncer_pb2.PushResponse) and resp.status == "accepted"
  assert svc.status().counters["accepted"] == 1


@pytest.mark.parametrize("anchor", [INIT, None], ids=["delta", "theta"])
def test_nan_found_midway_raises_and_files_nothing(env_both, anchor):
  svc, srv, client = env_both
  _pull(client)
  bad = {"w": INIT["w"].copy()}
  bad["w"][RUN_VALUES + 5] = np.nan  # gRPC: the second run, after 4 chunks were sent.
  with pytest.raises(ValueError, match="'w': Refusing to encode 1 non-finite value"):
    client.push(_report(bad), "fp32", anchor_values=anchor)
  status = svc.status()
  if client.bulk_port is None:  # The short stream is refused as incomplete at the door.
    assert dict(status.refused) == {"INVALID_ARGUMENT": 1}
  else:  # Sent in runs of 1 MiB: the encoder saw it before a byte left; the syncer saw nothing.
    assert dict(status.refused) == {} and srv.bulk.calls["Push"] == 0
  # The round stays empty.
  assert status.counters["accepted"] == 0 and client.bytes_up == 0
  assert svc.core.stats()["open_rounds"] == 1 and svc.core._rounds[0].entries == {}
  good = client.push(_report({"w": INIT["w"] + 1}, step=2), "fp32", anchor_values=INIT)
  assert good.status == "accepted"  # The channel is fine afterwards.


def test_superseded_push_memory_is_recycled_and_filed_values_are_intact(env):
  """Decoded pushes go into recycled buffers (chunks.ArrayPool); a buffer comes back
  only when the core dropped the report that held it."""
  svc, _, client = env
  pool = svc._streams.pool
  thetas = [{"w": INIT["w"] - np.float32(0.25 * (s + 1))} for s in range(3)]
  for s, theta in enumerate(thetas):
    if s:  # A restarted learner (a new registration) may answer the round again, once per life.
      client.register(0, layout_digest="D", num_fragments=1)
    state = _pull(client)  # After a registration its answers weigh 0 until it has pulled.
    result = client.push(_report(theta, step=s + 1), "fp32", anchor_values=state.values)
    assert (result.status, result.weight) == ("superseded" if s else "accepted", 64**2 / 2)
  # Push 1 took a fresh buffer; push 2 too (push 1's report was still in the round while it was
  # decoded); push 2 superseded push 1, so push 3 reused push 1's buffer.
  assert pool.reused == 1
  assert pool.free_bytes == 4 * N  # Push 2's buffer, back once push 3 superseded it.
  held = svc.core.stats()
  assert (held["accepted"], held["superseded"], held["open_rounds"]) == (1, 2, 1)
  # What the round holds is push 3's outer gradient Θ^(anchor) − θ exactly (fp32): the recycled
  # memory was not touched since.
  (entry,) = svc.core._rounds[0].entries.values()
  assert entry.report.outer_gradient
  assert entry.report.values["w"].tobytes() == (state.values["w"] - thetas[2]["w"]).tobytes()


def test_rounds_stream_yields_round_requests_and_versions_until_cancelled(env):
  svc, srv, client = env
  stream = client.rounds(0)
  events = iter(stream)
  # The open round, then the fragment's current version.
  assert [next(events), next(events)] == [RoundRequest(0, ROUND, 0), (0, 0)]
  stream.cancel()
  with pytest.raises(grpc.RpcError) as info:
    next(events)
  assert info.value.code() == grpc.StatusCode.CANCELLED
  # A subscription ends at its deadline: the learner subscribes again (and misses nothing).
  short = SyncerClient(f"127.0.0.1:{srv.port}", token=TOKEN, subscription_s=0.5)
  try:
    short.register(0, layout_digest="D", num_fragments=1)  # Its own session for learner 0.
    events = iter(short.rounds(0))
    assert [next(events), next(events)] == [RoundRequest(0, ROUND, 0), (0, 0)]
    with pytest.raises(grpc.RpcError) as info:
      next(events)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  finally:
    short.close()
  assert svc.refused() == {}
