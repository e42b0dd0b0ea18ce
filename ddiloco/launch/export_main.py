"""`ddiloco-export`: the syncer's global model of a run, or one learner's θ, as Orbax or Hugging
Face files.

  ddiloco-export --workdir=workdirs/local_tiny --format=hf --out=exports/local_tiny_hf
  ddiloco-export --workdir=workdirs/local_tiny --format=orbax --out=exports/v40 --version=40
  ddiloco-export --workdir=workdirs/local_tiny --format=orbax --out=exports/learner_1 --learner=1

`--workdir` is the run's folder (as `ddiloco-local` or `ddiloco-ray` wrote it, with `syncer/` and,
sharded, `syncer_1/` ...) or a syncer's own `--workdir`. The model is the newest the syncer
published (every fragment at its newest journaled version: what a learner would pull now), or with
`--version=N` the one after N merges, as the syncer's checkpoint N holds it (an unsharded syncer
keeps its last `SyncerCheckpointConfig.max_to_keep` checkpoints; another N lists them). The run may
still be going: nothing in its folder is written.

`--learner=M` exports learner M's own θ instead: its parameters as it trained them between syncs
(the global fragments it last received plus its inner steps since), from its newest checkpoint,
or with `--step=N` its checkpoint of step N (a learner keeps its last
`LearnerCheckpointConfig.max_to_keep`; another N lists them). Only a learner run with
`--gin.LearnerCheckpointConfig.save_params=True` saves θ in its checkpoints; a restart never reads
it back (checkpoint/learner.py). Learner M's checkpoints are in `<workdir>/learner_M/checkpoints`,
or under `LearnerCheckpointConfig.directory` when the run's config sets one.

Formats (ddiloco/checkpoint/export.py): "orbax", a standard Orbax checkpoint of the model's own
parameter pytree that `orbax.checkpoint.StandardCheckpointer().restore(DIR)` reads without ddiloco;
"hf", a Hugging Face `LlamaForCausalLM` folder (config.json + safetensors) for the dense text
transformer. The run's model comes from its `config.gin` (`--config` to read another file): the
parameters are checked against it, and "hf" takes its RoPE base, norm epsilon and context length.

Bad input (no syncer checkpoint, an unknown version, an unknown learner or step, a learner
checkpoint without θ, a model that is no Llama for "hf", an `--out` that holds something) ends in
one line and exit status 2, with nothing written.
"""

import os
from typing import Any, NamedTuple

from absl import app, flags

from ddiloco.launch import cli, sim_env  # noqa: F401 - sim_env: before numpy, jax.

_WORKDIR = flags.DEFINE_string("workdir", None, "the run's (or a syncer's) folder", required=True)
_FORMAT = flags.DEFINE_enum("format", None, ["orbax", "hf"], "what to write", required=True)
_OUT = flags.DEFINE_string("out", None, "output folder (new, or empty)", required=True)
_VERSION = flags.DEFINE_integer(
  "version", None, "the model after this many merges (a syncer checkpoint); default: the newest"
)
_LEARNER = flags.DEFINE_integer(
  "learner", None, "export this learner's own θ instead of the global model", lower_bound=0
)
_STEP = flags.DEFINE_integer(
  "step", None, "with --learner: its checkpoint of this step; default: its newest"
)
_CONFIG = flags.DEFINE_string(
  "config", None, "the run's gin config (default: WORKDIR's config.gin)"
)

CONFIG_NAME = "config.gin"


def find_config(workdir: str) -> str | None:
  """The run's operative gin config: `config.gin` in the folder or its `syncer/`, or None."""
  for folder in (workdir, os.path.join(workdir, "syncer")):
    path = os.path.join(folder, CONFIG_NAME)
    if os.path.isfile(path):
      return path
  return None


class RunModel(NamedTuple):
  """What an export needs of a run's config (`run_model`).

  Attributes:
    model_config: the transformer config, or None for a task whose model is not the text
      transformer (a vision run).
    signature: {leaf path: (shape, dtype)} of the model's parameters.
    subdir: the syncer's checkpoints folder name (`SyncerCheckpointConfig.subdir`).
    learner_checkpoint: the learners' `LearnerCheckpointConfig` (where their checkpoints are).
  """

  model_config: Any
  signature: dict[str, Any]
  subdir: str
  learner_checkpoint: Any


