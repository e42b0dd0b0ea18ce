"""`ddiloco-export`: the syncer's global model of a run, as Orbax or Hugging Face files.

  ddiloco-export --workdir=workdirs/local_tiny --format=hf --out=exports/local_tiny_hf
  ddiloco-export --workdir=workdirs/local_tiny --format=orbax --out=exports/v40 --version=40

`--workdir` is the run's folder (as `ddiloco-local` or `ddiloco-ray` wrote it, with `syncer/` and,
sharded, `syncer_1/` ...) or a syncer's own `--workdir`. The model is the newest the syncer
published (every fragment at its newest journaled version: what a learner would pull now), or with
`--version=N` the one after N merges, as the syncer's checkpoint N holds it (an unsharded syncer
keeps its last `SyncerCheckpointConfig.max_to_keep` checkpoints; another N lists them). The run may
still be going: nothing in its folder is written.

Formats (ddiloco/checkpoint/export.py): "orbax", a standard Orbax checkpoint of the model's own
parameter pytree that `orbax.checkpoint.StandardCheckpointer().restore(DIR)` reads without ddiloco;
"hf", a Hugging Face `LlamaForCausalLM` folder (config.json + safetensors) for the dense text
transformer. The run's model comes from its `config.gin` (`--config` to read another file): the
parameters are checked against it, and "hf" takes its RoPE base, norm epsilon and context length.

Bad input (no syncer checkpoint, an unknown version, a model that is no Llama for "hf", an `--out`
that holds something) ends in one line and exit status 2, with nothing written. Learner checkpoints
hold no parameters (checkpoint/learner.py), so the global model is the one export.
"""

import os
from typing import Any

from absl import app, flags

from ddiloco.launch import cli, sim_env  # noqa: F401 - sim_env: before numpy, jax.

_WORKDIR = flags.DEFINE_string("workdir", None, "the run's (or a syncer's) folder", required=True)
_FORMAT = flags.DEFINE_enum("format", None, ["orbax", "hf"], "what to write", required=True)
_OUT = flags.DEFINE_string("out", None, "output folder (new, or empty)", required=True)
_VERSION = flags.DEFINE_integer(
  "version", None, "the model after this many merges (a syncer checkpoint); default: the newest"
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


def run_model(config_path: str) -> tuple[Any, dict[str, Any], str]:
  """(transformer config or None, {leaf path: (shape, dtype)}, the syncer's checkpoints folder
  name) of the run a gin config describes.

  The config is None for a task whose model is not the text transformer (a vision run).
  """
  from ddiloco.checkpoint.export import param_signature
  from ddiloco.checkpoint.syncer import SyncerCheckpointConfig
  from ddiloco.launch import configurables
  from ddiloco.models.transformer import TransformerConfig
  from ddiloco.run_config import RunConfig

  configurables.parse([config_path])
  try:
    task = configurables.configured(RunConfig)().the_task()
    subdir = configurables.configured(SyncerCheckpointConfig)().subdir
  finally:
    configurables.clear()
  config = getattr(task, "model_config", None)
  signature = param_signature(task.model, task.dummy_inputs(batch_size=1))
  return (config if isinstance(config, TransformerConfig) else None), signature, subdir


def export(
  workdir: str, *, fmt: str, out: str, version: int | None = None, config: str | None = None
) -> Any:
  """What the command does (`export.export_global_model` with the run's model); returns its info.

  Raises:
    FileNotFoundError, FileExistsError, ValueError: for bad input (module docstring).
  """
  from ddiloco.checkpoint import export as export_lib
  from ddiloco.checkpoint import global_model

  export_lib.check_out(out)  # The cheapest refusals first, before the config is parsed.
  global_model.syncer_folders(workdir)
  config = config or find_config(workdir)
  if config is None:
    raise FileNotFoundError(
      f"{workdir} holds no {CONFIG_NAME} (nor syncer/{CONFIG_NAME}): give the run's gin config "
      "as --config."
    )
  model_config, signature, subdir = run_model(config)
  global_model.syncer_folders(workdir, subdir=subdir)
  if fmt == "hf" and model_config is None:
    raise ValueError(
      "The run's model is not the text transformer: only a Llama-style model exports as hf; "
      "use --format=orbax."
    )
  return export_lib.export_global_model(
    workdir,
    out,
    fmt=fmt,
    step=version,
    model_config=model_config,
    expected=signature,
    subdir=subdir,
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
    )
  model = info.model
  behind = f"; {len(model.behind)} fragments behind the journal" if model.behind else ""
  print(
    f"wrote {info.format} to {info.out}: {len(model.params)} tensors, fragment versions "
    f"{min(model.versions.values())}..{max(model.versions.values())} "
    f"(checkpoint steps {', '.join(map(str, model.steps))}){behind}"
  )


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-export", module=__name__, gin=False)


if __name__ == "__main__":
  run()
