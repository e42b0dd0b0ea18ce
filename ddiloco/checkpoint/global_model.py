"""The syncer's global model read from a run's folder, without the run: for export and inspection.

A syncer's folder (`<run>/syncer` of `ddiloco-local`, `<run>/syncer_<s>` for shard s of a sharded
syncer, or the `--workdir` of `ddiloco-syncer`) holds what a restart restores from
(checkpoint/syncer.py): orbax checkpoints of the core (`checkpoints/<step>`, each with the kept
versions of every fragment the syncer owns), the merge journal (each published version's digest)
and the version log (`versions/`, the values of the newest published versions).

`read_global_model` assembles the whole model from them:
- **the newest published model** (default): every fragment at its newest journaled version, from
  the version log when it holds that version with the journal's digest, else from the newest
  checkpoint when it holds it. A fragment whose newest version is in neither (version log off,
  merges since the last checkpoint) is read at the checkpoint's version and listed in `behind`.
  This is the model a learner would pull now: a restart restores the same values.
- **a checkpoint** (`step`): the values checkpoint `step` of an unsharded syncer holds, exactly.

It only reads: nothing in the folder is created, moved or removed (orbax's manager is opened
read-only, partial saves are left alone), so a syncer may be running there. Values are keyed by the
fragment layout's keys; the pieces of a tensor split along axis 0 (`split_large`, "path@a:b") are
joined back, so the result is the model's flat parameters {leaf path: array}.
"""

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ddiloco.checkpoint.journal import JOURNAL_NAME, read_journal_records
from ddiloco.checkpoint.syncer import SyncerCheckpointer
from ddiloco.checkpoint.version_log import VERSION_LOG_DIR, read_version
from ddiloco.fragments import layout as layout_lib

CHECKPOINTS = "checkpoints"  # `SyncerCheckpointConfig.subdir`'s default.
_SHARD_DIR = re.compile(r"^syncer_(\d+)$")


@dataclasses.dataclass(frozen=True)
class GlobalModel:
  """The syncer's global model as read from its folders.

  Attributes:
    params: the flat parameters {leaf path: array} ("block_0/attn/query/kernel": ...).
    versions: {fragment: the version read}.
    behind: {fragment: (version read, newest journaled version)} for fragments whose newest
      published values were in neither the version log nor the checkpoint.
    steps: the checkpoint step read in each syncer folder, in shard order.
    folders: the syncer folders read, shard 0 first.
  """

  params: dict[str, np.ndarray]
  versions: dict[int, int]
  behind: dict[int, tuple[int, int]]
  steps: tuple[int, ...]
  folders: tuple[str, ...]

  def tree(self) -> dict[str, Any]:
    """The parameters as the model's nested pytree ({"block_0": {"attn": ...}}), as flax holds
    them under "params"."""
    return nest(self.params)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """{"a/b/c": x} -> {"a": {"b": {"c": x}}}.

  Raises:
    ValueError: if a path is both a leaf and a prefix of another.
  """
  root: dict[str, Any] = {}
  for path, value in sorted(flat.items()):
    node = root
    *parents, name = path.split("/")
    for part in parents:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ValueError(f"{path!r}: {part!r} is a leaf and a folder.")
    if name in node:
      raise ValueError(f"{path!r} is a leaf and a folder.")
    node[name] = value
  return root


def syncer_folders(run_dir: str, *, subdir: str = CHECKPOINTS) -> list[str]:
  """The syncer folders of a run, shard 0 first.

  `run_dir` is a launcher's run folder (holding `syncer/` and, sharded, `syncer_1/` ...), or one
  syncer's own folder (holding its checkpoints' `subdir` or a merge journal).

  Raises:
    FileNotFoundError: if `run_dir` holds neither, or shards are missing from the sequence.
  """
  run_dir = os.path.abspath(run_dir)
  if os.path.isdir(os.path.join(run_dir, "syncer")):
    shards = {
      int(m.group(1)): os.path.join(run_dir, name)
      for name in os.listdir(run_dir)
      if (m := _SHARD_DIR.match(name)) and os.path.isdir(os.path.join(run_dir, name))
    }
    if sorted(shards) != list(range(1, len(shards) + 1)):
      raise FileNotFoundError(
        f"{run_dir} holds syncer shards {sorted(shards)} beside syncer/: shards 1..S-1 are needed."
      )
    return [os.path.join(run_dir, "syncer")] + [shards[s] for s in sorted(shards)]
  if os.path.isdir(os.path.join(run_dir, subdir)) or os.path.isfile(
    os.path.join(run_dir, JOURNAL_NAME)
  ):
    return [run_dir]
  raise FileNotFoundError(
    f"{run_dir} is neither a run folder (with syncer/) nor a syncer's folder (with {subdir}/): "
    "a simulated run keeps no syncer checkpoint to export."
  )


def _fragment_values(state: Mapping[str, Any], p: int, version: int) -> dict[str, np.ndarray]:
  prefix = f"fragment/{p}/v{version}/"
  return {k[len(prefix) :]: np.asarray(v) for k, v in state.items() if k.startswith(prefix)}


