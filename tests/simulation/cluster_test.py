"""End-to-end tests of the simulated cluster with real (tiny) training steps.

Runs of a few steps are in the fast tier; the runs of a fleet over a dozen steps or more, with its
faults and timing, are in the integration tier (each costs seconds of tracing and compiling).
"""

import functools
import os

import jax
import numpy as np
import optax
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.factory import LearnerFactory
from ddiloco.metrics.writer import read_events, read_scalars
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig
from ddiloco.service.virtual import VirtualSyncer
from ddiloco.simulation.cluster import SimulatedCluster
from ddiloco.simulation.config import ClusterConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.syncer.core import SyncerConfig
from ddiloco.syncer.merge_rules import RDA

SEQ = 32
FP32 = ServiceConfig(uplink_codec="fp32", downlink_codec="fp32")
DATA = text_data.TextDataConfig(seq_len=SEQ, batch_size=4)
INNER = train_step.InnerOptConfig(warmup_steps=2, decay_steps=100)


def _model():
  return configs.transformer_config("tiny", max_len=SEQ)


def test_identity_reproduces_plain_training():
  """M = K = P = H = 1, τ = 0, outer SGD lr 1 without momentum == plain training, step for step."""
  steps = 6
  factory = LearnerFactory(
    model_config=_model(), data_config=DATA, inner_opt=INNER, num_fragments=1, num_shards=1
  )
  syncer = SyncerConfig(
    min_quorum=1,
    use_grace=False,
    outer_optimizer=lambda: optax.sgd(1.0),
    clock="slowest",
  )
  sim = SimulatedCluster(
    factory=factory,
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=1, period=1, overlap=0),
      syncer=syncer,
      learner=LearnerConfig(blocking=True),
      num_learners=1,
      steps_per_learner=steps,
    ),
    fleet=ClusterConfig(uplink_latency_s=0.01),
    syncer_fn=functools.partial(VirtualSyncer, syncer_config=syncer, service_config=FP32),
  )
  summary = sim.run()
  assert summary["merges"] == steps
  global_flat = sim.global_params_flat()

  # The same learner, the same data, no syncer.
  plain = factory.make_learner(
    0,
    spec=ClusterConfig().spec_for(0, num_learners=1, batch_size=None),
    schedule=FragmentSchedule(num_fragments=1, period=1, overlap=0),
    config=LearnerConfig(),
  )
  data = factory.make_data(0, spec=ClusterConfig().spec_for(0, num_learners=1, batch_size=None))
  for _ in range(steps):
    plain.train_step(next(data))
  plain_flat = tree.flatten(jax.device_get(plain.params))
  assert set(plain_flat) == set(global_flat)
  for k, v in plain_flat.items():
    np.testing.assert_allclose(global_flat[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def _sim_summary(
  tmp_path, name, *, faults=(), min_quorum=1, blocking=False, steps=24, tensorboard=False
):
  return simulate(
    workdir=str(tmp_path / name),
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
      syncer=SyncerConfig(min_quorum=min_quorum, clock="slowest" if blocking else "fleet_rate"),
      learner=LearnerConfig(blocking=blocking),
      inner_opt=INNER,
      num_learners=3,
      steps_per_learner=steps,
      log_every=4,
    ),
    fleet=ClusterConfig(faults=faults),
    tensorboard=tensorboard,
  )


@pytest.mark.integration
def test_tensorboard_scalars_share_the_tokens_axis(tmp_path):
  """Every scalar is against the fleet's tokens; the final eval, merges and goodput are there."""
  summary = _sim_summary(tmp_path, "tb", faults=("crash:1@3+2",), steps=8, tensorboard=True)
  workdir = tmp_path / "tb"
  assert sorted(os.listdir(workdir / "tb")) == ["run_000"]
  scalars = read_scalars(str(workdir))
  for i in range(3):
    assert {f"learner_{i}/loss", f"learner_{i}/step_rate", f"learner_{i}/staleness_steps"} <= set(
      scalars
    )
    assert {f"steps/learner_{i}/loss", f"steps/learner_{i}/step_rate"} <= set(scalars)
  tokens = summary["tokens_trained"]
  for tag, points in scalars.items():
    if not tag.startswith("steps/"):
      assert all(0 < x <= tokens for x, _ in points), tag  # Tokens, never steps or seconds.
  assert scalars["eval/loss"][-1] == (tokens, pytest.approx(summary["final_eval_loss"]))
  assert scalars["syncer/merges"][-1][1] == summary["merges"]
  assert {v for _, v in scalars["syncer/quorum_size"]} <= {1.0, 2.0, 3.0}
  assert "syncer/grace_window_s" in scalars
  assert scalars["goodput/goodput"][-1][1] == pytest.approx(summary["goodput"])
  assert summary["goodput"] < 1.0  # Learner 1 was down for 2 s.
  assert scalars["traffic/bytes_up"][-1][1] == summary["bytes_up"]
  assert [x for x, _ in scalars["steps/learner_0/loss"]] == [4, 8]  # log_every = 4.
  # A second run in the same workdir writes its own run folder.
  _sim_summary(tmp_path, "tb", steps=4, tensorboard=True)
  assert sorted(os.listdir(workdir / "tb")) == ["run_000", "run_001"]
  assert len(read_scalars(str(workdir / "tb" / "run_000"))["steps/learner_0/loss"]) == 2


@pytest.mark.integration
def test_crashed_learner_does_not_stop_the_global_model(tmp_path):
  """Zero global downtime: with K = 1, versions keep advancing while learner 1 is down."""
  summary = _sim_summary(tmp_path, "k1", faults=("crash:1@5+8",))
  merges = read_events(str(tmp_path / "k1"), "merge")
  during = [m for m in merges if 5.0 < m["time"] < 13.0]
  assert len(during) >= 6  # 2 learners x 8 s / (H=4 steps per fragment) x 4 fragments, minus edges.
  assert all(1 not in m["contributors"] for m in during if m["time"] > 5.2)
  assert summary["global_downtime_s"] == 0.0
  assert summary["digests_agree"]
  assert summary["learners"]["1"]["time"]["down"] == pytest.approx(8.0)
  assert np.isfinite(summary["final_eval_loss"])
  # Rejoined at t = 13 with its step count 8 behind, learner 1 aligns to the fleet's schedule phase:
  # it lands in the same rounds as the others, so no report is dropped and no round is a solo one.
  after = [m for m in merges if m["time"] > 15.0]
  assert after and all(1 in m["contributors"] for m in after)
  assert summary["dropped_reports"] == 0
  # The token ledger (learner/ledger.py): every learner's trained tokens are booked once, and what
  # the learners settled as merged is exactly what the syncer merged (P = 4 fragments).
  book = summary["token_ledger"]
  assert book["received"] == book["merged"] + book["dropped"] + book["pending"]
  learner_merged = 0
  for i, s in summary["learners"].items():
    ledger = s["token_ledger"]
    assert ledger["balanced"] and ledger["trained"] == s["tokens"]
    assert ledger["merged"] * 4 == book["learners"][int(i)]["merged"]
    learner_merged += ledger["merged"] * 4
  assert learner_merged == book["merged"] > 0


@pytest.mark.integration
def test_synchronous_quorum_stalls_on_a_dead_learner(tmp_path):
  """K = M with blocking learners: the crash stops everyone (global downtime > 0, goodput < 1)."""
  summary = _sim_summary(tmp_path, "kM", faults=("crash:1@5+8",), min_quorum=3, blocking=True)
  assert summary["global_downtime_s"] > 5.0
  assert summary["goodput"] < 0.8
  k1 = _sim_summary(tmp_path, "k1b", faults=("crash:1@5+8",))
  assert k1["goodput"] > summary["goodput"]


@pytest.mark.integration
def test_summary_keys_and_training_progress(tmp_path):
  summary = _sim_summary(tmp_path, "plain", steps=40)
  for key in (
    "final_eval_loss",
    "tokens_trained",
    "goodput",
    "global_downtime_s",
    "merges",
    "mean_quorum_size",
    "dropped_reports",
    "bytes_up",
    "bytes_down",
    "wall_time_s",
  ):
    assert key in summary
  assert summary["tokens_trained"] >= 3 * 40 * 4 * SEQ
  assert summary["goodput"] == pytest.approx(1.0)
  evals = read_events(str(tmp_path / "plain"), "eval")
  train = read_events(str(tmp_path / "plain"), "train")
  assert train[-1]["loss"] < train[0]["loss"]
  assert evals[-1]["loss"] < np.log(256)


@pytest.mark.integration
def test_join_leave_and_straggler(tmp_path):
  """Scavenging and scale-down: learner 3 joins at t = 4, learner 0 leaves at t = 10.5, learner 1 is 2x
  slower from t = 2 to t = 8. The joiner trains on its own (4th) shard and contributes to merges; the
  leaver contributes nothing after leaving; the fleet keeps merging throughout.
  """
  workdir = tmp_path / "elastic"
  summary = simulate(
    workdir=str(workdir),
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
      syncer=SyncerConfig(min_quorum=1),
      inner_opt=INNER,
      num_learners=3,
      steps_per_learner=16,
      log_every=4,
    ),
    fleet=ClusterConfig(faults=("join:3@4", "leave:0@10.5", "slow:1@2+6x2.0")),
    tensorboard=False,
  )
  merges = read_events(str(workdir), "merge")
  assert summary["learners"]["3"]["steps"] > 0
  assert any(3 in m["contributors"] for m in merges)
  # Its last report (sent at t = 10) may still merge after the grace window (a report already in a
  # round stays there; window <= γ·τ·ξ_step <= 0.8 x 1 x 2 s while learner 1 reports 2 s steps).
  assert not any(0 in m["contributors"] for m in merges if m["time"] > 10.05 + 1.6)
  assert summary["learners"]["0"]["steps"] == 10
  # Learner 1 ran 2x slower for 6 s: 3 steps in that window instead of 6.
  assert summary["learners"]["1"]["steps"] < summary["learners"]["2"]["steps"]
  assert summary["digests_agree"] is True
  assert summary["global_downtime_s"] == 0.0
  assert summary["learners"]["0"]["time"] == pytest.approx({"busy": 10.5})


