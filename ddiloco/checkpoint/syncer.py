"""The syncer's durable state: orbax checkpoints of the whole core plus a merge journal (docs/algorithm.md §6).

A syncer killed at any moment restarts from two things in its workdir:

- **Checkpoints** (`SyncerCheckpointer`): the core's whole `state_dict()` (kept versions of every
  fragment, outer optimizer states, open rounds with their reports, membership, counters, grace EMAs),
  written asynchronously by orbax every `every_s` seconds and at shutdown. Orbax writes into a
  temporary directory and renames it when complete, so a kill mid-save leaves the previous checkpoint;
  the next start removes the temporary directory.
- **The merge journal** (`MergeJournal`): one line per published version, (fragment, version,
  digest), written and fsync'd before the version is served to any learner. It says which versions
  the learners may hold, and which digest each has.

`restore_core` loads the newest intact checkpoint: one that orbax can read and whose kept versions
have the digests the journal recorded for them (unreadable or mismatching steps are set aside, with a
log line, and an older step is tried). Each fragment whose journal is ahead of the restored state is
then taken back from the version log (checkpoint/version_log.py) or from a learner, or published
again as version journal + 1 with the restored values, also when there is no checkpoint at all (the
initial values): versions stay monotonic for every learner, and a learner holding a lost version
pulls the restored values in full. With the version log the recovery point is zero merges; without
it, the merges since the last checkpoint that no learner hands back (docs/resilience.md).
"""

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from ddiloco.checkpoint.journal import (
  JOURNAL_NAME,
  MergeJournal,
  read_journal,
  read_journal_records,
)
from ddiloco.checkpoint.version_log import VERSION_LOG_DIR, VersionLog
from ddiloco.fragments.digest import values_digest
from ddiloco.syncer.core import SyncerCore

log = logging.getLogger(__name__)

# Re-exported: the journal's names have always been reached through this module.
__all__ = [
  "JOURNAL_NAME",
  "VERSION_LOG_DIR",
  "MergeJournal",
  "RestoreError",
  "RestoreInfo",
  "SyncerCheckpointConfig",
  "SyncerCheckpointer",
  "VersionLog",
  "WorkdirMismatch",
  "quiet_orbax_logs",
  "read_journal",
  "read_journal_records",
  "remove_partial_saves",
  "restore_core",
]

PARTIAL_MARK = ".orbax-checkpoint-tmp"  # In the name of orbax's folders of a save not yet complete.
UNUSABLE_DIR = "unusable"  # Steps a restore could not use are moved here (kept for inspection).


