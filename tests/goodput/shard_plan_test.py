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


def test_a_2b_fleet_needs_7_shards_of_one_core():
  """Fleet ingest 8 · 2e9 · 2 B / 24 per 1 s step = 1.333 GB/s = 6.667 cores at 0.2 GB/s. Each
  shard takes 1/S of it: S = 6 gives 1.11 cores (> 1), S = 7 gives 0.952. RAM: 0.5e9 + 2e9 / 7 ·
  24 B. A round is 8 · 2e9/24 · 2 B = 1.333 GB in at 0.2 GB/s (6.667 s) and 8 · 2e9/24 · 4 B
  merged at 2 GB/s (1.333 s): 8 s of one shard's work, split over the 7 shards' slices: 1.143 s,
  within τ · step = 2 s."""
  z = capacity.plan_shards(_load(2e9), SHARD)
  assert (z.shards, z.hosts, z.limited_by, z.fits) == (7, 1, "cores", True)
  assert z.cores == pytest.approx(6.6667 / 7, rel=1e-4)
  assert z.ingest_gbps == pytest.approx(1.3333 / 7, rel=1e-4)
  assert z.ram_bytes == pytest.approx(0.5e9 + 2e9 / 7 * 24)
  assert z.merge_s == pytest.approx(1.3333 / 7, rel=1e-4)
  assert z.round_s == pytest.approx(8.0 / 7, rel=1e-4)
  assert z.grace_budget_s == 2.0 and z.in_budget


def test_a_round_within_its_budget():
  """1e8 parameters, 4 s steps: a round is 8 · 1e8/24 · 2 B = 66.7 MB in at 0.2 GB/s = 0.333 s,
  plus 8 · 1e8/24 · 4 B = 133 MB merged at 2 GB/s = 0.0667 s: 0.4 s, within τ · 4 s = 8 s."""
  z = capacity.plan_shards(_load(1e8, step_time_s=4.0), SHARD)
  assert z.shards == 1 and z.round_s == pytest.approx(0.4, rel=1e-4)
  assert z.in_budget


def test_the_round_budget_sets_the_shards():
  """Ingest nearly free (100 GB/s a core), a slow merge (0.5 GB/s): a 2e9 round is 8 · 2e9/24 ·
  4 B = 2.667 GB merged in 5.333 s plus 1.333 GB in at 100 GB/s (0.0133 s): 5.35 s of work, over
  the 2 s budget on one shard and on two (2.67 s); three shards' slices take 1.78 s each."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=100.0, merge_gbps=0.5, rss_bytes_per_param=24.0, rss_base_bytes=0.5e9
  )
  z = capacity.plan_shards(_load(2e9), shard)
  assert (z.shards, z.limited_by) == (3, "round")
  assert z.round_s == pytest.approx((5.3333 + 0.013333) / 3, rel=1e-4)


def test_more_cores_a_shard_fewer_shards_and_hosts_by_their_width():
  """With 1.5 cores a shard: 6.667 / S <= 1.5 needs S = 5 (1.333 cores; S = 4: 1.667); the round
  is 8 / 5 = 1.6 s. A 16-core host holds 10 shards of 1.5 cores: one host."""
  z = capacity.plan_shards(_load(2e9), SHARD, max_cores=1.5)
  assert (z.shards, z.hosts) == (5, 1)
  assert z.cores == pytest.approx(6.6667 / 5, rel=1e-4)
  assert capacity.plan_shards(_load(2e9), SHARD, cores_per_host=4).hosts == 2  # 7 shards, 4 a host.


def test_a_small_fleet_fits_one_shard():
  """0.1e9 parameters: 0.0667 GB/s = 0.333 cores; RAM 0.5e9 + 2.4e9."""
  z = capacity.plan_shards(_load(1e8), SHARD)
  assert (z.shards, z.limited_by) == (1, "one shard")
  assert z.ram_bytes == pytest.approx(2.9e9)


def test_memory_sets_the_shards_and_keep_versions_scales_it():
  """Ingest is free here (1000 GB/s a core). 9e9 params at 24 B: S = 3 holds a third of them,
  1e9 + 3e9 · 24 = 73e9 > 60e9; S = 4: 1e9 + 2.25e9 · 24 = 55e9. With keep_versions 2 instead
  of the measured 4, each parameter holds 2 float32 copies less: 16 B, and S = 3 fits
  (1e9 + 3e9 · 16 = 49e9) where S = 2 does not (1e9 + 4.5e9 · 16 = 73e9)."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=1000.0, merge_gbps=100.0, rss_bytes_per_param=24.0, rss_base_bytes=1e9
  )
  z = capacity.plan_shards(_load(9e9), shard, max_ram_bytes=60e9)
  assert (z.shards, z.limited_by, z.ram_bytes) == (4, "ram", pytest.approx(55e9))
  z2 = capacity.plan_shards(_load(9e9, keep_versions=2), shard, max_ram_bytes=60e9)
  assert (z2.shards, z2.ram_bytes) == (3, pytest.approx(49e9))