@pytest.mark.integration
def test_synchronous_stall_on_a_permanent_crash_is_reported(tmp_path):
  """K = M, blocking, learner 1 never returns: the run cannot finish. It must stop (not evaluate
  forever), say so, and count the whole stall as global downtime.
  """
  summary = simulate(
    workdir=str(tmp_path / "stall"),
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=2, period=4, overlap=1),
      syncer=SyncerConfig(min_quorum=2, use_grace=False, clock="slowest"),
      learner=LearnerConfig(blocking=True),
      inner_opt=INNER,
      num_learners=2,
      steps_per_learner=12,
      eval_every_s=3.0,
      log_every=4,
    ),
    fleet=ClusterConfig(faults=("crash:1@5",), max_time_s=30.0),
    tensorboard=False,
  )
  assert summary["stalled"] is True
  assert summary["budget_reached"] is False
  assert summary["tokens_trained"] < summary["token_budget"]
  # Learner 0 blocks within a period of the crash; from then on nobody is busy until the horizon.
  assert summary["virtual_time_s"] == 30.0
  assert summary["global_downtime_s"] > 20.0
  assert summary["global_downtime_s"] == pytest.approx(
    summary["virtual_time_s"] - summary["learners"]["0"]["time"]["busy"]
  )
  # The crashed learner's slot stays provisioned (down), so it costs goodput.
  assert summary["learners"]["1"]["time"]["down"] > 0


