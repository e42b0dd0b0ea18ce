"""A model out of a run: a plain Orbax checkpoint of its pytree, or a Hugging Face Llama.

`export_global_model` reads the syncer's global model from a run's folder
(`global_model.read_global_model`: the newest published model, or a checkpoint's);
`export_learner_params` reads one learner's own θ, as it trained it between syncs, from that
learner's checkpoint (`learner_params.read_params`: only a learner run with
`LearnerCheckpointConfig.save_params` saves it). Either is written as

- **"orbax"**: a standard Orbax checkpoint of the model's own parameter pytree, the nested dict that
  flax holds under "params" ({"token_embed": {"embedding": [V, D]}, "block_0": ...}), with the
  parameters' dtypes. Restoring it needs orbax alone, no ddiloco:
  `orbax.checkpoint.StandardCheckpointer().restore(DIR)`; `model.apply({"params": tree}, tokens)`
  with the run's model then gives the exported model's logits. Any model exports this way, not only
  the transformer.
- **"hf"**: a Hugging Face `LlamaForCausalLM` folder (config.json + safetensors), for the dense
  text transformer (ddiloco/models/hf_llama.py has the mapping, and why RoPE needs no permutation).

Either way the folder also gets `ddiloco_export.json`: where the model came from (for the global
model the version of every fragment, for a learner's θ its id, step and tokens). The output folder must not exist yet, or be empty: an export never mixes with
other files. Everything is written into a hidden folder beside it, which is renamed to the output
folder once complete, so a failed or interrupted export leaves no half-written model behind (only,
after a kill, the hidden `.NAME.*.partial` folder).
"""

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ddiloco.checkpoint import global_model, learner_params
from ddiloco.checkpoint.global_model import GlobalModel
from ddiloco.checkpoint.learner import LearnerCheckpointConfig
from ddiloco.checkpoint.learner_params import LearnerParams
from ddiloco.models import hf_llama
from ddiloco.models.transformer import TransformerConfig

FORMATS = ("orbax", "hf")
PROVENANCE_NAME = "ddiloco_export.json"
# {leaf path: (shape, dtype)} of a model's parameters.
Signature = Mapping[str, tuple[tuple[int, ...], Any]]


@dataclasses.dataclass(frozen=True)
class ExportInfo:
  """What `export_global_model` or `export_learner_params` wrote.

  Attributes:
    out: the output folder (absolute).
    format: "orbax" or "hf".
    files: what it holds, relative to `out` (orbax's own files are listed as one entry, ".").
    model: what was read: the syncer's global model, or a learner's θ.
  """

  out: str
  format: str
  files: tuple[str, ...]
  model: GlobalModel | LearnerParams


