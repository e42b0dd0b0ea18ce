"""Every shipped gin config parses, and every tiny run trains for a few steps (so examples cannot rot).

Configs are parsed and built as the entry points do: after `configurables.register()`, through
`configurables.configured(...)` (a direct call such as `ClusterConfig()` ignores gin).
"""

import glob
import os

import gin
import numpy as np
import pytest

from ddiloco.launch import configurables
from ddiloco.simulation.simulate import simulate

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "gin_configs")
ROOT = os.path.abspath(ROOT)
# Run files own a model and a fleet; baselines stack on a run file; the rest are included pieces.
RUNS = ["sim_tiny.gin", "runs/sim_small.gin", "runs/sim_vit_tiny.gin", "runs/sim_moe_tiny.gin"]
# Distributed runs (ddiloco-local); the integration tests run them for real.
DISTRIBUTED = ["local_tiny.gin", "ray_tiny.gin"]
CHAOS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/chaos/*.gin"))
BASELINES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/baselines/*.gin"))
# TPU slice configs; tests/parallel/slice_configs_test.py checks them on fake devices.
CLUSTERS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/clusters/*.gin"))
# Examples of user code and data; tests/tasks/custom_task_test.py and token_corpus_test.py run them.
EXAMPLES = ["examples/custom_task.gin", "examples/token_corpus.gin", "examples/from_hf_llama.gin"]
# Study bases (experiments/*.py stack bindings on them); each is a simulated run file.
STUDIES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/studies/*.gin"))
FAST = [
  "STEPS = 3",
  "InnerOptConfig.warmup_steps = 1",
  "RunConfig.eval_every_s = 0.0",
  "RunConfig.eval_batches = 1",
]


def _parse(files, bindings=(), search_paths=()):
  files = [os.path.join(ROOT, f) for f in files]
  configurables.parse(files, bindings, search_paths=[ROOT, *search_paths])


@pytest.fixture(autouse=True)
def _clean_gin():
  yield
  configurables.clear()


def test_every_config_is_covered():
  shipped = {
    os.path.relpath(p, ROOT)
    for p in glob.glob(f"{ROOT}/**/*.gin", recursive=True)
    if not p.startswith(os.path.join(ROOT, "goodput"))
  }
  sizes = ("tiny", "small", "2b", "5b", "9b", "tiny_moe", "small_moe", "5b_moe", "vit_tiny")
  included = {f"models/{s}.gin" for s in sizes}
  included.add("runs/run_base.gin")
  included.add("runs/decoupled_base.gin")
  included.add("runs/distributed_base.gin")
  assert shipped == (
    set(RUNS)
    | set(BASELINES)
    | included
    | set(DISTRIBUTED)
    | set(CHAOS)
    | set(STUDIES)
    | set(EXAMPLES)
    | set(CLUSTERS)
  )


@pytest.mark.parametrize(
  "size", ["tiny", "small", "2b", "5b", "9b", "tiny_moe", "small_moe", "5b_moe"]
)
def test_model_configs_parse(size):
  from ddiloco.models import configs

  _parse([f"models/{size}.gin"])
  cfg = configurables.configured(configs.transformer_config)()
  assert cfg.num_layers >= 4


@pytest.mark.parametrize("run", RUNS)
def test_run_configs_parse_and_build(run):
  from ddiloco.run_config import RunConfig
  from ddiloco.simulation.config import ClusterConfig
  from ddiloco.syncer.core import SyncerConfig

  _parse([run])
  assert configurables.configured(RunConfig)().num_learners == gin.query_parameter("%LEARNERS")
  assert configurables.configured(SyncerConfig)().min_quorum == 1
  assert configurables.configured(ClusterConfig)().faults == gin.query_parameter("%FAULTS")