@pytest.mark.integration
def test_int4_on_the_wire_keeps_digests_and_changes_the_values(tmp_path):
  """docs/algorithm.md §5 in the simulator: int4 reports and int4 downlink deltas that the syncer adopts.

  Learners hold exactly the adopted bits after every apply (digests agree), and the global model is
  not the fp32 one (the codec really ran), yet it trains about as well.
  """

  def run(name, codec):
    return simulate(
      workdir=str(tmp_path / name),
      run=RunConfig(
        model=_model(),
        data=DATA,
        schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
        syncer=SyncerConfig(min_quorum=2),
        inner_opt=INNER,
        service=ServiceConfig(uplink_codec=codec, downlink_codec=codec),
        num_learners=2,
        steps_per_learner=16,
        log_every=4,
      ),
      tensorboard=False,
    )

  exact, int4 = run("fp32", "fp32"), run("int4", "int4")
  assert int4["digests_agree"] is True and exact["digests_agree"] is True
  assert int4["merges"] == exact["merges"] > 0
  assert int4["final_eval_loss"] != exact["final_eval_loss"]
  assert abs(int4["final_eval_loss"] - exact["final_eval_loss"]) < 0.05 * exact["final_eval_loss"]


@pytest.mark.integration
def test_vit_task_merges_with_int4_and_rda_and_reports_accuracy(tmp_path):
  """The vision task through the unchanged learners and syncer: balanced fragments of ViT params,
  RDA on the encoder blocks and the weighted mean on the input/output tensors, int4 both ways.
  """
  from ddiloco.data.vision import VisionDataConfig
  from ddiloco.tasks import VisionTask

  task = VisionTask(
    model=configs.vit_config("tiny", num_layers=2), data=VisionDataConfig(batch_size=16)
  )
  factory = LearnerFactory(task=task, inner_opt=INNER, num_fragments=4, num_shards=2)
  assert sorted(factory.embedding_keys()) == [
    "head/bias",
    "head/kernel",
    "patch_embed/bias",
    "patch_embed/kernel",
    "pos_embed/embedding",
  ]
  assert factory.tokens_per_step == 16  # Examples per step.
  summary = simulate(
    workdir=str(tmp_path / "vit"),
    run=RunConfig(
      task=task,
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
      syncer=SyncerConfig(min_quorum=2, merge_rule=RDA()),
      inner_opt=INNER,
      service=ServiceConfig(uplink_codec="int4", downlink_codec="int4"),
      num_learners=2,
      steps_per_learner=16,
      eval_batches=4,
      log_every=4,
    ),
    tensorboard=False,
  )
  assert summary["tokens_trained"] == 2 * 16 * 16  # learners x steps x examples
  assert summary["merges"] >= 12 and summary["mean_quorum_size"] == 2.0
  assert summary["digests_agree"] is True
  metrics = summary["final_eval_metrics"]
  assert set(metrics) == {"loss", "accuracy"}
  assert metrics["loss"] == summary["final_eval_loss"] < np.log(10.0)  # Zero head starts at ln 10.
  assert 0.1 < metrics["accuracy"] <= 1.0
  # Eval events carry every metric, the final one the summary's.
  final = read_events(str(tmp_path / "vit"), "eval")[-1]
  assert final["final"] and final["accuracy"] == metrics["accuracy"]