def remove_partial_saves(directory: str) -> list[str]:
  """Deletes the folders of saves that never completed (a kill mid-save); returns their paths."""
  if not os.path.isdir(directory):
    return []
  removed = []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if PARTIAL_MARK in name and os.path.isdir(path):
      shutil.rmtree(path)
      removed.append(path)
      log.warning("removed %s: a syncer checkpoint save that never completed", path)
  return removed


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncerCheckpointConfig:
  """How the syncer persists its state. Bound from gin as `ddiloco.SyncerCheckpointConfig.<field>`.

  Attributes:
    enabled: write checkpoints and the merge journal, and restore from them at start.
    every_s: seconds between checkpoints (only when something merged since the last one). The
      recovery point: at most the merges of the last `every_s` seconds are lost to a kill.
    max_to_keep: checkpoints kept on disk (older ones are deleted after a newer one is complete).
    recovery_window_s: after a restart that lost merges (the journal is ahead of the checkpoint),
      how long the syncer waits for a learner to hand back the newest versions before it
      republishes the restored values past them; 0 republishes at once.
    version_log: write the values of every published version before serving it
      (checkpoint/version_log.py): a restart then loses no merge, at the cost of one write of
      each merged fragment. Off: the merges since the last checkpoint are taken back from the
      learners that hold them, or lost.
    subdir: folder under the syncer's workdir.
  """

  enabled: bool = True
  every_s: float = 5.0
  max_to_keep: int = 2
  recovery_window_s: float = 20.0
  version_log: bool = True
  subdir: str = "checkpoints"

  def __post_init__(self):
    if not self.every_s > 0:
      raise ValueError(f"every_s must be > 0, got {self.every_s}.")
    if not 0 <= self.recovery_window_s < float("inf"):
      raise ValueError(f"recovery_window_s must be finite and >= 0, got {self.recovery_window_s}.")
    if self.max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep}.")
    if not self.subdir or os.path.isabs(self.subdir) or ".." in self.subdir.split(os.sep):
      raise ValueError(f"subdir must be a relative folder name, got {self.subdir!r}.")


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

  Opening one removes the folders of saves a kill left unfinished (`remove_partial_saves`).

  Args:
    directory: where checkpoints go (one sub-folder per step, written by orbax).
    max_to_keep: complete checkpoints kept.
    read_only: only read (`restore`, `all_steps`): nothing is removed or created, so another
      process's syncer may be writing there (`ddiloco.checkpoint.global_model`).
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.removed_partial = [] if read_only else remove_partial_saves(self.directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      enable_async_checkpointing=not read_only,
      create=not read_only,
      read_only=read_only,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Mapping[str, Any]) -> None:
    """Starts writing `state` as `step` in the background (waits for the previous write first).

    `state` must not be mutated afterwards: `state_dict()` returns copies, so that holds. The
    metadata carries a digest of all arrays, which `restore` checks.
    """
    arrays, meta = _split(state)
    meta["saved_at"] = time.time()
    meta["arrays_digest"] = values_digest(arrays)
    self._manager.save(
      step,
      args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
    )

  def restore(self, step: int | None = None) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of checkpoint `step` (default the newest complete one), or None if none.

    Raises:
      ValueError: if the arrays do not have the digest saved with them (corrupt files); orbax's
        own errors if the step cannot be read at all.
    """
    step = self._manager.latest_step() if step is None else step
    if step is None:
      return None
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
    )
    arrays, meta = restored["arrays"] or {}, restored["meta"]
    expected = meta.get("arrays_digest")  # Absent in checkpoints written before it was added.
    if expected is not None and values_digest(arrays) != expected:
      raise ValueError(f"checkpoint {step}: its arrays do not match the digest saved with them")
    return step, _join(arrays, meta)

  def set_aside(self, step: int) -> str:
    """Moves an unusable step out of orbax's sight into `unusable/`; returns where it went.

    Later saves may then reuse the step number, and `max_to_keep` never counts it.
    """
    self._manager.wait_until_finished()
    dest = os.path.join(self.directory, UNUSABLE_DIR, f"{step}-{int(time.time() * 1000)}")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.rename(os.path.join(self.directory, str(step)), dest)
    self._manager.reload()
    return dest

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
    step: the checkpoint's step (the core's merge counter when it was saved); -1 if there was no
      checkpoint and the versions were moved past the journal from the initial values.
    versions: each fragment's version after the restore (republished ones included).
    republished: {fragment: (restored version, journal version, new version)} for fragments whose
      journal was ahead of the restored state.
    lost_merges: journaled versions newer than the restored state with other values: the merges
      published before the kill that it lacks (the recovery point).
    unusable_steps: newer checkpoints that could not be used (unreadable, or contradicting the
      journal's digests), newest first; they were moved to `unusable/`.
    to_recover: with `defer=True`, {fragment: (journal version, its digest, restored version,
      merges lost unless it is taken back)} for fragments left at their restored version, to be
      taken back from a learner that still holds the journal version
      (`SyncerService.begin_recovery`), or republished if none does.
    from_log: {fragment: (checkpoint version, journal version, merges since the checkpoint)} for
      fragments whose journal version was taken back from the version log (nothing lost).
  """

  step: int
  versions: tuple[int, ...]
  republished: dict[int, tuple[int, int, int]]
  lost_merges: int
  unusable_steps: tuple[int, ...] = ()
  to_recover: dict[int, tuple[int, str, int, int]] = dataclasses.field(default_factory=dict)
  from_log: dict[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)


