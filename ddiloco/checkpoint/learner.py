"""One learner's orbax checkpoints: inner optimizer state, data position and counters (SPEC §6).

A restarted learner takes its parameters from the syncer's global fragments (SPEC §6) and the rest of
its state from here. What a checkpoint holds, and why:

- **Inner optimizer state** (`opt_state`): the sharded AdamW moments and schedule count, saved and
  restored with their shardings (orbax `StandardSave`/`StandardRestore` against an abstract target
  built from `CompiledSteps.opt_shardings`, so a peer's state re-shards onto this learner's mesh).
- **Learner state** (`learner`, JSON): step, schedule step, cumulative tokens, the grain iterator's
  state, and the layout digest and optimizer signature that guard a restore.
- **Not the parameters.** `LearnerWorker.connect` overwrites every leaf with the syncer's fragments
  (the layout covers the whole tree, and `Learner.load_global` never mixes, whatever α), so saved
  parameters would never be read; leaving them out makes a checkpoint a third smaller.
- **Not the per-fragment counters.** A restarted learner has received no fragment yet, so its reports
  weigh 0 until it has (SPEC §3); `load_global` restarts the counters from that receipt.

Saves are asynchronous (orbax copies the arrays to host memory before `save` returns, so the next
train step may donate them) and atomic (orbax writes `<step>.orbax-checkpoint-tmp` and renames it
when complete; a crash mid-save leaves only that tmp folder, which restores ignore and the next
manager deletes). Restores follow the chain own → peer → fresh, starting at `init_from`; see
`LearnerCheckpointer.restore` and docs/resilience.md.
"""

import dataclasses
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import gin
import jax
import orbax.checkpoint as ocp

from ddiloco.learner.train_step import CompiledSteps
from ddiloco.types import PyTree

log = logging.getLogger(__name__)

INIT_FROM = ("own", "peer", "fresh")
_CHAIN = {"own": ("own", "peer"), "peer": ("peer",), "fresh": ()}  # "fresh" ends every chain.
_ITEMS = ("opt_state", "learner")
_LEARNER_DIR = re.compile(r"^learner_(\d+)$")
_FORMAT = 1


@gin.configurable(module="ddiloco")
@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerCheckpointConfig:
  """Where and how often a learner checkpoints, and where a restarted learner restores from.

  Attributes:
    enabled: save checkpoints and restore at start.
    directory: a root shared by the learners of a run: learner m writes `<directory>/learner_<m>`
      and a learner without its own checkpoint may take a peer's from there. None: each learner
      writes `<workdir>/checkpoints` and has no peers.
    save_every_steps: steps between saves (a graceful stop saves too).
    max_to_keep: newest checkpoints kept (>= 2 keeps one for a peer reading while the next lands).
    init_from: where the restore chain own → peer → fresh starts. "own": this learner's newest
      checkpoint; "peer": the newest checkpoint of another learner under `directory` (its inner
      optimizer state only); "fresh": nothing. A step of the chain that finds nothing falls through
      to the next. Starting at "peer" or "fresh" discards this learner's own checkpoints.
  """

  enabled: bool = True
  directory: str | None = None
  save_every_steps: int = 50
  max_to_keep: int = 2
  init_from: str = "own"

  def __post_init__(self):
    if self.save_every_steps < 1:
      raise ValueError(f"save_every_steps must be >= 1, got {self.save_every_steps}.")
    if self.max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep}.")
    if self.init_from not in INIT_FROM:
      raise ValueError(f"init_from must be one of {INIT_FROM}, got {self.init_from!r}.")

  def learner_directory(self, learner_id: int, workdir: str) -> str:
    """This learner's checkpoint folder (absolute)."""
    if self.directory is None:
      return os.path.abspath(os.path.join(workdir, "checkpoints"))
    return os.path.abspath(os.path.join(self.directory, f"learner_{learner_id}"))


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restore found.

  Attributes:
    restored_from: "own:<step>", "peer:<id>:<step>" or "fresh".
    step: the learner's step to resume at (0 unless restored from its own checkpoint).
    opt_state: the inner optimizer state on this learner's mesh, or None (fresh).
    data_state: the data iterator's state, or None (start of the shard).
    tokens_trained: cumulative tokens at `step`.
    discarded_steps: own checkpoints deleted because the chain started past "own".
    ledger: the token ledger's state at `step` (learner/ledger.py), or None.
  """

  restored_from: str
  step: int = 0
  opt_state: PyTree | None = None
  data_state: dict[str, Any] | None = None
  tokens_trained: int = 0
  discarded_steps: tuple[int, ...] = ()
  ledger: dict[str, Any] | None = None


def abstract_opt_state(steps: CompiledSteps, params: PyTree) -> PyTree:
  """The optimizer state's shapes, dtypes and shardings on `steps`' mesh: orbax's restore target."""
  shapes = jax.eval_shape(steps.init_opt_state, params)
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, steps.opt_shardings
  )