def test_moe_text_simulates(tmp_path):
  summary = simulate(
    workdir=str(tmp_path / "moe"),
    run=RunConfig(
      model=configs.transformer_config("tiny_moe", num_layers=2, max_len=SEQ),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
      syncer=SyncerConfig(min_quorum=1),
      inner_opt=INNER,
      num_learners=2,
      steps_per_learner=8,
      eval_batches=2,
      log_every=4,
    ),
    tensorboard=False,
  )
  assert summary["merges"] > 0 and summary["digests_agree"] is True
  assert summary["tokens_trained"] == 2 * 8 * 4 * SEQ
  metrics = summary["final_eval_metrics"]
  assert metrics["loss"] == metrics["lm_loss"] == summary["final_eval_loss"] < np.log(256)
  assert metrics["moe_aux_loss"] > 0.5


@pytest.mark.parametrize("run", ["runs/sim_vit_tiny.gin", "runs/sim_moe_tiny.gin"])
def test_shipped_task_runs_train(tmp_path, run):
  """The vision and MoE run files parse and train for a few steps (so they cannot rot)."""
  import os

  import gin

  from ddiloco.launch import configurables

  root = os.path.join(os.path.dirname(__file__), "..", "..", "gin_configs")
  try:
    configurables.parse(
      [os.path.join(root, run)],
      [
        "LEARNERS = 2",
        "STEPS = 2",
        "InnerOptConfig.warmup_steps = 1",
        "RunConfig.eval_every_s = 0.0",
        "RunConfig.eval_batches = 1",
        # Fewer compiles (one per learner's device slice), smaller programs (>= 24 leaves for P = 24).
        "vit_config.num_layers = 2" if "vit" in run else "transformer_config.num_layers = 3",
      ],
      search_paths=[root],
    )
    summary = configurables.configured(simulate)(workdir=str(tmp_path), tensorboard=False)
    units = gin.query_parameter("%BATCH") * (1 if "vit" in run else gin.query_parameter("%SEQ_LEN"))
  finally:
    configurables.clear()
  assert summary["tokens_trained"] == 2 * 2 * units  # LEARNERS x STEPS x units per step
  assert np.isfinite(summary["final_eval_loss"])