def param_signature(model: Any, inputs: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{leaf path: (shape, dtype)} of a flax model's parameters, traced without allocating them.

  Args:
    model: a flax module called as `model(inputs)`.
    inputs: a `jax.ShapeDtypeStruct` of its input (`Task.dummy_inputs()`).
  """
  import flax.linen as nn
  import jax

  from ddiloco.fragments import tree

  abstract = jax.eval_shape(lambda x: model.init(jax.random.key(0), x)["params"], inputs)
  flat = tree.flatten(nn.unbox(abstract))
  return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in flat.items()}


def check_params(
  params: Mapping[str, np.ndarray], expected: Signature, *, source: str = "The syncer's model"
) -> None:
  """Raises ValueError unless `params` has exactly the expected leaves, shapes and dtypes.

  Args:
    params: flat parameters {leaf path: array}.
    expected: {leaf path: (shape, dtype)} of the run's model (`param_signature`).
    source: what `params` are, for the message.
  """
  missing = sorted(set(expected) - set(params))
  extra = sorted(set(params) - set(expected))
  wrong = [
    f"{k}: {params[k].dtype}{tuple(params[k].shape)}, the model {np.dtype(d)}{tuple(s)}"
    for k, (s, d) in sorted(expected.items())
    if k in params and (tuple(params[k].shape) != tuple(s) or params[k].dtype != np.dtype(d))
  ]
  if missing or extra or wrong:
    raise ValueError(
      f"{source} does not fit the run's model (another config?): missing {missing[:4]}, "
      f"unexpected {extra[:4]}, different {wrong[:4]}."
    )


def check_out(out: str) -> str:
  """`out` made absolute.

  Raises:
    FileExistsError: if `out` exists and is not an empty folder.
  """
  out = os.path.abspath(out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(f"{out} exists and is not an empty folder: export into a new one.")
  return out


@contextlib.contextmanager
def staged(out: str) -> Iterator[str]:
  """A new folder to write into, renamed to `out` (absent or empty) when the block completes.

  Raises:
    FileExistsError: if `out` was filled meanwhile.
  """
  parent, name = os.path.split(out)
  os.makedirs(parent, exist_ok=True)
  stage = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
  try:
    folder = os.path.join(stage, name)
    yield folder
    try:
      os.rename(folder, out)  # Replaces an empty folder; refuses one that holds something.
    except OSError as e:
      raise FileExistsError(f"{out} was filled during the export: {e.strerror}.") from e
  finally:
    shutil.rmtree(stage, ignore_errors=True)


def write_orbax(tree: Mapping[str, Any], out: str) -> None:
  """Writes a nested dict of numpy arrays as a standard Orbax checkpoint at `out` (a new folder)."""
  import orbax.checkpoint as ocp

  checkpointer = ocp.StandardCheckpointer()
  try:
    checkpointer.save(out, dict(tree))
    checkpointer.wait_until_finished()
  finally:
    checkpointer.close()


def export_global_model(
  run_dir: str,
  out: str,
  *,
  fmt: str,
  step: int | None = None,
  model_config: TransformerConfig | None = None,
  expected: Signature | None = None,
  subdir: str = global_model.CHECKPOINTS,
) -> ExportInfo:
  """Writes the syncer's global model of the run in `run_dir` to `out`.

  Args:
    run_dir: the run's folder, or a syncer's own (`global_model.syncer_folders`).
    out: the output folder; must not exist, or be empty.
    fmt: "orbax" or "hf" (module docstring).
    step: a checkpoint step of an unsharded syncer (the model after that many merges); None: the
      newest published model.
    model_config: the run's transformer; required for "hf" (the RoPE base, norm epsilon and
      context length are not in the parameters' shapes).
    expected: {leaf path: (shape, dtype)} of the run's model: the model read is checked against it.
    subdir: the syncer's checkpoints folder (`SyncerCheckpointConfig.subdir`).

  Returns:
    What was written.

  Raises:
    ValueError: for an unknown format, "hf" without a Llama-style `model_config`, or a model
      that does not fit `expected` or `model_config`; as `read_global_model`.
    FileExistsError: if `out` holds something.
    FileNotFoundError: as `read_global_model`.
  """
  out = _check_request(out, fmt, model_config)
  model = global_model.read_global_model(run_dir, step=step, subdir=subdir)
  provenance = {
    "run": os.path.abspath(run_dir),
    "syncer_folders": list(model.folders),
    "checkpoint_steps": list(model.steps),
    "versions": {str(p): v for p, v in model.versions.items()},
    "behind_journal": {str(p): list(v) for p, v in model.behind.items()},
  }
  files = _write(
    model.params,
    out,
    fmt=fmt,
    model_config=model_config,
    expected=expected,
    source="The syncer's model",
    provenance=provenance,
  )
  return ExportInfo(out=out, format=fmt, files=files, model=model)


def export_learner_params(
  run_dir: str,
  out: str,
  *,
  learner_id: int,
  fmt: str,
  step: int | None = None,
  model_config: TransformerConfig | None = None,
  expected: Signature | None = None,
  checkpoint: LearnerCheckpointConfig | None = None,
) -> ExportInfo:
  """Writes learner `learner_id`'s own θ, as its checkpoint holds it, to `out`.

  θ is the learner's parameters at the step of the checkpoint: the global fragments it last
  received plus its own inner steps since, not the global model. Only a learner that ran with
  `LearnerCheckpointConfig.save_params` has it in its checkpoints.

  Args:
    run_dir: the run's folder (learner m's workdir is `<run_dir>/learner_<m>`).
    out: the output folder; must not exist, or be empty.
    learner_id: the learner.
    fmt: "orbax" or "hf" (module docstring).
    step: a checkpoint step of that learner; None: its newest checkpoint.
    model_config: the run's transformer; required for "hf".
    expected: {leaf path: (shape, dtype)} of the run's model: θ is checked against it.
    checkpoint: the run's learner checkpoint config (where the folders are: its `directory`);
      None: the default.

  Returns:
    What was written.

  Raises:
    ValueError: for an unknown format, "hf" without a Llama-style `model_config`, a θ that does
      not fit `expected` or `model_config`; as `learner_params.read_params` (an unknown step, a
      checkpoint without θ).
    FileExistsError: if `out` holds something.
    FileNotFoundError: if the learner has no checkpoint (the message lists those that have one).
  """
  out = _check_request(out, fmt, model_config)
  checkpoint = checkpoint or LearnerCheckpointConfig()
  folders = learner_params.learner_folders(checkpoint, run_dir)
  if learner_id not in folders:
    root = run_dir if checkpoint.directory is None else checkpoint.directory
    have = f"learners with checkpoints: {sorted(folders)}" if folders else "no learner has one"
    raise FileNotFoundError(
      f"Learner {learner_id} has no checkpoint folder under {os.path.abspath(root)}; {have}."
    )
  learner = learner_params.read_params(folders[learner_id], step=step)
  provenance = {
    "run": os.path.abspath(run_dir),
    "learner_id": learner.learner_id,
    "checkpoint_folder": learner.folder,
    "step": learner.step,
    "tokens_trained": learner.tokens_trained,
  }
  files = _write(
    learner.params,
    out,
    fmt=fmt,
    model_config=model_config,
    expected=expected,
    source=f"Learner {learner_id}'s θ",
    provenance=provenance,
  )
  return ExportInfo(out=out, format=fmt, files=files, model=learner)


def _check_request(out: str, fmt: str, model_config: TransformerConfig | None) -> str:
  """`out` made absolute, once the format and the output folder are known to be fine."""
  if fmt not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}.")
  if fmt == "hf":
    if model_config is None:
      raise ValueError("The Hugging Face format needs the run's transformer config.")
    hf_llama.check_exportable(model_config)
  return check_out(out)


def _write(
  params: Mapping[str, np.ndarray],
  out: str,
  *,
  fmt: str,
  model_config: TransformerConfig | None,
  expected: Signature | None,
  source: str,
  provenance: Mapping[str, Any],
) -> tuple[str, ...]:
  """Checks the flat `params`, then writes them and `provenance` to `out` (staged); returns the
  files written."""
  if expected is not None:
    check_params(params, expected, source=source)
  if fmt == "hf":
    hf_llama.check_params(params, model_config)  # Before anything is written.
  with staged(out) as folder:
    if fmt == "orbax":
      write_orbax(global_model.nest(params), folder)
      files = (".",)
    else:
      files = tuple(hf_llama.save(params, model_config, folder))
    with open(os.path.join(folder, PROVENANCE_NAME), "w") as f:
      json.dump({"format": fmt, **provenance}, f, indent=1)
  return (*files, PROVENANCE_NAME)
