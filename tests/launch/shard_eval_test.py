"""Shard 0 of a sharded syncer evaluates the global model at version 0 from its own fragments and
the others' initial values, whatever the layout cuts: with S shards every fragment is sliced, and
large leaves are cut into pieces keyed "leaf@start:stop" (no socket: the service is not served)."""

import dataclasses
import math

import pytest

from ddiloco.launch import runtime
from ddiloco.launch.job import JobConfig
from ddiloco.models import configs
from tests.launch.runtime_test import JOB

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("shards", [2, 3])
def test_shard_zero_evaluates_version_zero_of_a_sliced_layout(tmp_path, shards):
  run_config = dataclasses.replace(
    JOB.run,
    model=configs.transformer_config(
      "tiny", vocab_size=256, max_len=8, num_layers=1, d_model=32, num_heads=2, head_dim=16,
      mlp_dim=1024,
    ),
  )  # fmt: skip
  job = JobConfig(run=run_config, syncer_shards=shards)
  addresses = tuple(f"127.0.0.1:{1000 + i}" for i in range(shards))
  run = runtime.SyncerRun(job, workdir=str(tmp_path / "shard0"), shard=0, shard_addresses=addresses)
  try:
    assert any("@" in k for frag in run.layout.fragments for k in frag)  # Leaves cut in pieces.
    whole = run.global_flat()
    assert set(whole) == set(run.layout.leaf_shapes)
    assert math.isfinite(run.evaluate())
    assert math.isnan(run.evaluate())  # The others' initial values are used once.
  finally:
    run.writer.close()