@pytest.mark.integration
def test_an_18_percent_slower_learner_is_in_every_merge_once_per_period(tmp_path):
  """Rounds paced by the syncer: with learner 2 18 % slower, K = 1 and the grace window, each
  fragment merges once per period of its schedule, and (after the first period, while the grace
  window's step-time estimate forms) with all three learners; no answer is late."""
  workdir = tmp_path / "hetero"
  summary = simulate(
    workdir=str(workdir),
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=2),
      syncer=SyncerConfig(min_quorum=1),
      inner_opt=INNER,
      num_learners=3,
      steps_per_learner=24,
      log_every=4,
    ),
    fleet=ClusterConfig(slow_learners=1),
    tensorboard=False,
  )
  rounds = read_events(str(workdir), "round")
  merges = read_events(str(workdir), "merge")
  assert summary["syncer"]["late"] == 0
  assert summary["syncer"]["overrun_rounds"] == 0
  # Round (p, t) opens only where the schedule says p is due, every step once.
  schedule = FragmentSchedule(num_fragments=4, period=4, overlap=2)
  assert [r["step"] for r in rounds] == sorted({r["step"] for r in rounds})
  assert all(schedule.due(r["step"]) == (r["fragment"],) for r in rounds)
  per_fragment = {p: [m for m in merges if m["fragment"] == p] for p in range(4)}
  for p, ms in per_fragment.items():
    # One merge per round, a period (4 steps of about 1 s) apart.
    assert len(ms) == sum(r["fragment"] == p for r in rounds)
    gaps = np.diff([m["time"] for m in ms])
    assert np.all(gaps > 3.0), (p, gaps)
  late_enough = [m for m in merges if m["time"] > 6.0]
  assert late_enough and all(m["contributors"] == [0, 1, 2] for m in late_enough)


def test_blocking_learners_need_the_lock_step_clock(tmp_path):
  with pytest.raises(ValueError, match="clock = 'slowest'"):
    simulate(
      workdir=str(tmp_path / "x"),
      run=RunConfig(
        model=_model(),
        data=DATA,
        schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
        syncer=SyncerConfig(min_quorum=2),
        learner=LearnerConfig(blocking=True),
        inner_opt=INNER,
        num_learners=2,
        steps_per_learner=4,
      ),
      tensorboard=False,
    )


