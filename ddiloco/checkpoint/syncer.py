"""The syncer's durable state: orbax checkpoints of the whole core plus a merge journal (SPEC §6).

A syncer killed at any moment restarts from two things in its workdir:

- **Checkpoints** (`SyncerCheckpointer`): the core's whole `state_dict()` (kept versions of every
  fragment, outer optimizer states, open rounds with their reports, membership, counters, grace EMAs),
  written asynchronously by orbax every `every_s` seconds and at shutdown. Orbax writes into a
  temporary directory and renames it when complete, so a kill mid-save leaves the previous checkpoint.
- **The merge journal** (`MergeJournal`): one line per published merge, (fragment, version, digest),
  appended before the version is served to any learner. After a restore it says which versions the
  learners may already hold that the checkpoint lacks.

`restore_core` loads the newest checkpoint and then publishes each fragment whose journal is ahead of
the checkpoint again, as version journal + 1 with the checkpoint's values: versions stay monotonic
for every learner, and a learner holding a lost version pulls the restored values in full. The
recovery point is therefore the merges since the last checkpoint (docs/resilience.md).
"""

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import gin
import numpy as np
import orbax.checkpoint as ocp

from ddiloco.syncer.core import MergeEvent, SyncerCore

log = logging.getLogger(__name__)


@gin.configurable(module="ddiloco")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncerCheckpointConfig:
  """How the syncer persists its state. Bound from gin as `ddiloco.SyncerCheckpointConfig.<field>`.

  Attributes:
    enabled: write checkpoints and the merge journal, and restore from them at start.
    every_s: seconds between checkpoints (only when something merged since the last one). The
      recovery point: at most the merges of the last `every_s` seconds are lost to a kill.
    max_to_keep: checkpoints kept on disk (older ones are deleted after a newer one is complete).
    subdir: folder under the syncer's workdir.
  """

  enabled: bool = True
  every_s: float = 5.0
  max_to_keep: int = 2
  subdir: str = "checkpoints"

  def __post_init__(self):
    if not self.every_s > 0:
      raise ValueError(f"every_s must be > 0, got {self.every_s}.")
    if self.max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep}.")
    if not self.subdir or os.path.isabs(self.subdir) or ".." in self.subdir.split(os.sep):
      raise ValueError(f"subdir must be a relative folder name, got {self.subdir!r}.")


JOURNAL_NAME = "merge_journal.jsonl"


class _OrbaxInfoFilter(logging.Filter):
  """Drops orbax's INFO records (about 40 lines per save); its warnings and errors pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO or f"{os.sep}orbax{os.sep}" not in record.pathname


def quiet_orbax_logs() -> None:
  """Keeps a process's log readable: orbax logs every save step by step at INFO (idempotent)."""
  root = logging.getLogger()
  if not any(isinstance(f, _OrbaxInfoFilter) for h in root.handlers for f in h.filters):
    for handler in root.handlers:
      handler.addFilter(_OrbaxInfoFilter())


class MergeJournal:
  """Append-only record of published merges: {"fragment", "version", "digest", "time"} per line.

  Each line goes to the OS in one `os.write` on an O_APPEND descriptor before the merge is served,
  so a killed process loses none (a machine crash may lose what the OS had not written; the
  checkpoint is still consistent). No fsync per merge: merges are frequent, kills are the threat.
  """

  def __init__(self, path: str):
    self.path = path
    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

  def append(self, event: MergeEvent) -> None:
    line = {
      "fragment": event.fragment,
      "version": event.version,
      "digest": event.digest,
      "time": round(time.time(), 4),
    }
    os.write(self._fd, (json.dumps(line) + "\n").encode())

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1


def read_journal(path: str) -> dict[int, int]:
  """{fragment: newest journaled version}; a missing file is empty, a torn last line is ignored."""
  newest: dict[int, int] = {}
  if not os.path.exists(path):
    return newest
  with open(path, "rb") as f:
    for raw in f:
      try:
        entry = json.loads(raw)
        p, v = int(entry["fragment"]), int(entry["version"])
      except (ValueError, KeyError, TypeError):
        log.warning("merge journal %s: skipping unreadable line %r", path, raw[:80])
        continue
      newest[p] = max(v, newest.get(p, -1))
  return newest