class RestoreError(ValueError):
  """No usable state: checkpoints exist, none is intact, and the journal says versions were served."""


class WorkdirMismatch(ValueError):
  """The workdir holds another syncer's state: another model, fragment layout or shard."""


def restore_core(
  core: SyncerCore,
  checkpointer: SyncerCheckpointer,
  journal_path: str,
  *,
  defer: bool = False,
  version_log: VersionLog | None = None,
) -> RestoreInfo | None:
  """Loads the newest intact checkpoint into `core` and moves its versions past the journal's.

  A step is intact if orbax reads it, its arrays have the digest saved with them, and each kept
  version of each fragment has the digest the journal recorded for it (version 0: the initial
  values' digest, which `core` must still hold). Newer steps that are not intact are logged and
  moved to `unusable/`. Without any checkpoint, `core`'s initial values are kept. Then every
  fragment whose journal is ahead is republished as journal version + 1, and that version is
  journaled (durably) before anything is served. Every learner is marked not alive: they all
  re-register (their heartbeats say so), which resets what was delivered to them, so their next
  reports of a fragment weigh 0 until they have its restored version (docs/algorithm.md §3).

  With `defer`, a fragment whose newest journaled version has other values than the restored ones
  (a merge the kill lost) is not republished but left at its restored version and listed in
  `to_recover`: the service first asks the learners for that version (they hold bit-identical
  copies, checked against the journal's digest), and republishes only if none has it.

  With a `version_log`, a fragment whose newest journaled version is in the log with the journal's
  digest takes that version back first (listed in `from_log`): no merge of it is lost.

  Returns:
    What was restored, or None on a fresh start: no usable checkpoint and an empty journal.

  Raises:
    RestoreError: if checkpoints exist but none is intact while the journal holds versions.
    WorkdirMismatch: if a checkpoint or the journal does not fit the core's layout (another
      model, fragment count or syncer shard).
    OSError: if the republished versions cannot be journaled.
  """
  journal = read_journal_records(journal_path)
  for p in journal:
    if not 0 <= p < core.num_fragments:
      raise WorkdirMismatch(
        f"Merge journal {journal_path} names fragment {p}; the layout has {core.num_fragments}."
      )
    if not core.owns(p):
      raise WorkdirMismatch(
        f"Merge journal {journal_path} names fragment {p}, which this syncer shard does not own: "
        "it was written by another shard, or with another shard count."
      )
  initial = {p: core.state(p).digest for p in range(core.num_fragments) if core.version(p) == 0}
  step, unusable = _load_newest_intact(core, checkpointer, journal, initial)
  if step is None and unusable and journal:
    raise RestoreError(
      f"No intact syncer checkpoint in {checkpointer.directory} (steps "
      f"{', '.join(map(str, unusable))} unusable, see the log) while the merge journal records "
      "served versions: restore a good checkpoint there, or start in a fresh workdir."
    )
  for s in unusable:
    log.warning("syncer checkpoint %d set aside in %s", s, checkpointer.set_aside(s))
  if step is None and not journal:
    return None
  if step is None:
    log.warning(
      "no syncer checkpoint, but the merge journal records versions: starting from the initial "
      "values, published past the journal's versions"
    )
  for learner_id in core.alive():
    core.leave(learner_id)
  republished = {}
  to_recover = {}
  from_log = {}
  lost = 0
  fresh = {}
  for p, records in sorted(journal.items()):
    current, newest = core.version(p), max(records)
    if newest > current:
      # The newest journaled version may hold the restored values already (a restart that
      # republished them and merged nothing since): it is taken as it is, not published again.
      digest = core.state(p).digest
      lost_p = sum(1 for v, d in records.items() if v > current and d != digest)
      if version_log is not None and records[newest] is not None and records[newest] != digest:
        values = version_log.read(p, newest, records[newest])
        if values is not None:
          try:
            core.recover(p, newest, values, records[newest])
          except ValueError as e:  # Another layout's file: the fallbacks below take over.
            log.warning("version log: version %d of fragment %d not taken back: %s", newest, p, e)
          else:
            from_log[p] = (current, newest, lost_p)
            continue
      lost += lost_p
      if defer and records[newest] is not None and records[newest] != digest:
        to_recover[p] = (newest, records[newest], current, lost_p)
        continue
      new = newest if records[newest] == digest else newest + 1
      core.republish(p, new)
      republished[p] = (current, newest, new)
      if new > newest:
        fresh[p] = current
  if fresh:
    out = MergeJournal(journal_path)
    try:
      for p, current in fresh.items():
        state = core.state(p)
        if version_log is not None:
          version_log.write(p, state.version, state.values, state.digest)
        out.record(p, state.version, state.digest, republished_from=current)
    finally:
      out.close()
  if from_log:
    log.info(
      "syncer took %d fragments back from its version log (%d merges since the checkpoint)",
      len(from_log),
      sum(n for _, _, n in from_log.values()),
    )
  versions = tuple(core.version(p) for p in range(core.num_fragments))
  return RestoreInfo(
    step=-1 if step is None else step,
    versions=versions,
    republished=republished,
    lost_merges=lost,
    unusable_steps=tuple(unusable),
    to_recover=to_recover,
    from_log=from_log,
  )