def opt_signature(opt_target: PyTree) -> str:
  """Hash of the optimizer state's tree structure, shapes and dtypes (not its shardings)."""
  leaves, treedef = jax.tree_util.tree_flatten(opt_target)
  h = hashlib.sha256(str(treedef).encode())
  for leaf in leaves:
    h.update(f"{leaf.shape}|{leaf.dtype};".encode())
  return h.hexdigest()[:32]


def _manager(directory: str, *, max_to_keep: int | None, read_only: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
    read_only=read_only,
    create=not read_only,
    # Own folder only: a crash mid-save left a tmp folder. Never in a peer's (read_only), where a
    # tmp folder is the save that peer is writing right now.
    cleanup_tmp_directories=not read_only,
    enable_async_checkpointing=True,
    preservation_policy=None if read_only else ocp.checkpoint_managers.LatestN(max_to_keep),
  )
  return ocp.CheckpointManager(directory, item_names=_ITEMS, options=options)


class LearnerCheckpointer:
  """Saves and restores one learner's checkpoints (see module docstring).

  Only the thread that owns the learner's arrays (the training thread) may call `save`.

  Args:
    config: the checkpoint config (`enabled` is the caller's business).
    learner_id: this learner's id; its folder is `config.learner_directory(learner_id, workdir)`.
    workdir: the learner's output folder.
    opt_target: `abstract_opt_state(steps, params)` on this learner's mesh.
    layout_digest: the fragment layout's digest; a checkpoint of another layout is refused.
  """

  def __init__(
    self,
    config: LearnerCheckpointConfig,
    *,
    learner_id: int,
    workdir: str,
    opt_target: PyTree,
    layout_digest: str,
  ):
    self.config = config
    self.learner_id = learner_id
    self.directory = config.learner_directory(learner_id, workdir)
    self._opt_target = opt_target
    self._layout_digest = layout_digest
    self._signature = opt_signature(opt_target)
    self._manager = _manager(self.directory, max_to_keep=config.max_to_keep, read_only=False)
    self.saved_steps: list[int] = []  # Steps this process saved.

  # -- saving ---------------------------------------------------------------------------------

  def due(self, step: int) -> bool:
    """True at every `save_every_steps`-th step not saved yet."""
    return step > 0 and step % self.config.save_every_steps == 0 and not self.has(step)

  def has(self, step: int) -> bool:
    """True if a checkpoint of `step` exists or this process is writing it."""
    return step in self._manager.all_steps()

  def save(
    self,
    step: int,
    *,
    opt_state: PyTree,
    data_state: Mapping[str, Any] | None,
    tokens_trained: int,
    schedule_step: int,
    ledger: Mapping[str, Any] | None = None,
  ) -> bool:
    """Starts an asynchronous save of `step`; returns False if that step is already saved.

    Blocks while a previous save is still being written (orbax waits for it) and while the arrays
    are copied to host memory; the files are written in the background.
    """
    if self.has(step):
      return False
    state = {
      "format": _FORMAT,
      "learner_id": self.learner_id,
      "step": step,
      "schedule_step": schedule_step,
      "tokens_trained": tokens_trained,
      "layout_digest": self._layout_digest,
      "opt_signature": self._signature,
      "data": None if data_state is None else dict(data_state),
      "ledger": None if ledger is None else dict(ledger),
      "time": time.time(),
    }
    self._manager.save(
      step,
      args=ocp.args.Composite(
        opt_state=ocp.args.StandardSave(opt_state), learner=ocp.args.JsonSave(state)
      ),
      force=True,  # The caller decides when (due); orbax's own interval policy is not used.
    )
    self.saved_steps.append(step)
    return True

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step (tmp folders of interrupted saves never count)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def wait(self) -> None:
    """Blocks until the pending save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the pending save and releases the manager."""
    self._manager.close()

  # -- restoring ------------------------------------------------------------------------------

  def restore(self) -> Restored:
    """Restores along the chain own → peer → fresh, starting at `config.init_from`.

    - own: the newest complete checkpoint in this learner's folder: step, inner optimizer state,
      data position and cumulative tokens.
    - peer: the checkpoint with the highest step among the other learners' folders under
      `config.directory` (ties: the lowest id), same layout and optimizer only. Only its inner
      optimizer state is taken (so the learning-rate schedule and Adam moments continue where the
      fleet is); step and data position stay at 0: a learner never takes a peer's data position, it
      keeps its own shard, and without its own checkpoint it cannot know where it stopped, so it
      starts its shard again (repeating rather than skipping data).
    - fresh: nothing (a new optimizer state, step 0, the start of the shard).

    Raises:
      ValueError: if this learner's own newest checkpoint belongs to another learner id, layout or
        optimizer (a configuration error, never silently skipped).
    """
    chain = _CHAIN[self.config.init_from]
    discarded: tuple[int, ...] = ()
    if "own" in chain:
      own = self._restore_own()
      if own is not None:
        return own
    else:
      discarded = self._discard_own()
    if "peer" in chain:
      peer = self._restore_peer()
      if peer is not None:
        return dataclasses.replace(peer, discarded_steps=discarded)
    return Restored("fresh", discarded_steps=discarded)

  def _restore_own(self) -> Restored | None:
    step = self._manager.latest_step()
    if step is None:
      return None
    state = self._manager.restore(step, args=ocp.args.Composite(learner=ocp.args.JsonRestore()))
    state = state.learner
    problem = self._mismatch(state)
    if problem is None and state["learner_id"] != self.learner_id:
      problem = f"it was written by learner {state['learner_id']}"
    if problem is not None:
      raise ValueError(f"Checkpoint {self.directory}/{step} cannot be restored: {problem}.")
    opt = self._restore_opt(self._manager, step)
    return Restored(
      f"own:{step}",
      step=int(state["step"]),
      opt_state=opt,
      data_state=state["data"],
      tokens_trained=int(state["tokens_trained"]),
      ledger=state.get("ledger"),
    )

  def _discard_own(self) -> tuple[int, ...]:
    """Deletes own checkpoints: a new start's saves must not mix with an older incarnation's."""
    steps = tuple(self.all_steps())
    for step in steps:
      self._manager.delete(step)
    if steps:
      log.warning(
        "learner %d: init_from=%r discards own checkpoints %s",
        self.learner_id,
        self.config.init_from,
        steps,
      )
    return steps

  def _restore_peer(self) -> Restored | None:
    managers = {p: _manager(d, max_to_keep=None, read_only=True) for p, d in self._peer_dirs()}
    try:
      return self._restore_newest_peer(managers)
    finally:
      for mgr in managers.values():
        mgr.close()

  def _restore_newest_peer(self, managers: dict[int, ocp.CheckpointManager]) -> Restored | None:
    candidates = []  # (-step, peer id): the highest step first, then the lowest id.
    for peer_id, mgr in managers.items():
      step = mgr.latest_step()
      if step is not None:
        candidates.append((-step, peer_id))
    for neg_step, peer_id in sorted(candidates):
      mgr = managers[peer_id]
      step = -neg_step
      try:
        state = mgr.restore(step, args=ocp.args.Composite(learner=ocp.args.JsonRestore())).learner
        problem = self._mismatch(state)
        if problem is not None:
          log.warning("learner %d: skipping peer %d: %s", self.learner_id, peer_id, problem)
          continue
        opt = self._restore_opt(mgr, step)
      except (FileNotFoundError, ValueError, OSError):
        mgr.reload()
        if step in mgr.all_steps():
          raise
        # The peer deleted that step while we read it (max_to_keep): try the next candidate.
        log.warning("learner %d: peer %d step %d vanished", self.learner_id, peer_id, step)
        continue
      return Restored(f"peer:{peer_id}:{step}", opt_state=opt)
    return None

  def _peer_dirs(self) -> list[tuple[int, str]]:
    root = self.config.directory
    if root is None or not os.path.isdir(root):
      return []
    out = []
    for name in sorted(os.listdir(root)):
      m = _LEARNER_DIR.match(name)
      if m and int(m.group(1)) != self.learner_id:
        out.append((int(m.group(1)), os.path.abspath(os.path.join(root, name))))
    return out

  def _mismatch(self, state: Mapping[str, Any]) -> str | None:
    if state.get("format") != _FORMAT:
      return f"format {state.get('format')} != {_FORMAT}"
    if state.get("layout_digest") != self._layout_digest:
      return f"layout digest {state.get('layout_digest')} != {self._layout_digest}"
    if state.get("opt_signature") != self._signature:
      return "its inner optimizer state has another structure, shapes or dtypes"
    return None

  def _restore_opt(self, mgr: ocp.CheckpointManager, step: int) -> PyTree:
    restored = mgr.restore(
      step, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(self._opt_target))
    )
    return restored.opt_state
