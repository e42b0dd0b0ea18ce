"""A learner's θ out of its checkpoints, for export (`ddiloco-export --learner`).

A learner run with `LearnerCheckpointConfig.save_params` saves θ of the step boundary in every
checkpoint (checkpoint/learner.py), never to restore from. `learner_folders` finds the learners'
checkpoint folders of a run and `read_params` reads θ back whole, without the learner.
"""

import dataclasses
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ddiloco import storage
from ddiloco.checkpoint.learner import FORMAT, LEARNER_DIR, PARAMS_ITEM, LearnerCheckpointConfig
from ddiloco.fragments import tree as fragment_tree


@dataclasses.dataclass(frozen=True)
class LearnerParams:
  """A learner's θ as one of its checkpoints holds it (`read_params`).

  Attributes:
    params: the flat parameters {leaf path: array} on the host ("block_0/attn/query/kernel": ...).
    learner_id: the learner that saved them.
    step: the learner's step at the save (θ of that step's boundary).
    tokens_trained: the learner's cumulative tokens at `step`.
    folder: the checkpoint folder read.
  """

  params: dict[str, np.ndarray]
  learner_id: int
  step: int
  tokens_trained: int
  folder: str


def learner_folders(config: LearnerCheckpointConfig, run_dir: str) -> dict[int, str]:
  """{learner id: checkpoint folder} of the learners of a run that have one, by id.

  Learner m of a run in `run_dir` works in `<run_dir>/learner_<m>` (`ddiloco-local`,
  `ddiloco-ray`), so it checkpoints in `<run_dir>/learner_<m>/checkpoints`, or in
  `<config.directory>/learner_<m>` when the run sets a shared `directory`.
  """
  root = run_dir if config.directory is None else config.directory
  found = {}
  for path in storage.glob(storage.resolve(root), "learner_*"):
    m = LEARNER_DIR.match(os.path.basename(path))
    if m is None:
      continue
    folder = config.learner_directory(int(m.group(1)), path)
    if storage.exists(folder):
      found[int(m.group(1))] = folder
  return dict(sorted(found.items()))


def read_params(folder: str, step: int | None = None) -> LearnerParams:
  """θ as a learner's checkpoint holds it (`save_params`), read to the host without the learner.

  It only reads, through orbax's handlers and never a manager: nothing in `folder` is created or
  removed, so the learner may be running (a save in flight is a tmp folder, never read). The
  arrays come back whole whatever mesh, or processes, saved them.

  Args:
    folder: a learner's checkpoint folder (`learner_folders`).
    step: the checkpoint's step; None: the newest.

  Returns:
    The parameters and where they come from.

  Raises:
    FileNotFoundError: if `folder` holds no complete checkpoint.
    ValueError: for a step `folder` does not hold, a checkpoint of another format, or one saved
      without θ (the learner's `LearnerCheckpointConfig.save_params` was off).
  """
  name_format = ocp.path.step.standard_name_format()
  found = {meta.step: meta.path for meta in name_format.find_all(epath.Path(folder))}
  if not found:
    raise FileNotFoundError(f"{folder} holds no learner checkpoint.")
  if step is None:
    step = max(found)
  elif step not in found:
    raise ValueError(f"{folder} has no checkpoint {step}; it has steps {sorted(found)}.")
  path = found[step]
  state = ocp.JsonCheckpointHandler().restore(path / "learner")
  if state.get("format") != FORMAT:
    raise ValueError(f"Checkpoint {path} is of format {state.get('format')}, not {FORMAT}.")
  if not (path / PARAMS_ITEM).exists():
    raise ValueError(
      f"Checkpoint {path} holds no parameters: the learner saves them with "
      "LearnerCheckpointConfig.save_params = True."
    )
  handler = ocp.PyTreeCheckpointHandler()
  try:
    shapes = handler.metadata(path / PARAMS_ITEM).tree
    host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    tree = handler.restore(path / PARAMS_ITEM, args=ocp.args.PyTreeRestore(restore_args=host))
  finally:
    handler.close()
  return LearnerParams(
    params={k: np.asarray(v) for k, v in fragment_tree.flatten(tree).items()},
    learner_id=int(state["learner_id"]),
    step=int(state["step"]),
    tokens_trained=int(state["tokens_trained"]),
    folder=str(folder),
  )
