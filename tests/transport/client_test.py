"""SyncerClient against a served syncer: pushes and pulls over its bulk port (pushes sent as they
are encoded, pulls decoded as they arrive), byte counts, a report that cannot be encoded midway,
and a bulk port that cannot be reached (one clear error, retried)."""

import logging
import socket

import grpc
import numpy as np
import pytest

from ddiloco.fragments.codec import RUN_VALUES
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, RoundRequest, SyncerConfig
from ddiloco.testing.wire import report_to_chunks, state_to_chunks
from ddiloco.transport.client import SyncerClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "t"
CHUNK = 1 << 16
# 2 runs of the encoder (RUN_VALUES float32 each) and a bit: 8 chunks of 64 KiB and a short one.
N = 2 * RUN_VALUES + 100
INIT = {"w": np.random.default_rng(0).standard_normal(N).astype(np.float32)}
SHAPES, DTYPES = {"w": (N,)}, {"w": np.float32}
ROUND = 3  # One fragment, τ = 2: the core's schedule has H = 3, so fragment 0 is due at step 3.


@pytest.fixture
def env():
  svc = make_syncer(
    fragment_keys=[["w"]],
    init_values=INIT,
    # min_quorum=2 with one learner: pushes file into the round and never merge.
    syncer_config=SyncerConfig(min_quorum=2, use_grace=False),
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
  client = SyncerClient(f"127.0.0.1:{srv.port}", token=TOKEN, max_chunk_bytes=CHUNK)
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


@pytest.mark.parametrize("anchor", [INIT, None], ids=["delta", "theta"])
def test_nan_found_midway_raises_and_files_nothing(env, anchor):
  svc, srv, client = env
  _pull(client)
  bad = {"w": INIT["w"].copy()}
  bad["w"][RUN_VALUES + 5] = np.nan  # In the second run of the encoder.
  with pytest.raises(ValueError, match="'w': Refusing to encode 1 non-finite value"):
    client.push(_report(bad), "fp32", anchor_values=anchor)
  # Sent in runs of 1 MiB: the encoder saw it before a byte left; the syncer saw nothing.
  status = svc.status()
  assert dict(status.refused) == {} and srv.bulk.calls["Push"] == 0
  # The round stays empty.
  assert status.counters["accepted"] == 0 and client.bytes_up == 0
  assert svc.core.stats()["open_rounds"] == 1 and svc.core._rounds[0].entries == {}
  good = client.push(_report({"w": INIT["w"] + 1}, step=2), "fp32", anchor_values=INIT)
  assert good.status == "accepted"  # The connection is fine afterwards.


def test_an_unreachable_bulk_port_fails_unavailable_naming_it_once_and_the_retry_passes(
  env, caplog
):
  """No other path: a push and a pull to a bulk port nobody listens on fail UNAVAILABLE (which
  the learner's threads retry with backoff, learner_process/retry.py), with the port and what to do in
  the message, logged once for the outage; once the port answers again, so do the calls."""
  svc, srv, client = env
  state = _pull(client)
  with socket.socket() as probe:  # A port nobody listens on.
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]
  svc.advertise_bulk(closed)
  client.register(0, layout_digest="D", num_fragments=1)  # Learns the dead port.
  assert client.bulk_port == closed
  theta = {"w": INIT["w"] - np.float32(0.5)}
  with caplog.at_level(logging.WARNING, logger="ddiloco.transport.client"):
    for call in (
      lambda: client.push(_report(theta), "fp32", anchor_values=state.values),
      lambda: _pull(client),
      lambda: _pull(client),
    ):
      with pytest.raises(grpc.RpcError) as info:
        call()
      assert info.value.code() == grpc.StatusCode.UNAVAILABLE
      assert f"Cannot reach the syncer's bulk port 127.0.0.1:{closed}" in info.value.details()
      assert "Pushes and pulls travel only over it" in info.value.details()
  warned = [r for r in caplog.records if "bulk port" in r.getMessage()]
  assert len(warned) == 1 and str(closed) in warned[0].getMessage()  # Once for the outage.
  assert srv.bulk.calls == {"Pull": 1} and client.bytes_up == 0  # The first pull, before.
  svc.advertise_bulk(srv.bulk.port)  # The syncer is back on its port.
  client.register(0, layout_digest="D", num_fragments=1)
  state = _pull(client)
  result = client.push(_report(theta), "fp32", anchor_values=state.values)
  assert result.status == "accepted" and srv.bulk.calls == {"Pull": 2, "Push": 1}


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
