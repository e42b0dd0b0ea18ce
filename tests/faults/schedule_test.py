"""Chaos schedules: determinism, causality, min_up, and the exact shape of each event kind."""

import dataclasses

import pytest

from ddiloco.faults import FaultEvent
from ddiloco.faults.schedule import KINDS, ChaosConfig, make_schedule

# Every fault process on, fast enough that a minute holds many of each.
BUSY = ChaosConfig(
  duration_s=60.0,
  learner_mtbf_s=3.0,
  restart_delay_s=(1.0, 6.0),
  min_up=2,
  slowdown_mtbf_s=6.0,
  slowdown_s=3.0,
  slowdown_fraction=0.5,
  slowdown_period_s=1.0,
  net_delay_mtbf_s=8.0,
  net_drop_mtbf_s=5.0,
  net_partition_mtbf_s=10.0,
  syncer_kill_times_s=(20.0, 40.0),
  syncer_restart_delay_s=4.0,
)


def _check_causal(events: list[FaultEvent], num_learners: int, min_up: int) -> None:
  """Replays the events on a state machine; fails on any impossible transition."""
  up, paused = set(range(num_learners)), set()
  syncer_up, delaying, partitioned = True, False, False
  assert [e.t for e in events] == sorted(e.t for e in events)
  for e in events:
    if e.kind == "kill_learner":
      assert e.learner in up and e.learner not in paused
      up.remove(e.learner)
      assert len(up) >= min_up
    elif e.kind == "start_learner":
      assert e.learner not in up
      up.add(e.learner)
    elif e.kind == "pause_learner":
      assert e.learner in up and e.learner not in paused
      paused.add(e.learner)
    elif e.kind == "resume_learner":
      paused.remove(e.learner)
    elif e.kind in ("kill_syncer", "start_syncer"):
      assert syncer_up == (e.kind == "kill_syncer")
      syncer_up = not syncer_up
    elif e.kind in ("net_delay", "net_clear"):
      assert delaying == (e.kind == "net_clear")
      delaying = not delaying
    elif e.kind in ("net_partition", "net_heal"):
      assert partitioned == (e.kind == "net_heal")
      partitioned = not partitioned
    elif e.kind == "net_drop":
      assert not partitioned
  # Everything that was broken was repaired.
  assert up == set(range(num_learners)) and not paused
  assert syncer_up and not delaying and not partitioned


def test_same_seed_same_schedule_other_seed_differs():
  a, b = make_schedule(BUSY, 4), make_schedule(BUSY, 4)
  assert a == b and len(a) > 50
  c = make_schedule(dataclasses.replace(BUSY, seed=1), 4)
  assert c != a


@pytest.mark.parametrize("seed", range(5))
def test_schedule_is_causal(seed):
  events = make_schedule(dataclasses.replace(BUSY, seed=seed), 4)
  _check_causal(events, 4, min_up=2)
  kinds = {e.kind for e in events}
  assert kinds == set(KINDS)  # This busy config exercises every kind.


def test_min_up_caps_concurrent_kills():
  # A kill every 0.2 s on average, 30 s of downtime each: without min_up the fleet would be empty.
  cfg = ChaosConfig(duration_s=30.0, learner_mtbf_s=0.2, restart_delay_s=30.0, min_up=3)
  events = make_schedule(cfg, 4)
  kills = [e for e in events if e.kind == "kill_learner"]
  assert len(kills) == 1  # 4 − 1 = 3 = min_up: no second kill until the first victim is back.
  _check_causal(events, 4, min_up=3)
  assert make_schedule(dataclasses.replace(cfg, min_up=4), 4) == []  # Nobody may ever go down.


def test_restart_follows_each_kill_by_its_delay():
  cfg = ChaosConfig(duration_s=50.0, learner_mtbf_s=4.0, restart_delay_s=2.5, min_up=0)
  events = make_schedule(cfg, 3)
  kills = [e for e in events if e.kind == "kill_learner"]
  assert kills
  for kill in kills:
    start = next(
      e for e in events if e.kind == "start_learner" and e.learner == kill.learner and e.t >= kill.t
    )
    assert start.t == round(kill.t + 2.5, 6)
    assert kill.params == {"restart_delay_s": 2.5}
  assert all(cfg.start_s <= k.t < cfg.duration_s for k in kills)


