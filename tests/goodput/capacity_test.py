"""The syncer capacity model against figures worked out by hand."""

import dataclasses
import json

import pytest

from ddiloco.goodput import bandwidth, capacity

COSTS = capacity.SyncerCosts(ingest_gbps=1.0, egress_gbps=2.0, merge_gbps=10.0, adopt_gbps=0.5)
BF16 = bandwidth.Wire(bits_per_value=16.0)
INT4 = bandwidth.Wire(bits_per_value=4.0, block_size=64, scale_bits=32.0)  # 4.5 bits.


def test_ingest_of_a_2b_fleet_is_what_the_arithmetic_says():
  """8 learners each push one 1/24 fragment of 2e9 bf16 values every step (P = H = 24):
  8 · 2e9 · 2 B / 24 per second = 1.333 GB/s."""
  load = capacity.SyncerLoad(params=2e9, learners=8, uplink=BF16, downlink=BF16)
  z = capacity.size_shard(load, COSTS)
  assert z.ingest_gbps == pytest.approx(8 * 2e9 * 2 / 24 / 1e9)
  assert z.egress_gbps == pytest.approx(z.ingest_gbps)
  half = capacity.size_shard(dataclasses.replace(load, shards=2), COSTS)
  assert half.ingest_gbps == pytest.approx(z.ingest_gbps / 2)


def test_memory_of_a_9b_float32_syncer():
  """keep_versions 4 · 36 GB + momentum 36 GB + 3 open rounds · 8 answers · 1.5 GB + base."""
  load = capacity.SyncerLoad(params=9e9, learners=8, base_bytes=1e9)
  z = capacity.size_shard(load, COSTS)
  fragment = 9e9 / 24 * 4
  assert z.ram_parts == pytest.approx(
    {"versions": 144e9, "optimizer": 36e9, "answers": 3 * 8 * fragment, "downlink": 0, "base": 1e9}
  )
  assert z.ram_bytes == pytest.approx(144e9 + 36e9 + 24 * fragment + 1e9)
  four = capacity.size_shard(dataclasses.replace(load, shards=4), COSTS)
  assert four.ram_parts["versions"] == pytest.approx(36e9)
  # Every shard holds its quarter slice of each of the 3 open rounds' answers.
  assert four.ram_parts["answers"] == pytest.approx(3 * 8 * fragment / 4)


def test_cores_and_latency():
  """One round per second of 8 answers of a 1e8-value float32 fragment: merge 3.2 GB at 10 GB/s
  = 0.32 s, adoption 0.4 GB at 0.5 GB/s = 0.8 s; the grace budget is τ · step = 2 s."""
  load = capacity.SyncerLoad(
    params=24e8, learners=8, uplink=INT4, downlink=INT4, lossy_downlink=True
  )
  z = capacity.size_shard(load, COSTS)
  assert z.merge_s == pytest.approx(0.32 + 0.8)
  assert z.grace_budget_s == 2.0 and z.in_budget
  traffic = 8 * 1e8 * 4.5 / 8 / 1e9  # GB/s each way.
  assert z.cores == pytest.approx(traffic / 1.0 + traffic / 2.0 + 1.12)
  assert z.ram_parts["downlink"] == pytest.approx(24e8 * 4.5 / 8)
  slow = dataclasses.replace(load, step_time_s=0.25)  # Budget 0.5 s < 1.12 s.
  assert not capacity.size_shard(slow, COSTS).in_budget
  # Shards merge their slices of a round side by side: 3 shards take 0.373 s each.
  assert not capacity.size_shard(dataclasses.replace(slow, shards=2), COSTS).in_budget
  three = capacity.size_shard(dataclasses.replace(slow, shards=3), COSTS)
  assert three.merge_s == pytest.approx(1.12 / 3) and three.in_budget
  wide = capacity.size_shard(dataclasses.replace(slow, merge_cores=4), COSTS)
  assert wide.merge_s == pytest.approx(1.12 / 4) and wide.in_budget


def test_fewest_shards_meets_the_limits():
  load = capacity.SyncerLoad(params=9e9, learners=8)
  best = capacity.fewest_shards(load, COSTS, max_cores=8, max_ram_bytes=64e9)
  assert best is not None and best.ram_bytes <= 64e9 and best.cores <= 8
  fewer = capacity.size_shard(dataclasses.replace(load, shards=best.shards - 1), COSTS)
  assert fewer.ram_bytes > 64e9 or fewer.cores > 8 or not fewer.in_budget
  assert capacity.fewest_shards(load, COSTS, max_cores=8, max_ram_bytes=1e9) is None


@pytest.mark.parametrize(
  ("field", "value"),
  [("params", 0), ("learners", 0), ("shards", 0), ("step_time_s", float("nan"))],
)
def test_bad_loads_are_refused(field, value):
  with pytest.raises(ValueError, match=field):
    capacity.SyncerLoad(**{"params": 1e9, "learners": 4, field: value})


def test_bad_costs_are_refused():
  with pytest.raises(ValueError, match="merge_gbps"):
    capacity.SyncerCosts(ingest_gbps=1, egress_gbps=1, merge_gbps=0, adopt_gbps=1)


def test_the_study_writes_its_figures(tmp_path, capsys):
  study = capacity.CapacityStudy(
    fleets=[("9B", capacity.SyncerLoad(params=9e9, learners=8))],
    costs=COSTS,
    max_cores=8,
    max_ram_gb=64,
  )
  out = capacity.run_capacity_study(study, str(tmp_path))
  saved = json.loads((tmp_path / "capacity.json").read_text())
  assert saved == json.loads(json.dumps(out))
  (fleet,) = saved["fleets"]
  assert fleet["given"]["shards"] == 1 and fleet["fewest_shards"]["shards"] > 1
  printed = capsys.readouterr().out
  assert "9B" in printed and "fewest shards that fit" in printed