def test_egress_counts_when_measured():
  """Pulls of the bf16 downlink: 1.333 GB/s at 0.5 GB/s a core adds 2.667 cores to 6.667, which
  one shard of 100 cores carries; its round (8 s of work) then needs 4 shards' slices."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=0.2,
    merge_gbps=2.0,
    rss_bytes_per_param=24.0,
    rss_base_bytes=0.5e9,
    egress_gbps_per_core=0.5,
  )
  z = capacity.plan_shards(_load(2e9), shard, max_cores=100)
  assert (z.shards, z.limited_by) == (4, "round")
  assert z.cores == pytest.approx((6.6667 + 2.6667) / 4, rel=1e-4)


def test_a_fleet_no_s_can_carry_is_flagged():
  """9e9 bf16 at 0.01 GB/s a core: 6 GB/s = 600 cores; even 256 shards leave 2.34 cores each."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=0.01, merge_gbps=2.0, rss_bytes_per_param=24.0, rss_base_bytes=0.0
  )
  z = capacity.plan_shards(_load(9e9), shard)
  assert (z.shards, z.fits, z.limited_by) == (256, False, "cores")
  assert z.cores == pytest.approx(600 / 256)


def test_the_papers_setting_on_one_host_each_from_the_measured_shard():
  """The measured shard (0.399 GB/s a core, merge 2.34 GB/s, 58 B a parameter on 0.27 GB):
  5B is 3.33 GB/s = 8.35 cores, 9 shards, a round of 8.35 + 2.85 s of work in 1.24 s; 9B is
  6 GB/s = 15.0 cores, 16 shards, 1.26 s. Both on one host of 16 cores."""
  shard = capacity.MeasuredShard(
    ingest_gbps_per_core=0.399, merge_gbps=2.34, rss_bytes_per_param=58.0, rss_base_bytes=0.27e9
  )
  five, nine = (capacity.plan_shards(_load(n), shard, max_ram_bytes=128e9) for n in (5e9, 9e9))
  assert (five.shards, five.hosts, nine.shards, nine.hosts) == (9, 1, 16, 1)
  assert five.in_budget and nine.in_budget
  assert five.round_s == pytest.approx((8.354 + 2.849) / 9, rel=1e-3)


def test_bad_plan_limits_are_refused():
  for kw in ({"max_shards": 0}, {"cores_per_host": 0}, {"max_cores": 0.0}):
    with pytest.raises(ValueError, match="max_shards >= 1"):
      capacity.plan_shards(_load(1e8), SHARD, **kw)


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
  assert (plan["fleet"], plan["shards"], plan["hosts"]) == ("2B", 7, 1)
  assert saved["measured"]["ingest_gbps_per_core"] == 0.2
  assert "From measured shards" in capsys.readouterr().out