def test_uniform_restart_delay_within_range():
  cfg = dataclasses.replace(BUSY, restart_delay_s=(2.0, 3.0))
  delays = [e.params["restart_delay_s"] for e in make_schedule(cfg, 4) if e.kind == "kill_learner"]
  assert delays and all(2.0 <= d <= 3.0 for d in delays) and len(set(delays)) > 1


def test_poisson_rate():
  # Mean 1 s over 2000 s with no restart delay and min_up 0: 2000 arrivals expected, σ ≈ 45.
  # Deterministic for seed 0; the band is 5σ wide so the mean is what is checked.
  cfg = ChaosConfig(duration_s=2000.0, learner_mtbf_s=1.0, restart_delay_s=0.0, min_up=0)
  kills = [e for e in make_schedule(cfg, 2) if e.kind == "kill_learner"]
  assert 1775 < len(kills) < 2225


def test_streams_are_independent():
  # Turning the drop rate on does not move any kill: each process has its own RNG stream.
  base = ChaosConfig(duration_s=60.0, learner_mtbf_s=5.0, restart_delay_s=1.0, min_up=0)
  with_drops = dataclasses.replace(base, net_drop_mtbf_s=2.0)

  def learner_events(cfg):
    return [e for e in make_schedule(cfg, 4) if e.learner is not None]

  assert learner_events(base) == learner_events(with_drops)


def test_duty_cycled_slowdown_exact():
  # A slowdown window of 4 s at fraction 0.25 and period 1 s: four pauses of 0.25 s, one per
  # second; the window ends with the fourth resume at 3 + 0.25 = 3.25 s after its start.
  cfg = ChaosConfig(
    duration_s=20.0,
    slowdown_mtbf_s=4.0,
    slowdown_s=4.0,
    slowdown_fraction=0.25,
    slowdown_period_s=1.0,
  )
  events = make_schedule(cfg, 2)
  first = [e for e in events if e.kind == "pause_learner" and e.params["window"] == 0]
  assert len(first) == 4
  t0, learner = first[0].t, first[0].learner
  assert [p.t for p in first] == [round(t0 + k, 6) for k in range(4)]
  assert {p.learner for p in first} == {learner}
  resumes = [
    e
    for e in events
    if e.kind == "resume_learner" and e.learner == learner and t0 < e.t <= t0 + 3.25
  ]
  assert [r.t for r in resumes] == [round(t0 + k + 0.25, 6) for k in range(4)]
  assert first[0].params == {"window": 0, "fraction": 0.25, "window_s": 3.25, "pause_s": 0.25}
  windows = {e.params["window"] for e in events if e.kind == "pause_learner"}
  assert len(windows) > 1  # Several windows in 20 s at one per 4 s, numbered from 0.
  assert windows == set(range(len(windows)))


def test_plain_pause_is_one_pair():
  cfg = ChaosConfig(duration_s=30.0, slowdown_mtbf_s=5.0, slowdown_s=2.0, slowdown_fraction=1.0)
  events = make_schedule(cfg, 3)
  pauses = [e for e in events if e.kind == "pause_learner"]
  assert pauses
  for p in pauses:
    resume = next(
      e for e in events if e.kind == "resume_learner" and e.learner == p.learner and e.t > p.t
    )
    assert resume.t == round(p.t + 2.0, 6)
    assert p.params["pause_s"] == 2.0 and p.params["window_s"] == 2.0
  assert [p.params["window"] for p in pauses] == list(range(len(pauses)))


def test_syncer_kills_and_network_windows_exact():
  cfg = ChaosConfig(
    duration_s=100.0,
    syncer_kill_times_s=(10.0, 30.0),
    syncer_restart_delay_s=5.0,
    net_partition_mtbf_s=20.0,
    net_partition_s=3.0,
    net_partition_mode="reset",
    net_delay_mtbf_s=20.0,
    net_delay_s=4.0,
    net_latency_s=0.25,
  )
  events = make_schedule(cfg, 2)
  syncer = [(e.t, e.kind) for e in events if "syncer" in e.kind]
  assert syncer == [
    (10.0, "kill_syncer"),
    (15.0, "start_syncer"),
    (30.0, "kill_syncer"),
    (35.0, "start_syncer"),
  ]
  parts = [e for e in events if e.kind == "net_partition"]
  heals = [e for e in events if e.kind == "net_heal"]
  assert parts and [h.t for h in heals] == [round(p.t + 3.0, 6) for p in parts]
  assert parts[0].params == {"duration_s": 3.0, "mode": "reset"}
  delays = [e for e in events if e.kind == "net_delay"]
  clears = [e for e in events if e.kind == "net_clear"]
  assert delays and [c.t for c in clears] == [round(d.t + 4.0, 6) for d in delays]
  assert delays[0].params == {"latency_s": 0.25}
  assert all(e.shard is None for e in events)  # Every shard: the whole syncer, every connection.


