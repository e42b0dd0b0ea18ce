"""One learner's orbax checkpoints: inner optimizer state, data position and counters (docs/algorithm.md §6).

A restarted learner takes its parameters from the syncer's global fragments (docs/algorithm.md §6) and the rest of
its state from here. What a checkpoint holds, and why:

- **Inner optimizer state** (`opt_state`): the sharded AdamW moments and schedule count, saved and
  restored with their shardings (orbax `StandardSave`/`StandardRestore` against an abstract target
  built from `CompiledSteps.opt_shardings`, so a peer's state re-shards onto this learner's mesh).
- **Learner state** (`learner`, JSON): step, schedule step, cumulative tokens, the grain iterator's
  state, and the layout digest and optimizer signature that guard a restore.
- **The parameters only for export, never restored.** `LearnerWorker.connect` overwrites every
  leaf with the syncer's fragments (`Learner.load_global` never mixes), so a restarted learner's θ
  is the global model. `save_params` adds θ of the step boundary (`params`, saved as the optimizer
  state) for `ddiloco-export --learner` (checkpoint/learner_params.py); off, a checkpoint is a
  third smaller.
- **Not the per-fragment counters.** A restarted learner has received no fragment yet, so its reports
  weigh 0 until it has (docs/algorithm.md §3); `load_global` restarts the counters from that receipt.

Saves are asynchronous (orbax copies the arrays to host memory before `save` returns, so the next
train step may donate them) and atomic (orbax writes `<step>.orbax-checkpoint-tmp` and renames it
when complete; a crash mid-save leaves only that tmp folder, which restores ignore and the next
manager deletes). Restores follow the chain own → peer → fresh, starting at `init_from`; see
`LearnerCheckpointer.restore` and docs/resilience.md.

**Multi-process learners** (`group` given; learner_process/multihost.py): the learner's processes share one
checkpoint folder and call `save`, `restore` and `close` collectively, as orbax expects: each
process writes the shards of the global optimizer state that it holds (`ocdbt.process_<i>`),
process 0 (orbax's primary host) writes the JSON item and commits the step after a barrier, so a
committed step is complete for every process. The JSON item then also holds `data_per_process`
(each process's data iterator state, gathered to process 0 before the save) and `num_processes`;
the step, tokens and ledger are the leader's. Every decision a restore makes from the file system (which step, which
peer, which steps to discard) is process 0's, broadcast to the others: orbax's restores and deletes
are barriers, so every process must make the same calls in the same order.
"""

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from ddiloco import storage
from ddiloco.learner.train_step import CompiledSteps
from ddiloco.parallel.multihost import ProcessGroup
from ddiloco.types import PyTree, check_int_fields

log = logging.getLogger(__name__)