def _split(state: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Arrays (saved by orbax under short names) and JSON scalars, with the arrays' real names."""
  arrays, scalars, names, empty = {}, {}, [], {}
  for name, value in state.items():
    if isinstance(value, np.ndarray) and value.size == 0:  # Orbax refuses empty arrays.
      empty[name] = [value.dtype.str, list(value.shape)]
    elif isinstance(value, np.ndarray):
      arrays[f"a{len(names):06d}"] = value
      names.append(name)
    elif isinstance(value, bool | int | float | str | np.generic):
      scalars[name] = value.item() if isinstance(value, np.generic) else value
    else:
      raise TypeError(f"State entry {name!r} is a {type(value).__name__}, not an array or scalar.")
  return arrays, {"array_names": names, "empty_arrays": empty, "scalars": scalars}


def _join(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> dict[str, Any]:
  names = meta["array_names"]
  arrays = arrays or {}  # Orbax restores an empty tree as None.
  if len(arrays) != len(names):
    raise ValueError(f"Checkpoint holds {len(arrays)} arrays, its index names {len(names)}.")
  state = {name: np.asarray(arrays[f"a{i:06d}"]) for i, name in enumerate(names)}
  for name, (dtype, shape) in meta["empty_arrays"].items():
    state[name] = np.zeros(shape, np.dtype(dtype))
  state.update(meta["scalars"])
  return state


class SyncerCheckpointer:
  """Asynchronous, atomic orbax checkpoints of a `SyncerCore.state_dict()`.

  Args:
    directory: where checkpoints go (one sub-folder per step, written by orbax).
    max_to_keep: complete checkpoints kept.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Mapping[str, Any]) -> None:
    """Starts writing `state` as `step` in the background (waits for the previous write first).

    `state` must not be mutated afterwards: `state_dict()` returns copies, so that holds.
    """
    arrays, meta = _split(state)
    meta["saved_at"] = time.time()
    self._manager.save(
      step,
      args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
    )

  def restore(self, step: int | None = None) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of checkpoint `step` (default the newest complete one), or None if none."""
    step = self._manager.latest_step() if step is None else step
    if step is None:
      return None
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
    )
    return step, _join(restored["arrays"], restored["meta"])

  def wait(self) -> None:
    """Blocks until the background write (if any) is complete."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
  """What `restore_core` did.

  Attributes:
    step: the checkpoint's step (the core's merge counter when it was saved).
    versions: each fragment's version after the restore (republished ones included).
    republished: {fragment: (checkpoint version, journal version, new version)} for fragments whose
      journal was ahead of the checkpoint.
    lost_merges: merges published before the kill that the restored state lacks (the recovery point).
  """

  step: int
  versions: tuple[int, ...]
  republished: dict[int, tuple[int, int, int]]
  lost_merges: int


def restore_core(
  core: SyncerCore, checkpointer: SyncerCheckpointer, journal_path: str
) -> RestoreInfo | None:
  """Loads the newest checkpoint into `core` and moves its versions past the journal's.

  Every learner is marked not alive: they all re-register (their heartbeats say so), which resets
  what was delivered to them, so their next reports of a fragment weigh 0 until they have its
  restored version (SPEC §3).

  Returns:
    What was restored, or None if there is no checkpoint (a fresh start; the journal is ignored).

  Raises:
    ValueError: if the checkpoint does not fit the core's layout.
  """
  found = checkpointer.restore()
  if found is None:
    return None
  step, state = found
  core.load_state_dict(state)
  for learner_id in core.alive():
    core.leave(learner_id)
  journal = read_journal(journal_path)
  republished = {}
  lost = 0
  for p, newest in sorted(journal.items()):
    if not 0 <= p < core.num_fragments:
      raise ValueError(f"Merge journal names fragment {p}; the layout has {core.num_fragments}.")
    current = core.version(p)
    if newest > current:
      core.republish(p, newest + 1)
      republished[p] = (current, newest, newest + 1)
      lost += newest - current
  versions = tuple(core.version(p) for p in range(core.num_fragments))
  return RestoreInfo(step=step, versions=versions, republished=republished, lost_merges=lost)
