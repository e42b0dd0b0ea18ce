"""The one registration module: every configurable under its gin name, registered once, applied only
through gin, and every binding of a shipped config reaching an object that an entry point builds."""

import glob
import os

import gin
import pytest

from ddiloco.launch import configurables, gin_flags
from ddiloco.launch.job import JobConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.run_config import RunConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.syncer.types import SyncerConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "gin_configs"))

# The names the shipped gin files (and users' files) refer to; a rename breaks them.
NAMES = {
  *(
    f"ddiloco.{n}"
    for n in [
      "ChaosConfig",
      "ClusterConfig",
      "FragmentSchedule",
      "InnerOptConfig",
      "JobConfig",
      "LearnerCheckpointConfig",
      "LearnerConfig",
      "RDA",
      "RayConfig",
      "RunConfig",
      "ServiceConfig",
      "StalenessDiscountedMean",
      "SyncerCheckpointConfig",
      "SyncerConfig",
      "TextDataConfig",
      "TextTask",
      "TokenShardDataConfig",
      "TokenShardTask",
      "TransformerConfig",
      "VisionDataConfig",
      "VisionTask",
      "VitConfig",
      "WeightedMean",
      "hf_llama_config",
      "nesterov_warmup",
      "simulate",
      "transformer_config",
      "vit_config",
    ]
  ),
  *(f"optax.{n}" for n in ("adam", "adamw", "lamb", "lion", "rmsprop", "sgd")),
  *(
    f"goodput.{n}"
    for n in [
      "Costs",
      "DataParallel",
      "DecoupledDiLoCo",
      "Fleet",
      "GoodputStudy",
      "RecoveryDelay",
      "Scavenging",
      "experiment",
    ]
  ),
  *(f"bandwidth.{n}" for n in ("BandwidthStudy", "DataParallelLink", "DiLoCoLink", "Wire")),
  *(f"capacity.{n}" for n in ("CapacityStudy", "MeasuredShard", "SyncerCosts", "SyncerLoad")),
}
# What the entry points build themselves (`configurables.configured(X)()`), and the defaults that
# `configured` builds for RunConfig, JobConfig and simulate; everything else a file binds must be
# referenced.
BUILT = {
  "ddiloco.RunConfig",
  "ddiloco.JobConfig",
  "ddiloco.simulate",
  "ddiloco.ClusterConfig",  # ddiloco-replay's fleet, simulate's default one.
  "ddiloco.ChaosConfig",
  "ddiloco.RayConfig",
  "ddiloco.SyncerCheckpointConfig",
  "ddiloco.LearnerCheckpointConfig",
  "goodput.experiment",
  "ddiloco.SyncerConfig",
  "ddiloco.LearnerConfig",
  "ddiloco.InnerOptConfig",
  "ddiloco.ServiceConfig",
}
# Bindings an included base file makes for objects the including file replaces (unused, as ever).
UNUSED = {
  "runs/sim_vit_tiny.gin": {"ddiloco.TextDataConfig"},  # The vision task replaces the text data.
  "examples/custom_task.gin": {"ddiloco.TextDataConfig"},  # The custom task, likewise.
  "examples/token_corpus.gin": {"ddiloco.TextDataConfig"},  # A token corpus, likewise.
  # And the checkpoint's config.json replaces the model.
  "examples/from_hf_llama.gin": {"ddiloco.TextDataConfig", "ddiloco.transformer_config"},
  "goodput/heterogeneous.gin": {"goodput.DataParallel"},  # Only Decoupled DiLoCo systems.
  "goodput/scavenging.gin": {"goodput.DataParallel"},
  # The published methods' and the older studies' own outer step replaces the default one.
  "baselines/diloco.gin": {"ddiloco.nesterov_warmup"},
  "baselines/streaming_diloco.gin": {"ddiloco.nesterov_warmup"},
  "studies/heterogeneity.gin": {"ddiloco.nesterov_warmup"},
  "studies/merging.gin": {"ddiloco.nesterov_warmup"},
  "studies/scavenging.gin": {"ddiloco.nesterov_warmup"},
}
INCLUDED = ("models/", "runs/decoupled_base.gin", "runs/distributed_base.gin", "baselines/")


@pytest.fixture(autouse=True)
def _clean_gin():
  yield
  configurables.clear()


def test_every_configurable_keeps_its_gin_name():
  configurables.register()
  registered = {
    selector
    for selector, c in gin.config._REGISTRY.items()  # gin has no public listing.
    if c.module in ("ddiloco", "optax", "goodput", "bandwidth", "capacity")
  }
  assert registered == NAMES
  assert gin.config._REGISTRY["ddiloco.simulate"].denylist == ["workdir", "progress"]


def test_register_is_idempotent_even_on_a_finalized_config(monkeypatch):
  configurables.parse([], ["SyncerConfig.min_quorum = 2"])
  gin.finalize()  # Locks the config: gin then refuses new configurables.
  configurables.register()
  monkeypatch.setattr(configurables, "_registered", False)
  configurables.register()  # Registers the same objects again, unlocked.
  assert configurables.configured(SyncerConfig)().min_quorum == 2


