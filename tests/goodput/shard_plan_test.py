"""Planning shards from measured per-shard figures (capacity.plan_shards), against hand arithmetic."""

import json
import math

import pytest

from ddiloco.goodput import bandwidth, capacity

BF16 = bandwidth.Wire(bits_per_value=16.0)
# 0.2 wire GB per shard CPU-second; a round's merge at 2 GB/s; 24 B of RSS per parameter held at
# keep_versions = 4 on a 0.5 GB base.
SHARD = capacity.MeasuredShard(
  ingest_gbps_per_core=0.2, merge_gbps=2.0, rss_bytes_per_param=24.0, rss_base_bytes=0.5e9
)


def _load(params: float, **kw) -> capacity.SyncerLoad:
  return capacity.SyncerLoad(params=params, learners=8, uplink=BF16, downlink=BF16, **kw)


def test_a_2b_fleet_needs_8_shards_of_one_core():
  """Fleet ingest 8 · 2e9 · 2 B / 24 per 1 s step = 1.333 GB/s = 6.667 cores at 0.2 GB/s.
  The busiest shard holds ceil(24 / S) of 24 fragments: S = 7 gives 4/24 · 6.667 = 1.11 cores
  (> 1), S = 8 gives 3/24 · 6.667 = 0.833. RAM: 0.5e9 + 2e9 · 3/24 · 24 B = 6.5e9. Merge:
  8 answers · 2e9/24 values · 4 B / 2 GB/s = 1.333 s, within τ · step = 2 s."""
  z = capacity.plan_shards(_load(2e9), SHARD)
  assert (z.shards, z.limited_by, z.fits) == (8, "cores", True)
  assert z.cores == pytest.approx(6.6667 * 3 / 24, rel=1e-4)
  assert z.ingest_gbps == pytest.approx(1.3333 / 8, rel=1e-4)
  assert z.ram_bytes == pytest.approx(6.5e9)
  assert z.merge_s == pytest.approx(1.3333, rel=1e-4)
  # The round's 8 bf16 answers, 8 · 2e9/24 · 2 B = 1.333 GB, reach one shard at 0.2 GB/s: 6.667 s,
  # then its merge: 8 s in all, over the 2 s budget whatever S is.
  assert z.round_s == pytest.approx(6.6667 + 1.3333, rel=1e-4)
  assert z.grace_budget_s == 2.0 and not z.in_budget


def test_a_round_within_its_budget():
  """1e8 parameters, 4 s steps: a round is 8 · 1e8/24 · 2 B = 66.7 MB in at 0.2 GB/s = 0.333 s,
  plus 8 · 1e8/24 · 4 B = 133 MB merged at 2 GB/s = 0.0667 s: 0.4 s, within τ · 4 s = 8 s."""
  z = capacity.plan_shards(_load(1e8, step_time_s=4.0), SHARD)
  assert z.round_s == pytest.approx(0.4, rel=1e-4)
  assert z.in_budget


def test_uneven_split_is_sized_by_the_busiest_shard():
  """With 1.5 cores a shard: ceil(24 / S) · 6.667 / 24 <= 1.5 needs ceil(24 / S) <= 5, so S = 5
  (fragments 5, 5, 5, 5, 4): the busiest shard needs 5/24 · 6.667 = 1.389 cores."""
  z = capacity.plan_shards(_load(2e9), SHARD, max_cores=1.5)
  assert z.shards == 5
  assert z.cores == pytest.approx(6.6667 * 5 / 24, rel=1e-4)


def test_a_small_fleet_fits_one_shard():
  """0.1e9 parameters: 0.0667 GB/s = 0.333 cores; RAM 0.5e9 + 2.4e9."""
  z = capacity.plan_shards(_load(1e8), SHARD)
  assert (z.shards, z.limited_by) == (1, "one shard")
  assert z.ram_bytes == pytest.approx(2.9e9)


def test_memory_sets_the_shards_and_keep_versions_scales_it():
  """Ingest is free here (1000 GB/s a core). 9e9 params at 24 B: S = 3 holds 8/24 of them,
  1e9 + 3e9 · 24 = 73e9 > 60e9; S = 4 holds 6/24: 1e9 + 2.25e9 · 24 = 55e9. With keep_versions 2
  instead of the measured 4, each parameter holds 2 float32 copies less: 16 B, and S = 3 fits
  (1e9 + 3e9 · 16 = 49e9) where S = 2 does not (1e9 + 4.5e9 · 16 = 73e9)."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=1000.0, merge_gbps=100.0, rss_bytes_per_param=24.0, rss_base_bytes=1e9
  )
  z = capacity.plan_shards(_load(9e9), shard, max_ram_bytes=60e9)
  assert (z.shards, z.limited_by, z.ram_bytes) == (4, "ram", pytest.approx(55e9))
  z2 = capacity.plan_shards(_load(9e9, keep_versions=2), shard, max_ram_bytes=60e9)
  assert (z2.shards, z2.ram_bytes) == (3, pytest.approx(49e9))


def test_egress_counts_when_measured():
  """Pulls of the bf16 downlink: 1.333 GB/s at 0.5 GB/s a core adds 2.667 cores to 6.667."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=0.2,
    merge_gbps=2.0,
    rss_bytes_per_param=24.0,
    rss_base_bytes=0.5e9,
    egress_gbps_per_core=0.5,
  )
  z = capacity.plan_shards(_load(2e9), shard, max_cores=100)
  assert (z.shards, z.cores) == (1, pytest.approx(6.6667 + 2.6667, rel=1e-4))


def test_a_fleet_no_s_can_carry_is_flagged():
  """9e9 bf16 at 0.01 GB/s a core: 6 GB/s = 600 cores; even S = P = 24 leaves 25 cores a shard."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=0.01, merge_gbps=2.0, rss_bytes_per_param=24.0, rss_base_bytes=0.0
  )
  z = capacity.plan_shards(_load(9e9), shard)
  assert (z.shards, z.fits, z.limited_by) == (24, False, "cores")
  assert z.cores == pytest.approx(25.0)


@pytest.mark.parametrize(
  ("field", "value"),
  [
    ("ingest_gbps_per_core", 0.0),
    ("merge_gbps", math.nan),
    ("rss_bytes_per_param", -1.0),
    ("rss_base_bytes", math.inf),
    ("egress_gbps_per_core", 0.0),
    ("keep_versions", 0),
  ],
)
def test_bad_measurements_are_refused(field, value):
  args = {
    "ingest_gbps_per_core": 0.2,
    "merge_gbps": 2.0,
    "rss_bytes_per_param": 24.0,
    "rss_base_bytes": 0.5e9,
    field: value,
  }
  with pytest.raises(ValueError, match=field):
    capacity.MeasuredShard(**args)


def test_the_study_plans_from_measurements(tmp_path, capsys):
  costs = capacity.SyncerCosts(ingest_gbps=1.0, egress_gbps=1.0, merge_gbps=10.0, adopt_gbps=1.0)
  study = capacity.CapacityStudy(
    fleets=[("2B", _load(2e9))], costs=costs, measured=SHARD, max_ram_gb=128
  )
  capacity.run_capacity_study(study, str(tmp_path))
  saved = json.loads((tmp_path / "capacity.json").read_text())
  (plan,) = saved["measured_plans"]
  assert (plan["fleet"], plan["shards"]) == ("2B", 8)
  assert saved["measured"]["ingest_gbps_per_core"] == 0.2
  assert "From measured shards" in capsys.readouterr().out
