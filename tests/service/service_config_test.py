"""`ServiceConfig` refuses at start what cannot work later: here, bulk chunks smaller than the
chunks a lossy downlink's deltas are cut in (the bulk port's learners would refuse every such pull
and fall back to full fp32 pulls). The combinations it accepts pull a new version's delta over the
bulk port, end to end.

Fragment 0 = {"a/w": f32[128, 64]} (32 KiB): several chunks of either size.
"""

import time

import numpy as np
import pytest

from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, SyncerConfig
from ddiloco.transport.client import SyncerClient, fragment_layouts

pytestmark = pytest.mark.timeout(60)

TOKEN = "tok"
FRAGMENTS = [["a/w"]]
INIT = {"a/w": np.random.default_rng(0).normal(size=(128, 64)).astype(np.float32)}
LAYOUT = fragment_layouts(FRAGMENTS, INIT)[0]
PULL = {
  "layout_keys": list(LAYOUT),
  "shapes": {k: s for k, (s, _) in LAYOUT.items()},
  "dtypes": {k: d for k, (_, d) in LAYOUT.items()},
}


@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_bulk_chunks_below_a_lossy_downlinks_chunks_are_refused(codec):
  with pytest.raises(ValueError, match="bulk_chunk_bytes=4096 is below max_chunk_bytes=8192"):
    ServiceConfig(downlink_codec=codec, max_chunk_bytes=8192, bulk_chunk_bytes=4096)
  # With an exact downlink (pulls cut in the port's size), it works.
  ServiceConfig(downlink_codec="fp32", max_chunk_bytes=8192, bulk_chunk_bytes=4096)


@pytest.mark.parametrize(
  "codec, max_chunk, bulk_chunk",
  [("int8", 8192, 8192), ("int8", 4096, 8192), ("fp32", 8192, 4096)],
)
@pytest.mark.integration
def test_a_new_version_is_pulled_as_a_delta_over_the_bulk_port(codec, max_chunk, bulk_chunk):
  svc = make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=SyncerConfig(min_quorum=1, use_grace=False),
    service_config=ServiceConfig(
      uplink_codec="fp32",
      downlink_codec=codec,
      max_chunk_bytes=max_chunk,
      bulk_chunk_bytes=bulk_chunk,
      liveness_timeout_s=600,
    ),
    layout_digest="L",
  )
  srv = serve(svc, token=TOKEN)
  client = SyncerClient(f"127.0.0.1:{srv.port}", token=TOKEN, max_chunk_bytes=max_chunk)
  try:
    client.wait_ready(10)
    client.register(0, layout_digest="L", num_fragments=1)
    held = client.pull(0, 0, -1, **PULL)
    with svc.lock:
      assert svc.core.open_round(0, 1) is not None
    values = {k: v + np.float32(0.25) for k, v in held.values.items()}
    report = Report(
      learner_id=0,
      fragment=0,
      values=values,
      tokens=100,
      steps=2,
      anchor_version=0,
      step=1,
      round_step=1,
    )
    assert client.push(report, "fp32", anchor_values=held.values).status == "accepted"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
      with svc.lock:
        if svc.core.state(0).version == 1:
          want = svc.core.state(0)
          break
      time.sleep(0.02)
    else:
      pytest.fail("no merge")
    state = client.pull(0, 0, 0, base_lookup=lambda v: held.values, **PULL)
    assert srv.bulk.calls["Pull"] == 2
    assert state.version == 1 and state.digest == want.digest
    np.testing.assert_array_equal(state.values["a/w"], want.values["a/w"])
  finally:
    client.close()
    srv.stop(grace_s=0.5)