@pytest.mark.integration
def test_a_joining_learner_continues_the_fleets_learning_rate_schedule(tmp_path):
  """Learner 2 joins at t = 6.5: its inner schedule starts at the fleet's step (about 6), not at 0."""
  factory = LearnerFactory(
    model_config=_model(), data_config=DATA, inner_opt=INNER, num_fragments=4, num_shards=3
  )
  sim = SimulatedCluster(
    factory=factory,
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
      num_learners=2,
      steps_per_learner=16,
    ),
    fleet=ClusterConfig(faults=("join:2@6.5",)),
    syncer_fn=functools.partial(VirtualSyncer, syncer_config=SyncerConfig(), service_config=FP32),
  )
  sim.run()
  joiner = sim.slots[2].learner
  counts = [
    int(s.count)
    for s in jax.tree.leaves(
      joiner.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
    )
    if isinstance(s, optax.ScaleByScheduleState)
  ]
  # The fleet's step at the join (about 6), plus the steps the joiner trained itself.
  assert 0 < joiner.kernel.step < 16
  assert counts and counts[0] >= 6 + joiner.kernel.step - 1


def test_progress_line_shows_rates_and_dashes_for_unknown_values():
  factory = LearnerFactory(
    model_config=_model(), data_config=DATA, inner_opt=INNER, num_fragments=1, num_shards=2
  )
  sim = SimulatedCluster(
    factory=factory,
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=1, period=1, overlap=0),
      num_learners=2,
      steps_per_learner=3,
      log_every=2,
    ),
    fleet=ClusterConfig(),
    syncer_fn=functools.partial(VirtualSyncer, syncer_config=SyncerConfig(), service_config=FP32),
  )
  sim.run()
  tokens = sim.tokens_trained  # 2 learners x 3 steps x 4 x 32.
  assert tokens == 2 * 3 * 4 * SEQ
  line = sim.progress_line(wall_s=2.0)
  assert "| 3 steps/s 384 tok/s eta 0s |" in line  # 6 steps and 768 tokens in 2 s.
  assert "L0:up step 3 loss " in line and "nan" not in line
  sim.slots[1].losses.clear()  # As before its first logged loss.
  line = sim.progress_line()
  assert "| - steps/s - tok/s eta - |" in line and line.endswith("L1:up step 3 loss -")


@pytest.mark.integration
def test_a_round_is_answered_mid_step_not_at_the_next_boundary(tmp_path):
  """Learners step in 1 s; a request lands 0.05 s after its round opens, mid-step. Each learner
  answers at once with θ of its last step (docs/algorithm.md §3), so with everyone's answer in
  (0.05 s more on the uplink) the round merges 0.1 s after it opened, not after the next step."""
  workdir = tmp_path / "mid"
  simulate(
    workdir=str(workdir),
    run=RunConfig(
      model=_model(),
      data=DATA,
      schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
      syncer=SyncerConfig(min_quorum=1),
      inner_opt=INNER,
      num_learners=2,
      steps_per_learner=12,
      log_every=4,
    ),
    tensorboard=False,
  )
  rounds = read_events(str(workdir), "round")
  merges = read_events(str(workdir), "merge")
  opened = {
    (r["fragment"], i): r["time"]
    for p in (0, 1)
    for i, r in enumerate([r for r in rounds if r["fragment"] == p])
  }
  waits = [
    m["time"] - opened[(p, i)]
    for p in (0, 1)
    for i, m in enumerate([m for m in merges if m["fragment"] == p])
    if len(m["contributors"]) == 2
  ]
  assert len(waits) >= 8
  np.testing.assert_allclose(waits, 0.1, atol=1e-6)