@pytest.mark.parametrize("baseline", [None, *BASELINES])
def test_tiny_runs_train(tmp_path, baseline):
  files = ["sim_tiny.gin"] + ([baseline] if baseline else [])
  _parse(files, FAST)
  summary = configurables.configured(simulate)(workdir=str(tmp_path), tensorboard=False)
  assert summary["tokens_trained"] == 4 * 3 * 8 * 64  # LEARNERS x STEPS x BATCH x SEQ_LEN
  assert summary["final_eval_loss"] < 6.0
  assert os.path.exists(tmp_path / "summary.json")


@pytest.mark.parametrize("run", DISTRIBUTED)
def test_distributed_configs_build_a_job(run):
  from ddiloco.launch.job import JobConfig
  from ddiloco.launch.ray_config import RayConfig

  _parse([run])
  job = configurables.configured(JobConfig)()
  configurables.configured(RayConfig)()  # Its bindings, where the file has them, are valid.
  run = job.run
  assert run.num_learners >= 2
  factory = job.factory()
  assert factory.layout.num_fragments == run.the_schedule().num_fragments
  assert run.token_budget() == run.num_learners * run.steps_per_learner * run.tokens_per_step()


def test_the_simulator_and_the_launchers_read_one_run_config():
  """runs/run_base.gin binds RunConfig once: sim_tiny.gin and local_tiny.gin at the same run length
  differ only in the wire codecs (their bases') and in their own evaluation cadence."""
  import dataclasses

  from ddiloco.launch.job import JobConfig
  from ddiloco.run_config import RunConfig

  _parse(["sim_tiny.gin"], ["STEPS = 50"])
  sim = configurables.configured(RunConfig)()
  _parse(["local_tiny.gin"], ["STEPS = 50"])
  job = configurables.configured(JobConfig)()
  # JobConfig.run = @RunConfig(): the very bindings.
  assert job.run == configurables.configured(RunConfig)()
  assert (sim.service.uplink_codec, job.run.service.uplink_codec) == ("fp32", "int4")
  # The outer optimizer is a factory gin builds anew per parse: compared by what it does.
  grads = {"w": np.array([1.0, -2.0], np.float32)}
  steps = []
  for run in (sim, job.run):
    opt = run.the_syncer().make_outer_optimizer()
    state = opt.init(grads)
    for _ in range(2):  # Twice, so that momentum shows.
      update, state = opt.update(grads, state, grads)
    steps.append(np.asarray(update["w"]))
  np.testing.assert_array_equal(steps[0], steps[1])
  same = dataclasses.replace(
    job.run,
    service=sim.service,
    eval_every_s=sim.eval_every_s,
    log_every=sim.log_every,
    syncer=dataclasses.replace(job.run.syncer, outer_optimizer=sim.syncer.outer_optimizer),
  )
  assert same == sim


@pytest.mark.parametrize("run", CHAOS)
def test_chaos_configs_build_a_job_and_a_schedule(run):
  from ddiloco.faults.schedule import ChaosConfig, make_schedule
  from ddiloco.launch.job import JobConfig

  _parse([run], search_paths=[os.path.join(ROOT, "chaos")])
  job = configurables.configured(JobConfig)()
  chaos = configurables.configured(ChaosConfig)()
  schedule = make_schedule(chaos, job.run.num_learners, job.syncer_shards)
  assert len(CHAOS) == 4
  assert sum(ev.kind == "kill_syncer" for ev in schedule) == len(chaos.syncer_kill_times_s) >= 1
  assert any(ev.kind == "kill_learner" for ev in schedule)


@pytest.mark.parametrize("run", STUDIES)
def test_study_configs_parse_and_build(run):
  from ddiloco.run_config import RunConfig
  from ddiloco.simulation.config import ClusterConfig

  _parse([run])
  assert configurables.configured(RunConfig)().num_learners == gin.query_parameter("%LEARNERS") == 4
  assert (
    configurables.configured(ClusterConfig)().faults == ()
  )  # The studies' rows add their own faults (or none).
  assert len(STUDIES) == 3