INIT_FROM = ("own", "peer", "fresh")
_CHAIN = {"own": ("own", "peer"), "peer": ("peer",), "fresh": ()}  # "fresh" ends every chain.
PARAMS_ITEM = "params"
LEARNER_DIR = re.compile(r"^learner_(\d+)$")  # A learner's folder in a run, or in `directory`.
_ITEMS = ("opt_state", "learner", PARAMS_ITEM)
FORMAT = 1


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
    save_params: also save the learner's parameters θ in each checkpoint (half again as large), to
      export them (`ddiloco-export --learner`). A restore never reads them: a restarted learner
      takes θ from the syncer (module docstring).
  """

  enabled: bool = True
  directory: str | None = None
  save_every_steps: int = 50
  max_to_keep: int = 2
  init_from: str = "own"
  save_params: bool = False

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    if self.save_every_steps < 1:
      raise ValueError(f"save_every_steps must be >= 1, got {self.save_every_steps}.")
    if self.max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep}.")
    if self.init_from not in INIT_FROM:
      raise ValueError(f"init_from must be one of {INIT_FROM}, got {self.init_from!r}.")

  def learner_directory(self, learner_id: int, workdir: str) -> str:
    """This learner's checkpoint folder (absolute)."""
    if self.directory is None:
      return storage.resolve(storage.join(workdir, "checkpoints"))
    return storage.resolve(storage.join(self.directory, f"learner_{learner_id}"))


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
    group: the learner's processes when it is several (module docstring): `workdir` must then be
      the learner's (process 0's), the same in every process. None: a one-process learner.
  """

  def __init__(
    self,
    config: LearnerCheckpointConfig,
    *,
    learner_id: int,
    workdir: str,
    opt_target: PyTree,
    layout_digest: str,
    group: ProcessGroup | None = None,
  ):
    self.config = config
    self._group = group if group is not None and group.num_processes > 1 else None
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
    params: PyTree | None = None,
  ) -> bool:
    """Starts an asynchronous save of `step`; returns False if that step is already saved.

    Blocks while a previous save is still being written (orbax waits for it) and while the arrays
    are copied to host memory; the files are written in the background. A multi-process learner's
    processes all call it at the same step (their step counters agree). `data_state` is this
    process's data iterator's; `params`, θ at `step` on the learner's mesh, is saved only with
    `config.save_params`, and then needed (ValueError without it).
    """
    if self.config.save_params and params is None:
      raise ValueError("save_params is set: a checkpoint needs the learner's parameters.")
    if self.has(step):
      return False
    per_process = None
    if self._group is not None:  # Each process's own position; process 0 writes them all.
      mine = json.dumps(None if data_state is None else dict(data_state)).encode()
      per_process = [json.loads(b) for b in self._group.gather(mine)]
    state = {
      "format": FORMAT,
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
    if per_process is not None:  # Only then: a one-process checkpoint keeps its format.
      state["num_processes"] = len(per_process)
      state["data_per_process"] = per_process
    items = {"opt_state": ocp.args.StandardSave(opt_state), "learner": ocp.args.JsonSave(state)}
    if self.config.save_params:  # Sharded as the optimizer state: each process writes its shards.
      items[PARAMS_ITEM] = ocp.args.StandardSave(params)
    self._manager.save(
      step,
      args=ocp.args.Composite(**items),
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

    A multi-process learner's processes call it together and all follow process 0's choices.

    Raises:
      ValueError: if this learner's own newest checkpoint belongs to another learner id, layout or
        optimizer (a configuration error, never silently skipped).
      RuntimeError: if a process of a multi-process learner does not see the step process 0 chose.
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
    step = self._agree(self._manager.latest_step())
    if step is None:
      return None
    self._expect_steps([step])
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
      data_state=self._my_data_state(state),
      tokens_trained=int(state["tokens_trained"]),
      ledger=state.get("ledger"),
    )

  def _my_data_state(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """This process's data position in a checkpoint's JSON item.

    A checkpoint of as many processes as this learner has gives each process its own entry.
    Otherwise (one process wrote it, or another count) every process takes `data`, process 0's:
    right as long as every process reads the learner's whole batch stream (GlobalBatches), so all
    positions are equal.
    """
    per_process = state.get("data_per_process")
    index = 0 if self._group is None else self._group.process_index
    count = 1 if self._group is None else self._group.num_processes
    if per_process is not None and len(per_process) == count:
      return per_process[index]
    if per_process is not None:
      log.warning(
        "learner %d: checkpoint of %d processes restored by %d: data position of process 0",
        self.learner_id,
        len(per_process),
        count,
      )
    return state["data"]

  def _discard_own(self) -> tuple[int, ...]:
    """Deletes own checkpoints: a new start's saves must not mix with an older incarnation's."""
    steps = tuple(self._agree(self.all_steps()))
    self._expect_steps(steps)
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
    if self._group is not None:
      return self._restore_agreed_peer()
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
    if root is None:
      return []
    out = []
    for path in storage.glob(storage.resolve(root), "learner_*"):
      m = LEARNER_DIR.match(os.path.basename(path))
      if m and int(m.group(1)) != self.learner_id:
        out.append((int(m.group(1)), path))
    return out

  # -- multi-process learners ---------------------------------------------------------------------

  def _agree(self, value: Any) -> Any:
    """Process 0's `value` (JSON-able) on every process; `value` itself with one process."""
    if self._group is None:
      return value
    payload = json.dumps(value).encode() if self._group.is_leader else b""
    return json.loads(self._group.share(payload).payload)

  def _expect_steps(self, steps: Sequence[int]) -> None:
    """Raises unless this process sees `steps` (process 0's choice) in the shared folder."""
    if self._group is None or set(steps) <= set(self._manager.all_steps()):
      return
    self._manager.reload()
    missing = sorted(set(steps) - set(self._manager.all_steps()))
    if missing:
      raise RuntimeError(
        f"Process {self._group.process_index} of learner {self.learner_id} does not see "
        f"checkpoint step(s) {missing} in {self.directory}, which process 0 found: the learner's "
        "processes must share one checkpoint folder (a file system every host mounts)."
      )

  def _restore_agreed_peer(self) -> Restored | None:
    """The peer step of a multi-process learner: process 0 picks it, every process restores it.

    Process 0 reads the candidates' JSON items through the handler (no barrier, unlike a
    manager's restore); the others wait for its choice. If the chosen step vanishes before every
    process has read it (the peer's max_to_keep), the restore raises on some process and the
    launcher restarts the learner, which then picks again.
    """
    choice = self._agree(self._choose_peer() if self._group.is_leader else None)
    if choice is None:
      return None
    peer_id, step = choice
    folder = self.config.learner_directory(peer_id, workdir="")  # Under `directory` (peers exist).
    mgr = _manager(folder, max_to_keep=None, read_only=True)
    try:
      opt = self._restore_opt(mgr, step)
    finally:
      mgr.close()
    return Restored(f"peer:{peer_id}:{step}", opt_state=opt)

  def _choose_peer(self) -> tuple[int, int] | None:
    """(peer id, step) of the newest usable peer checkpoint (ties: the lowest id), or None.

    Process 0 alone runs this, so it reads the folders with orbax's path helpers, never through a
    CheckpointManager (whose constructor and close synchronize every process).
    """
    name_format = ocp.path.step.standard_name_format()
    candidates = []  # (-step, peer id, step folder)
    for peer_id, folder in self._peer_dirs():
      newest = ocp.path.step.latest_step_metadata(epath.Path(folder), name_format)
      if newest is not None:  # Committed steps only: tmp folders of saves in flight never count.
        candidates.append((-newest.step, peer_id, newest.path))
    handler = ocp.JsonCheckpointHandler()
    for neg_step, peer_id, path in sorted(candidates):
      try:
        state = handler.restore(path / "learner")
      except FileNotFoundError:
        log.warning("learner %d: peer %d step %d vanished", self.learner_id, peer_id, -neg_step)
        continue
      problem = self._mismatch(state)
      if problem is not None:
        log.warning("learner %d: skipping peer %d: %s", self.learner_id, peer_id, problem)
        continue
      return peer_id, -neg_step
    return None

  def _mismatch(self, state: Mapping[str, Any]) -> str | None:
    if state.get("format") != FORMAT:
      return f"format {state.get('format')} != {FORMAT}"
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