def run_model(config_path: str) -> RunModel:
  """What an export needs of the run a gin config describes."""
  from ddiloco.checkpoint.export import param_signature
  from ddiloco.checkpoint.learner import LearnerCheckpointConfig
  from ddiloco.checkpoint.syncer import SyncerCheckpointConfig
  from ddiloco.launch import configurables
  from ddiloco.models.transformer import TransformerConfig
  from ddiloco.run_config import RunConfig

  configurables.parse([config_path])
  try:
    task = configurables.configured(RunConfig)().the_task()
    subdir = configurables.configured(SyncerCheckpointConfig)().subdir
    learner_checkpoint = configurables.configured(LearnerCheckpointConfig)()
  finally:
    configurables.clear()
  config = getattr(task, "model_config", None)
  return RunModel(
    model_config=config if isinstance(config, TransformerConfig) else None,
    signature=param_signature(task.model, task.dummy_inputs(batch_size=1)),
    subdir=subdir,
    learner_checkpoint=learner_checkpoint,
  )


def export(
  workdir: str,
  *,
  fmt: str,
  out: str,
  version: int | None = None,
  config: str | None = None,
  learner: int | None = None,
  step: int | None = None,
) -> Any:
  """What the command does: `export.export_global_model`, or with `learner`
  `export.export_learner_params`, with the run's model; returns its info.

  Raises:
    FileNotFoundError, FileExistsError, ValueError: for bad input (module docstring).
  """
  from ddiloco.checkpoint import export as export_lib
  from ddiloco.checkpoint import global_model

  export_lib.check_out(out)  # The cheapest refusals first, before the config is parsed.
  if learner is None and step is not None:
    raise ValueError(
      "--step is a learner checkpoint's: give --learner too (the syncer's: --version)."
    )
  if learner is not None and version is not None:
    raise ValueError("--version is the syncer's; a learner's checkpoint is chosen with --step.")
  if learner is None:
    global_model.syncer_folders(workdir)
  config = config or find_config(workdir)
  if config is None:
    raise FileNotFoundError(
      f"{workdir} holds no {CONFIG_NAME} (nor syncer/{CONFIG_NAME}): give the run's gin config "
      "as --config."
    )
  run = run_model(config)
  if fmt == "hf" and run.model_config is None:
    raise ValueError(
      "The run's model is not the text transformer: only a Llama-style model exports as hf; "
      "use --format=orbax."
    )
  if learner is not None:
    return export_lib.export_learner_params(
      workdir,
      out,
      learner_id=learner,
      fmt=fmt,
      step=step,
      model_config=run.model_config,
      expected=run.signature,
      checkpoint=run.learner_checkpoint,
    )
  global_model.syncer_folders(workdir, subdir=run.subdir)
  return export_lib.export_global_model(
    workdir,
    out,
    fmt=fmt,
    step=version,
    model_config=run.model_config,
    expected=run.signature,
    subdir=run.subdir,
  )


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  with cli.bad_config():  # Every refusal comes before anything is written.
    info = export(
      _WORKDIR.value,
      fmt=_FORMAT.value,
      out=_OUT.value,
      version=_VERSION.value,
      config=_CONFIG.value,
      learner=_LEARNER.value,
      step=_STEP.value,
    )
  print(_describe(info))


def _describe(info: Any) -> str:
  """The line the command prints about what it wrote."""
  from ddiloco.checkpoint.learner_params import LearnerParams

  model = info.model
  if isinstance(model, LearnerParams):
    return (
      f"wrote {info.format} to {info.out}: {len(model.params)} tensors, learner "
      f"{model.learner_id}'s θ at step {model.step} ({model.tokens_trained} tokens trained)"
    )
  behind = f"; {len(model.behind)} fragments behind the journal" if model.behind else ""
  return (
    f"wrote {info.format} to {info.out}: {len(model.params)} tensors, fragment versions "
    f"{min(model.versions.values())}..{max(model.versions.values())} "
    f"(checkpoint steps {', '.join(map(str, model.steps))}){behind}"
  )


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-export", module=__name__, gin=False)


if __name__ == "__main__":
  run()