def test_gin_applies_only_through_configured():
  configurables.parse([], ["SyncerConfig.min_quorum = 3"])
  assert configurables.configured(SyncerConfig)().min_quorum == 3
  assert configurables.configured("ddiloco.SyncerConfig")().min_quorum == 3
  assert configurables.configured(SyncerConfig)(min_quorum=2).min_quorum == 2  # A call's wins.
  assert SyncerConfig().min_quorum == 1  # A direct call ignores gin.


def test_unreferenced_defaults_of_a_job_still_take_their_bindings():
  """`SyncerConfig.min_quorum = 2` without `RunConfig.syncer = @SyncerConfig()` reaches the job's
  syncer, as when every config class was a gin configurable itself; so does a job whose file never
  refers to its `RunConfig`."""
  model = ["RunConfig.model = @transformer_config()", "transformer_config.size = 'tiny'"]
  model.append("RunConfig.data = @TextDataConfig()")
  configurables.parse(
    [],
    [
      *model,
      "SyncerConfig.min_quorum = 2",
      "LearnerConfig.mixing_alpha = 0.5",
      "InnerOptConfig.peak_lr = 0.001",
      "ServiceConfig.uplink_codec = 'int8'",
    ],
  )
  run = configurables.configured(JobConfig)().run
  assert run.the_syncer().min_quorum == 2
  assert run.learner.mixing_alpha == 0.5
  assert run.inner_opt.peak_lr == 0.001
  assert run.the_service().uplink_codec == "int8"
  assert configurables.configured(RunConfig)(syncer=SyncerConfig()).the_syncer().min_quorum == 1
  # A binding to None means the default too, which takes the class's bindings.
  configurables.parse([], [*model, "RunConfig.learner = None", "LearnerConfig.mixing_alpha = 0.25"])
  assert configurables.configured(JobConfig)().run.learner == LearnerConfig(mixing_alpha=0.25)


def test_unreferenced_defaults_of_simulate_still_take_their_bindings(tmp_path):
  configurables.parse([], ["simulate.fleet = @ClusterConfig()", "SyncerConfig.min_quorum = 0"])
  with pytest.raises(ValueError, match="min_quorum"):  # Built (and refused) before simulate runs.
    configurables.configured(simulate)(workdir=str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_resolved_config_holds_defaults_and_bindings_and_trains_nothing():
  files = [os.path.join(ROOT, "sim_tiny.gin")]
  text = configurables.resolved_config(files, ["STEPS = 50"], search_paths=[ROOT])
  assert text == configurables.resolved_config(files, ["STEPS = 50"], search_paths=[ROOT])
  assert "SyncerConfig.ema_decay = 0.8" in text  # A default that no gin file binds.
  assert "STEPS = 50" in text and "0x" not in text  # No object's address.
  # A binding of a configurable built only while training (the inner optimizer) counts too.
  later = configurables.resolved_config(
    files, ["STEPS = 50", "optax.lion.b1 = 0.8"], search_paths=[ROOT]
  )
  assert "lion.b1 = 0.8" in later and "lion" not in text
  rda = configurables.resolved_config(
    files, ["STEPS = 50", "SyncerConfig.merge_rule = @RDA()"], search_paths=[ROOT]
  )
  assert "SyncerConfig.merge_rule = @WeightedMean()" in text
  assert "SyncerConfig.merge_rule = @RDA()" in rda
  assert gin.config_str() == ""  # Cleared afterwards.
  with pytest.raises(ValueError, match="min_quorum"):
    configurables.resolved_config(files, ["SyncerConfig.min_quorum = 0"], search_paths=[ROOT])


def _configs() -> list[list[str]]:
  """Every shipped config as an entry point parses it: baselines on sim_tiny.gin, included pieces
  only through the files that include them."""
  out = []
  for path in sorted(glob.glob(f"{ROOT}/**/*.gin", recursive=True)):
    rel = os.path.relpath(path, ROOT)
    if rel.startswith("baselines/"):
      out.append(["sim_tiny.gin", rel])
    elif not rel.startswith(INCLUDED):
      out.append([rel])
  return out


@pytest.mark.parametrize("files", _configs(), ids=lambda files: files[-1])
def test_every_binding_of_a_shipped_config_reaches_an_object(files, monkeypatch):
  """gin applies a binding only to what it builds: a class that a file binds but that is neither
  referenced (`@X()`) nor built by an entry point would be ignored without a word."""
  monkeypatch.syspath_prepend(
    os.path.dirname(ROOT)
  )  # examples/custom_task.gin imports experiments.
  search = [ROOT, os.path.join(ROOT, "chaos"), os.path.dirname(ROOT)]
  configurables.parse([os.path.join(ROOT, f) for f in files], search_paths=search)
  referenced = set()
  for ref in gin_flags.references():
    name = ref.scoped_selector.split("/")[-1]
    match = gin.config._REGISTRY.get_match(name)
    referenced.add(match.selector if match else name)
  bound = {selector for _, selector in gin.config._CONFIG if not selector.endswith("gin.macro")}
  assert bound - referenced - BUILT == UNUSED.get(files[-1], set())