@pytest.mark.integration
def test_learners_reach_the_syncer_service_through_its_door_and_codecs(tmp_path):
  """One code path (docs/architecture.md): a simulated learner's pushes and pulls go through the
  service's door and codecs, so the bytes on the wire are the codec's (int4 is about an eighth of
  fp32's, block scales aside), nothing is refused, and a crash reaches the syncer only through
  the learner's silence: learner 1 is declared dead liveness_timeout_s after its last heartbeat."""
  runs = {}
  for codec in ("fp32", "int4"):
    workdir = tmp_path / codec
    runs[codec] = simulate(
      workdir=str(workdir),
      run=RunConfig(
        model=_model(),
        data=DATA,
        schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
        inner_opt=INNER,
        service=ServiceConfig(uplink_codec=codec, downlink_codec=codec, liveness_timeout_s=3.0),
        num_learners=2,
        steps_per_learner=16,
      ),
      fleet=ClusterConfig(faults=("crash:1@4.5",)),
      tensorboard=False,
    )
  fp32, int4 = runs["fp32"], runs["int4"]
  assert fp32["syncer"]["refused"] == {} == int4["syncer"]["refused"]
  assert 0.12 < int4["bytes_up"] / fp32["bytes_up"] < 0.2
  assert int4["digests_agree"] and fp32["digests_agree"]
  # Learner 1's last heartbeat was at t = 4 (its 4th step): the syncer counts it alive until
  # t = 7. A round closes early only once every alive learner answered, so until then each round
  # waits out its grace window; after, it merges as soon as learner 0's answer is in (0.1 s).
  workdir = str(tmp_path / "fp32")
  opened = {(r["fragment"], r["step"]): r["time"] for r in read_events(workdir, "round")}
  rounds = sorted(opened.items(), key=lambda kv: kv[1])
  merges = read_events(workdir, "merge")
  waits = []
  for p in (0, 1):
    mine = [t for (q, _), t in rounds if q == p]
    waits += [(t, m["time"] - t) for t, m in zip(mine, [m for m in merges if m["fragment"] == p])]
  before = [w for t, w in waits if 4.5 < t < 6.5]
  after = [w for t, w in waits if t > 7.5]
  assert before and all(w > 0.2 for w in before)
  assert after and np.allclose(after, 0.1)


@pytest.mark.integration
def test_latency_jitter_spreads_the_answers_and_the_grace_window_takes_them_in(tmp_path):
  """With each message's latency drawn log-normal (σ = 1 around 0.05 s), the answers of a round
  arrive spread out: K = 1 without a grace window merges at the first and drops the rest as late;
  the grace window (up to γ of τ = 2 steps' slack) takes them in."""

  def run(name, use_grace):
    return simulate(
      workdir=str(tmp_path / name),
      run=RunConfig(
        model=_model(),
        data=DATA,
        schedule=FragmentSchedule(num_fragments=4, period=4, overlap=2),
        syncer=SyncerConfig(min_quorum=1, use_grace=use_grace),
        inner_opt=INNER,
        service=FP32,
        num_learners=3,
        steps_per_learner=16,
        log_every=8,
      ),
      fleet=ClusterConfig(latency_jitter=1.0),
      tensorboard=False,
    )

  no_grace, grace = run("no_grace", False), run("grace", True)
  assert no_grace["syncer"]["late"] >= 5
  assert grace["syncer"]["late"] <= no_grace["syncer"]["late"] // 4
  assert grace["mean_quorum_size"] > no_grace["mean_quorum_size"] + 0.5
  with pytest.raises(ValueError, match="jitter"):
    ClusterConfig(latency_jitter=-1.0)


def test_data_slots_are_the_runs_or_one_per_learner_that_can_join():
  fleet = ClusterConfig(faults=("join:5@4", "leave:1@6"))
  assert fleet.num_shards(4) == 6  # Learner 4 never joins: its slot stays unread.
  assert (
    fleet.num_shards(4, data_slots=4) == 4
  )  # Learner 5 shares slot 1 (a distributed run's rule).
