"""Replay of a hand-written tape: the fault strings by hand, then a short run on sim_tiny.gin."""

import json
import os

import pytest

from ddiloco.chaos import replay
from ddiloco.faults import parse_faults
from ddiloco.metrics.writer import read_events

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "gin_configs"))

# A real run with 0.5 s steps, its fleet started at t = 10.5 on the driver's clock (the first
# learner_up). With the simulator's 1.0 s steps the scale is 1.0 / 0.5 = 2 virtual seconds per real
# second: virtual = 2 (t − 10.5).
TAPE = [
  {"t": 10.0, "kind": "run_start"},
  {"t": 10.5, "kind": "learner_up", "learner": 0},
  # Learner 2 down from t = 11 to 13 → virtual 1 to 5: crash:2@1+4.
  {"t": 11.0, "kind": "kill_learner", "learner": 2, "restart_delay_s": 2.0},
  # A plain pause of 0.5 s at t = 12 → virtual 3, d' = 1 s: one 1 s step takes 1 + 1 = 2 s:
  # slow:1@3+1x2 (window max(1, 1) = 1).
  {"t": 12.0, "kind": "pause_learner", "learner": 1, "window": 0, "fraction": 1.0},
  {"t": 12.5, "kind": "resume_learner", "learner": 1},
  {"t": 13.0, "kind": "start_learner", "learner": 2},
  {"t": 13.5, "kind": "kill_syncer", "restart_delay_s": 1.0},
  {"t": 14.0, "kind": "merge", "fragment": 0, "version": 1, "contributors": [0], "tokens": 512},
  {"t": 14.5, "kind": "start_syncer"},
  # A duty-cycled slowdown of learner 3, half of each period stopped, window t = 15 .. 16.25 →
  # virtual 9 .. 11.5: slow:3@9+2.5x2 (1 / (1 − 0.5) = 2).
  {"t": 15.0, "kind": "pause_learner", "learner": 3, "window": 1, "fraction": 0.5},
  {"t": 15.25, "kind": "net_delay", "latency_s": 0.1},
  {"t": 15.5, "kind": "resume_learner", "learner": 3},
  {"t": 16.0, "kind": "pause_learner", "learner": 3, "window": 1, "fraction": 0.5},
  {"t": 16.25, "kind": "resume_learner", "learner": 3},
  # Learner 0 killed at the very end and never restarted → crash:0@15 (virtual 2 · 7.5 = 15).
  {"t": 18.0, "kind": "kill_learner", "learner": 0, "restart_delay_s": 5.0},
]
EXPECTED = ("crash:2@1+4", "slow:1@3+1x2", "slow:3@9+2.5x2", "crash:0@15")


def test_tape_to_faults_by_hand():
  plan = replay.tape_to_faults(TAPE, time_scale=2.0, sim_step_time_s=1.0)
  assert plan.faults == EXPECTED
  assert plan.skipped == ("kill_syncer@13.5", "start_syncer@14.5", "net_delay@15.25")
  assert plan.time_scale == 2.0
  # Valid grammar: three lasting faults (with their completions) and a crash for good.
  assert len(parse_faults(plan.faults)) == 7
  # A syncer event aimed at one shard is listed with its shard.
  sharded = [{**r, "shard": 1} if "syncer" in r["kind"] else r for r in TAPE]
  plan = replay.tape_to_faults(sharded, time_scale=2.0, sim_step_time_s=1.0)
  assert plan.skipped == ("kill_syncer:1@13.5", "start_syncer:1@14.5", "net_delay@15.25")
  assert plan.faults == EXPECTED


def test_short_pause_still_slows_one_step():
  # A 0.1 s pause at scale 2 is 0.2 virtual s: shorter than a 1 s step, so the window is one step
  # long (some step must start in it) and that step takes 1 + 0.2 = 1.2 s.
  tape = [
    {"t": 3.0, "kind": "pause_learner", "learner": 0},
    {"t": 3.1, "kind": "resume_learner", "learner": 0},
  ]
  plan = replay.tape_to_faults(tape, time_scale=2.0, sim_step_time_s=1.0, t0=0.0)
  assert plan.faults == ("slow:0@6+1x1.2",)


def test_double_kill_is_rejected():
  tape = [
    {"t": 1.0, "kind": "kill_learner", "learner": 0},
    {"t": 2.0, "kind": "kill_learner", "learner": 0},
  ]
  with pytest.raises(ValueError, match="already"):
    replay.tape_to_faults(tape, time_scale=1.0, sim_step_time_s=1.0)