def test_syncer_kills_and_network_faults_aimed_at_one_shard():
  cfg = ChaosConfig(
    duration_s=100.0,
    syncer_kill_times_s=(10.0, 30.0),
    syncer_kill_shards=(1, 0),
    syncer_restart_delay_s=5.0,
    net_drop_mtbf_s=10.0,
    net_delay_mtbf_s=20.0,
    net_shard=1,
  )
  events = make_schedule(cfg, 2, num_shards=2)
  syncer = [(e.t, e.kind, e.shard) for e in events if "syncer" in e.kind]
  # Each restart brings back the shard its kill took down.
  assert syncer == [
    (10.0, "kill_syncer", 1),
    (15.0, "start_syncer", 1),
    (30.0, "kill_syncer", 0),
    (35.0, "start_syncer", 0),
  ]
  net = [e for e in events if e.kind.startswith("net_")]
  assert {e.kind for e in net} == {"net_drop", "net_delay", "net_clear"}
  assert all(e.shard == 1 for e in net)
  # The shards change nothing else: the same arrivals as the schedule aimed at every shard.
  whole = make_schedule(dataclasses.replace(cfg, syncer_kill_shards=(), net_shard=None), 2)
  assert [dataclasses.replace(e, shard=None) for e in events] == whole


def test_shards_must_be_the_syncers():
  cfg = ChaosConfig(syncer_kill_times_s=(10.0,), syncer_kill_shards=(1,))
  with pytest.raises(ValueError, match=r"shards \[1\]; the syncer has 1"):
    make_schedule(cfg, 2)  # An unsharded syncer is shard 0 only.
  assert make_schedule(cfg, 2, num_shards=2)[0].shard == 1
  with pytest.raises(ValueError, match="syncer has 2"):
    make_schedule(ChaosConfig(net_shard=2), 2, num_shards=2)


def test_nothing_before_start_s():
  cfg = dataclasses.replace(BUSY, start_s=15.0, syncer_kill_times_s=(20.0,))
  events = make_schedule(cfg, 4)
  assert events and min(e.t for e in events) >= 15.0


@pytest.mark.parametrize(
  "bad",
  [
    {"duration_s": -1.0},
    {"start_s": 10.0, "duration_s": 5.0},
    {"learner_mtbf_s": -1.0},
    {"restart_delay_s": (5.0, 1.0)},
    {"restart_delay_s": -1.0},
    {"slowdown_fraction": 0.0},
    {"slowdown_fraction": 1.5},
    {"min_up": -1},
    {"net_partition_mode": "blackhole"},
    {"syncer_kill_times_s": (10.0, 12.0), "syncer_restart_delay_s": 5.0},
    {"syncer_kill_times_s": (10.0, 20.0), "syncer_kill_shards": (1,)},  # One per kill.
    {"syncer_kill_times_s": (10.0,), "syncer_kill_shards": (-1,)},
    {"net_shard": -1},
    {"max_gap_s": 0.0},
  ],
)
def test_config_validation(bad):
  with pytest.raises(ValueError):
    ChaosConfig(**bad)


def test_schedule_arguments_validated():
  with pytest.raises(ValueError, match="min_up"):
    make_schedule(ChaosConfig(min_up=5), 4)
  with pytest.raises(ValueError):
    make_schedule(ChaosConfig(), 0)


def test_gin_binds_the_config():
  from ddiloco.launch import configurables

  try:
    configurables.parse(
      [],
      [
        "ddiloco.ChaosConfig.learner_mtbf_s = 7.0",
        "ChaosConfig.syncer_kill_times_s = (5.0,)",
        "ChaosConfig.syncer_kill_shards = (1,)",
      ],
    )
    cfg = configurables.configured(ChaosConfig)()
    assert (cfg.learner_mtbf_s, cfg.syncer_kill_times_s) == (7.0, (5.0,))
    assert cfg.syncer_kill_shards == (1,)
  finally:
    configurables.clear()


def test_all_kinds_are_distinct():
  assert len(set(KINDS)) == len(KINDS) == 11