def _load_newest_intact(
  core: SyncerCore,
  checkpointer: SyncerCheckpointer,
  journal: Mapping[int, Mapping[int, str | None]],
  initial: Mapping[int, str],
) -> tuple[int | None, list[int]]:
  """Loads the newest intact step into `core`: (its step or None, the newer unusable steps)."""
  unusable: list[int] = []
  for step in reversed(checkpointer.all_steps()):
    try:
      _, state = checkpointer.restore(step)
    # A damaged step fails inside orbax, tensorstore or the JSON parser with many exception
    # types; each is logged, and the step is passed over for an older one.
    except Exception as e:
      problem = f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    else:
      if state.get("layout_fingerprint") != core.layout_fingerprint():
        raise WorkdirMismatch(
          f"Syncer checkpoint {step} in {checkpointer.directory} was written for a different "
          "fragment layout (another model, fragment count, or syncer shard?)."
        )
      problem = _contradiction(core, state, journal, initial)
      if problem is None:
        try:
          core.load_state_dict(state)  # Leaves `core` as it was if it raises.
        except (ValueError, KeyError) as e:
          problem = f"does not load ({type(e).__name__}: {e})"
    if problem is None:
      if unusable:
        log.warning("syncer restored from the older checkpoint %d", step)
      return step, unusable
    log.warning("syncer checkpoint %d is unusable: %s; trying an older one", step, problem)
    unusable.append(step)
  return None, unusable


def _contradiction(
  core: SyncerCore,
  state: Mapping[str, Any],
  journal: Mapping[int, Mapping[int, str | None]],
  initial: Mapping[int, str],
) -> str | None:
  """Why `state`'s kept fragment values are not what was published, or None if they are.

  Compares each kept version's digest with the journal's record of it (version 0: the initial
  values); versions without a record are not checked. Optimizer states and open rounds carry no
  published digest: the arrays' digest in the metadata covers them against damage only.
  """
  for p in range(core.num_fragments):
    keys = list(core.state(p).values)
    pre = f"fragment/{p}/"
    try:
      kept = [int(v) for v in state[pre + "kept_versions"]]
      for v in kept:
        expected = journal.get(p, {}).get(v, initial.get(p) if v == 0 else None)
        if expected is None:
          continue
        digest = values_digest({k: state[f"{pre}v{v}/{k}"] for k in keys})
        if digest != expected:
          return (
            f"fragment {p} version {v} has digest {digest}, the merge journal {expected} "
            "(tampered or damaged)"
          )
    except KeyError as e:
      return f"lacks entry {e}"
  return None