@pytest.fixture
def tiny_gin():
  """The fleet and the simulation of sim_tiny.gin, shortened, as `ddiloco-replay` builds them."""
  from ddiloco.launch import configurables
  from ddiloco.run_config import RunConfig
  from ddiloco.simulation.config import ClusterConfig
  from ddiloco.simulation.simulate import simulate

  configurables.parse(
    [os.path.join(ROOT, "sim_tiny.gin")],
    [
      "STEPS = 4",
      "InnerOptConfig.warmup_steps = 1",
      "RunConfig.eval_every_s = 0.0",
      "RunConfig.eval_batches = 1",
      "FragmentSchedule.num_fragments = 4",
      "FragmentSchedule.period = 4",
    ],
    search_paths=[ROOT],
  )
  yield {
    "run": configurables.configured(RunConfig)(),
    "fleet": configurables.configured(ClusterConfig)(),
    "simulate_fn": configurables.configured(simulate),
  }
  configurables.clear()


def test_replay_runs_the_tiny_simulator(tmp_path, tiny_gin):
  # Virtual time, 1 s steps, budget 4 x 4 = 16 steps. Learner 2's first step completes at t = 1
  # (that completion was queued at its start, before the crash was), then it crashes at t = 1 and
  # rejoins at t = 5. Learner 1's step starting at t = 3 takes 2 s (slow:1@3+1x2). At t = 5:
  # learners 0 and 3 have 5 steps, learner 1 has 4, learner 2 has 1: 15. At t = 5 learner 2's rejoin
  # (queued at t = 1) runs before the others' step completions, so its step is the first to complete
  # at t = 6: the 16th, which ends the budget. The syncer's clock opens round (2, 6) at t = 6; in the
  # drain every learner is asked at 6.05 (downlink latency) and answers at once if it has trained
  # fragment 2 since it last applied it: learner 1 applied version 1 at its step-4 boundary (t = 5)
  # and its next step ended after the budget, so it has nothing to send. The answers land at 6.10
  # (uplink latency); learner 1, alive and holding fragment 2, has not answered, so the round
  # waits out its grace window before it merges, and its delivery 0.05 s later is the last event. Learner 3's slowdown (virtual 9) and learner 0's
  # crash (virtual 15) come after the end.
  summary = replay.replay(
    TAPE, workdir=str(tmp_path), real_step_time_s=0.5, tensorboard=False, **tiny_gin
  )
  assert summary["replay"]["faults"] == list(EXPECTED)
  assert summary["replay"]["time_scale"] == 2.0
  assert summary["tokens_trained"] == 4 * 4 * 8 * 64  # LEARNERS x STEPS x BATCH x SEQ_LEN
  steps = {int(k): v["steps"] for k, v in summary["learners"].items()}
  assert sum(steps.values()) == 16
  assert steps == {0: 5, 1: 4, 2: 2, 3: 5}
  last = read_events(str(tmp_path), "merge")[-1]
  assert (last["fragment"], last["contributors"]) == (2, [0, 2, 3])
  assert last["time"] == pytest.approx(6.1 + last["grace_s"]) and last["grace_s"] > 0.5
  assert summary["virtual_time_s"] == pytest.approx(last["time"] + 0.05)
  assert summary["digests_agree"]
  # Said, not hidden: those two faults fall after the run and never fired.
  assert summary["replay"]["outside_run"] == ["slow:3@9+2.5x2", "crash:0@15"]
  assert summary["replay"]["end_s"] == pytest.approx(summary["virtual_time_s"])


def test_replay_rejects_learners_beyond_the_fleet(tmp_path, tiny_gin):
  tape = [{"t": 1.0, "kind": "kill_learner", "learner": 7}]
  with pytest.raises(ValueError, match=r"learners \[7\]"):
    replay.replay(tape, workdir=str(tmp_path), real_step_time_s=1.0, **tiny_gin)


def test_logged_step_time_is_the_median_over_learners(tmp_path):
  logs = {
    0: [{"kind": "train", "step_time_s": 0.2}, {"kind": "train", "step_time_s": 0.0}],
    1: [{"kind": "train", "step_time_s": 0.4}, {"kind": "connected"}],
    2: [{"kind": "train", "step_time_s": 0.3}],
  }
  for i, events in logs.items():
    (tmp_path / f"learner_{i}").mkdir()
    text = "".join(json.dumps(e) + "\n" for e in events)
    if i == 2:
      text += '{"kind": "tra'  # Torn by a SIGKILL: skipped.
    (tmp_path / f"learner_{i}" / "metrics.jsonl").write_text(text)
  # 0.0 (not measured yet) and non-train events are left out: the median of 0.2, 0.4 and 0.3.
  assert replay.logged_step_time(str(tmp_path)) == pytest.approx(0.3)
  with pytest.raises(ValueError, match="step time"):
    replay.logged_step_time(str(tmp_path / "nothing"))