def _read_folder(
  folder: str, step: int | None, subdir: str
) -> tuple[int, int, dict[int, tuple[int, dict[str, np.ndarray]]], dict[int, tuple[int, int]]]:
  """(step, fragment count, {owned fragment: (version, values)}, behind) of one syncer folder."""
  checkpointer = SyncerCheckpointer(os.path.join(folder, subdir), read_only=True)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise FileNotFoundError(
        f"{folder} holds no complete syncer checkpoint yet (the syncer writes one every few "
        "seconds once something merged, and at exit)."
      )
    if step is not None and step not in steps:
      raise ValueError(f"{folder} has no checkpoint {step}; it has steps {steps}.")
    used, state = checkpointer.restore(steps[-1] if step is None else step)
  finally:
    checkpointer.close()
  num_fragments = int(state["num_fragments"])
  journal = read_journal_records(os.path.join(folder, JOURNAL_NAME)) if step is None else {}
  owned, behind = {}, {}
  for p in range(num_fragments):
    version = int(state[f"fragment/{p}/version"])
    values = _fragment_values(state, p, version)
    if not values:
      continue  # Another shard's fragment.
    records = journal.get(p, {})
    newest = max(records, default=version)
    if newest > version:
      logged = records[newest] and read_version(
        os.path.join(folder, VERSION_LOG_DIR), p, newest, records[newest]
      )
      if logged:
        version, values = newest, logged
      else:
        behind[p] = (version, newest)
    owned[p] = (version, values)
  return used, num_fragments, owned, behind


def join_pieces(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Layout-keyed values -> {leaf path: array}: pieces "path@a:b" joined along axis 0.

  Raises:
    ValueError: if a leaf's pieces do not cover rows 0..n without gaps or overlaps.
  """
  leaves: dict[str, list[tuple[int, np.ndarray]]] = {}
  out = {}
  for key, value in values.items():
    leaf, start, stop = layout_lib.parse_key(key)
    if start is None:
      out[leaf] = value
    else:
      if value.shape[0] != stop - start:
        raise ValueError(f"Piece {key!r} has {value.shape[0]} rows, not {stop - start}.")
      leaves.setdefault(leaf, []).append((start, value))
  for leaf, pieces in leaves.items():
    pieces.sort(key=lambda piece: piece[0])
    row = 0
    for start, value in pieces:
      if start != row:
        raise ValueError(f"The pieces of {leaf!r} leave rows from {row} to {start} uncovered.")
      row += value.shape[0]
    if leaf in out:
      raise ValueError(f"{leaf!r} is both whole and in pieces.")
    out[leaf] = np.concatenate([value for _, value in pieces], axis=0)
  return dict(sorted(out.items()))


def read_global_model(
  run_dir: str, *, step: int | None = None, subdir: str = CHECKPOINTS
) -> GlobalModel:
  """Reads the syncer's global model from a run's folder (see the module docstring).

  Args:
    run_dir: a run folder (with `syncer/`, sharded `syncer_<s>/` too) or a syncer's own folder.
    step: a checkpoint step of an unsharded syncer; None: the newest published model.
    subdir: the checkpoints' folder in each syncer folder (`SyncerCheckpointConfig.subdir`).

  Returns:
    The model, with the version read of every fragment.

  Raises:
    FileNotFoundError: for a folder without a syncer or without a complete checkpoint.
    ValueError: for an unknown step, a step of a sharded syncer, or shards that do not add up to
      one model (a fragment missing, or held by two shards).
  """
  folders = syncer_folders(run_dir, subdir=subdir)
  if step is not None and len(folders) > 1:
    raise ValueError(
      f"{run_dir} has {len(folders)} syncer shards, each with its own checkpoint steps: read the "
      "newest published model (no step)."
    )
  values: dict[str, np.ndarray] = {}
  versions: dict[int, int] = {}
  behind: dict[int, tuple[int, int]] = {}
  steps, counts = [], set()
  for folder in folders:
    used, num_fragments, owned, lagging = _read_folder(folder, step, subdir)
    steps.append(used)
    counts.add(num_fragments)
    twice = sorted(set(owned) & set(versions))
    if twice:
      raise ValueError(f"Fragments {twice} are held by two syncer folders of {run_dir}.")
    for p, (version, fragment) in owned.items():
      versions[p] = version
      values.update(fragment)
    behind.update(lagging)
  if len(counts) != 1:
    raise ValueError(f"The syncer folders of {run_dir} disagree on the fragment count: {counts}.")
  missing = sorted(set(range(counts.pop())) - set(versions))
  if missing:
    raise ValueError(f"No syncer folder of {run_dir} holds fragments {missing}.")
  return GlobalModel(
    params=join_pieces(values),
    versions=dict(sorted(versions.items())),
    behind=behind,
    steps=tuple(steps),
    folders=tuple(folders),
  )
