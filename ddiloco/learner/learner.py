"""One learner's state and its side of the fragment protocol (SPEC §3), free of transports and clocks.

The simulated cluster and the learner process both drive this object:

  learner.train_step(batch)                 # inner AdamW step; counters[p] += tokens, steps  ∀p
  for p in learner.due():                   # fragments due after this step
    result = send(learner.make_report(p))   # host copy of θ_p + counters + anchor version
    learner.on_report_result(p, result)
  learner.receive(fragment_state)           # whenever a merged fragment arrives
  learner.apply_ready()                     # applies Θ_p once step >= send step + τ

Decisions (SPEC §3 and docs/algorithm.md):
- A merged fragment is applied at the first step >= (the learner's last send of p) + τ, using the newest
  version received by then. A version that arrives while the learner has no outstanding send of p is
  held until its next send + τ, so a learner's own progress on p is overwritten only after it was sent.
- Counters of p reset to zero when a fragment is applied *and* the learner's last report of p was
  accepted; a dropped (late) report keeps them growing so its next report weighs more (SPEC §4).
- α = 0 overwrites θ_p with Θ_p (Decoupled DiLoCo); α = 0.5 mixes as Streaming DiLoCo.
"""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.layout import FragmentLayout
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.ledger import TokenLedger
from ddiloco.learner.train_step import CompiledSteps
from ddiloco.syncer.core import FragmentState, Report, ReportResult
from ddiloco.types import PyTree

_ACCEPTED = ("accepted", "superseded")


@gin.configurable(module="ddiloco")
@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Learner-side protocol knobs.

  Attributes:
    mixing_alpha: θ_p ← (1 − α)·Θ_p + α·θ_p on apply (SPEC §3); 0 overwrites.
    blocking: wait at the apply step until a newer version of p has arrived. True only for the
      synchronous baselines (DiLoCo, Streaming DiLoCo); Decoupled DiLoCo never waits.
  """

  mixing_alpha: float = 0.0
  blocking: bool = False

  def __post_init__(self):
    if not 0.0 <= self.mixing_alpha < 1.0:
      raise ValueError(f"mixing_alpha must be in [0, 1), got {self.mixing_alpha}.")


@dataclasses.dataclass
class _Outstanding:
  send_step: int
  apply_step: int
  accepted: bool | None = None  # None until the syncer answered.


class Learner:
  """Parameters, inner optimizer state and per-fragment bookkeeping of one learner.

  Args:
    learner_id: this learner's id at the syncer.
    steps: the compiled train/eval steps for this learner's mesh.
    params: initial parameters, placed with `steps.param_shardings`.
    layout: the fragment layout (identical on every learner and the syncer).
    schedule: when each fragment is due and τ.
    config: protocol knobs.
  """

  def __init__(
    self,
    *,
    learner_id: int,
    steps: CompiledSteps,
    params: PyTree,
    layout: FragmentLayout,
    schedule: FragmentSchedule,
    config: LearnerConfig | None = None,
  ):
    if schedule.num_fragments != layout.num_fragments:
      raise ValueError(
        f"schedule has {schedule.num_fragments} fragments but the layout has {layout.num_fragments}."
      )
    self.learner_id = learner_id
    self.steps = steps
    self.layout = layout
    self.schedule = schedule
    self.config = config or LearnerConfig()
    self.params = params
    self.opt_state = steps.init_opt_state(params)
    self.step = 0
    self.phase = 0  # Schedule offset: fragments are due at step + phase (see align_phase).
    self._last_due = 0  # Largest schedule step that `due` answered for.
    num = layout.num_fragments
    self.tokens = np.zeros(num, np.int64)  # SPEC §3 counters[p].tokens
    self.step_counts = np.zeros(num, np.int64)  # SPEC §3 counters[p].steps
    self.anchor = np.full(num, -1, np.int64)  # Version of p last applied; -1 = never received.
    self.applied_digest: dict[int, str] = {}  # p -> digest of θ_p read back after an α = 0 apply.
    self.ledger = TokenLedger(num)  # Where each trained token went (ledger.py).
    self._inbox: dict[int, FragmentState] = {}
    self._outstanding: dict[int, _Outstanding] = {}
    leaves, self._treedef = jax.tree_util.tree_flatten_with_path(params)
    self._index = {tree.path_str(path): i for i, (path, _) in enumerate(leaves)}
    self._shardings = jax.tree_util.tree_leaves(
      steps.param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    # The leaves each fragment touches (split tensors are keyed "path@start:stop"; SPEC §2).
    self._leaf_names = [
      sorted({layout_lib.parse_key(k)[0] for k in keys}) for keys in layout.fragments
    ]
    # Makes device arrays readable on this host before a host copy. None (one process): they are.
    # A multi-process learner replicates them (a collective, so every process reads in the same
    # order): parallel/multihost.py ProcessGroup.replicate.
    self.host_readable: Callable[[list[jax.Array]], list[jax.Array]] | None = None
    # How `snapshot_report` keeps θ_p past the next step, which donates the parameters. On GPU
    # and TPU an on-device copy is dispatched asynchronously. XLA's CPU client runs a computation
    # as cheap as a copy inline on the calling thread, so there the copy waits for the step that
    # makes θ_p and the training loop loses its step in flight (bench_learner_overhead.py): on
    # CPU the snapshot holds θ_p's arrays themselves and the next step keeps its input parameters.
    devices = jax.tree_util.tree_leaves(params)[0].sharding.device_set if self._index else set()
    self.snapshot_by_reference = all(d.platform == "cpu" for d in devices)
    self._keep_params = False  # The next train step must not donate the parameters.
    # Digest checks of applies (SPEC §4.7): read back at once, or, with `defer_digests` on CPU
    # (snapshot_by_reference; a learner process sets it), once the written arrays are ready: the
    # read-back waited there for the step in flight, like the snapshot's copy. `verified_applies`
    # hands the checks out in apply order.
    self.defer_digests = False
    self._unverified: list[tuple[int, int, list[jax.Array]]] = []  # (p, version, θ_p's arrays).
    self._verified: list[tuple[int, int, str | None]] = []  # (p, version, digest; None: mixed).

  def _readable(self, arrays: list[jax.Array]) -> list[jax.Array]:
    return arrays if self.host_readable is None else self.host_readable(arrays)

  # -- training -------------------------------------------------------------------------------

  def train_step(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """One inner step on `batch`; metrics stay on device (read them lazily)."""
    # Arrays awaiting a digest check must outlive the step too.
    keep, self._keep_params = self._keep_params or bool(self._unverified), False
    self.params, self.opt_state, metrics = self.steps.train(
      self.params, self.opt_state, self.steps.put_batch(batch), keep_params=keep
    )
    self.step += 1
    ntok = int(np.prod(batch["targets"].shape))
    self.tokens += ntok
    self.step_counts += 1
    self.ledger.train(ntok)
    return metrics

  # -- sending --------------------------------------------------------------------------------

  @property
  def schedule_step(self) -> int:
    """The step on the fleet's schedule: this learner's step plus its phase offset."""
    return self.step + self.phase

  def align_phase(self, fleet_step: int) -> None:
    """Shifts the schedule so that this learner's next step is the fleet's next one.

    Called at (re)join with the syncer's `fleet_step`: SPEC §2's due steps are a fleet-wide cadence,
    and a learner that rejoined with its old step count would send every fragment out of phase. Only
    the schedule moves; the step count (and the inner learning-rate schedule) are the learner's own.
    """
    self.phase = max(fleet_step, 0) - self.step
    self._last_due = (
      self.schedule_step
    )  # A realignment starts a fresh cadence (nothing is outstanding).

  def follow(self, cadence_step: int, *, tolerance: int = 2) -> int:
    """Keeps this learner's schedule in phase with the fleet's cadence; returns the phase change.

    Real learners start seconds apart and run at different, noisy speeds, so their schedules drift
    apart; with K = 1 each would then open every round alone and its reports go stale
    (docs/algorithm.md, "phase"). At least `tolerance` steps behind, the schedule jumps forward (the
    skipped sends' counters keep growing: nothing is lost). At least `tolerance` steps ahead, the
    schedule holds still for this step (phase − 1): no fragment is due until it moves past the last
    step that sent, so a fragment is never sent twice for one schedule step (`due`).
    """
    gap = cadence_step - self.schedule_step
    if gap >= tolerance:
      self.phase += gap
      return gap
    if gap <= -tolerance:
      self.phase -= 1
      return -1
    return 0

  def due(self) -> tuple[int, ...]:
    """Fragments due after the current step (SPEC §2 schedule).

    Each schedule step sends at most once: a schedule held back by `follow` sends nothing until it
    passes the last step that sent.
    """
    s = self.schedule_step
    if s < 1 or s <= self._last_due:
      return ()
    self._last_due = s
    return self.schedule.due(s)

  def fragment_values(self, p: int) -> dict[str, np.ndarray]:
    """A host copy of this learner's θ_p, keyed as the layout keys it."""
    return self._host_values(p, self._fragment_arrays(p))

  def _fragment_arrays(self, p: int) -> list[jax.Array]:
    """The parameter arrays fragment p touches (`_leaf_names[p]` order)."""
    leaves = jax.tree_util.tree_leaves(self.params)
    return [leaves[self._index[k]] for k in self._leaf_names[p]]

  def _host_values(self, p: int, arrays: list[jax.Array]) -> dict[str, np.ndarray]:
    host = jax.device_get(self._readable(arrays))  # One transfer.
    return self.layout.select({k: np.asarray(v) for k, v in zip(self._leaf_names[p], host)}, p)

  def make_report(self, p: int, *, step_time_s: float = 0.0) -> Report:
    """The report of fragment p (SPEC §3 send), recording it as outstanding."""
    return self._record_send(p, self.fragment_values(p), step_time_s)

  def snapshot_report(
    self, p: int, *, step_time_s: float = 0.0
  ) -> tuple[Report, Callable[[], dict[str, np.ndarray]]]:
    """Like `make_report`, but θ_p stays on the devices: the training loop never waits for it.

    Returns the report without values and a function that copies θ_p to host memory, for a
    background sender. The leaves are copied on device first (asynchronously dispatched), so the next
    train step may donate the parameters, and their host transfer starts at once. With
    `snapshot_by_reference` (CPU) nothing is copied: the next train step keeps its parameters.
    """
    leaves = jax.tree_util.tree_leaves(self.params)
    names = self._leaf_names[p]
    if self.snapshot_by_reference and self.host_readable is None:
      copies = [leaves[self._index[k]] for k in names]
      self._keep_params = True
    else:  # A multi-process learner's replication (host_readable) makes new arrays itself.
      copies = self._readable([jnp.copy(leaves[self._index[k]]) for k in names])
    for c in copies:
      c.copy_to_host_async()

    def fetch() -> dict[str, np.ndarray]:
      host = jax.device_get(copies)
      return self.layout.select({k: np.asarray(v) for k, v in zip(names, host)}, p)

    return self._record_send(p, {}, step_time_s), fetch

  def _record_send(self, p: int, values: dict[str, np.ndarray], step_time_s: float) -> Report:
    now = self.schedule_step
    self._outstanding[p] = _Outstanding(now, self.schedule.apply_step(now))
    return Report(
      learner_id=self.learner_id,
      fragment=p,
      values=values,
      tokens=int(self.tokens[p]),
      steps=int(self.step_counts[p]),
      anchor_version=int(self.anchor[p]),
      step=now,  # On the fleet's schedule (== self.step unless realigned at a rejoin).
      step_time_s=step_time_s,
      new_tokens=self.ledger.send(p, now),
    )

  def on_report_result(self, p: int, result: ReportResult, *, step: int | None = None) -> None:
    """Records whether the syncer took the report of p sent at `step` (default: the last send).

    The last send's answer decides the counter reset; every answer books its tokens in the ledger.
    """
    out = self._outstanding.get(p)
    if step is None:
      step = out.send_step if out is not None else -1
    self.ledger.answered(p, step, result.status, result.weight, result.round_version)
    if out is not None and out.send_step == step:
      out.accepted = result.status in _ACCEPTED and result.weight > 0

  def forget_outstanding(self) -> None:
    """Drops outstanding sends (e.g. they were lost in a crash of the syncer or the network)."""
    self._outstanding.clear()

  # -- receiving ------------------------------------------------------------------------------

  def receive(self, state: FragmentState) -> None:
    """Stores a merged fragment; the newest version of each fragment wins."""
    held = self._inbox.get(state.fragment)
    if state.version > self.anchor[state.fragment] and (
      held is None or state.version > held.version
    ):
      self._inbox[state.fragment] = state

  def blocked(self) -> bool:
    """True if `blocking` and some fragment's apply step has come without a newer version."""
    if not self.config.blocking:
      return False
    return any(
      self.schedule_step >= out.apply_step and p not in self._inbox
      for p, out in self._outstanding.items()
    )

  def apply_ready(self) -> list[tuple[int, int]]:
    """Applies every held fragment whose apply step has come; returns (fragment, version) pairs."""
    applied = []
    for p in sorted(self._inbox):
      out = self._outstanding.get(p)
      if out is None or self.schedule_step < out.apply_step:
        continue
      state = self._inbox.pop(p)
      self._write_fragment(p, state.values)
      if self.config.mixing_alpha == 0:  # α > 0 keeps part of the unsent progress: not dropped.
        self.ledger.overwritten(p)
      self.anchor[p] = state.version
      self._check_apply(p, state.version)
      if out.accepted:
        self.tokens[p] = 0
        self.step_counts[p] = 0
      del self._outstanding[p]
      applied.append((p, state.version))
    return applied

  def load_global(self, states: Iterable[FragmentState]) -> None:
    """Overwrites fragments with the syncer's global values (start, rejoin): SPEC §6.

    Counters restart, nothing is outstanding, and each fragment's anchor becomes the given version.
    """
    for state in states:
      self._write_fragment(state.fragment, state.values, mix=False)
      self.ledger.overwritten(state.fragment)
      self.anchor[state.fragment] = state.version
      self._record_digest(state.fragment, mixed=False)
      self.tokens[state.fragment] = 0
      self.step_counts[state.fragment] = 0
      self._inbox.pop(state.fragment, None)
    self._outstanding.clear()

  def _write_fragment(self, p: int, values: dict[str, np.ndarray], *, mix: bool = True) -> None:
    alpha = self.config.mixing_alpha if mix else 0.0
    if alpha > 0:
      mine = self.fragment_values(p)
      values = {
        k: ((1 - alpha) * values[k] + alpha * mine[k]).astype(mine[k].dtype) for k in values
      }
    leaves = jax.tree_util.tree_leaves(self.params)
    pieces: dict[str, list[tuple[int, int, np.ndarray]]] = {}
    for key, value in values.items():
      leaf_key, start, stop = layout_lib.parse_key(key)
      if start is not None:  # A piece of a tensor split along axis 0 (SPEC §2, off by default).
        pieces.setdefault(leaf_key, []).append((start, stop, value))
        continue
      i = self._index[leaf_key]
      leaves[i] = jax.device_put(np.asarray(value, dtype=leaves[i].dtype), self._shardings[i])
    for leaf_key, parts in pieces.items():
      i = self._index[leaf_key]
      full = np.array(jax.device_get(self._readable([leaves[i]])[0]))
      for start, stop, value in parts:
        full[start:stop] = value
      leaves[i] = jax.device_put(full, self._shardings[i])
    self.params = jax.tree_util.tree_unflatten(self._treedef, leaves)

  def _record_digest(self, p: int, *, mixed: bool = True) -> None:
    """Digest of what this learner now holds for p, read back from its devices (SPEC §4.7).

    Comparing it with the syncer's digest proves the bits arrived intact (pieces, dtypes, shardings).
    After an α > 0 mix the learner holds its own blend, so there is nothing to compare.
    """
    if mixed and self.config.mixing_alpha > 0:
      self.applied_digest.pop(p, None)
    else:
      self.applied_digest[p] = self.digest_of(p)

  def _check_apply(self, p: int, version: int) -> None:
    """Queues the digest check of an apply (`verified_applies`), read back at once or deferred."""
    if self.config.mixing_alpha > 0:
      self._record_digest(p)
      self._verified.append((p, version, None))
    elif self.defer_digests and self.snapshot_by_reference and self.host_readable is None:
      arrays = self._fragment_arrays(p)
      for a in arrays:
        a.copy_to_host_async()
      self._unverified.append((p, version, arrays))
    else:
      self._record_digest(p)
      self._verified.append((p, version, self.applied_digest[p]))

  def verified_applies(self, *, block: bool = False) -> list[tuple[int, int, str | None]]:
    """(fragment, version, digest read back) of the applies checked since the last call, in
    apply order; None for an α > 0 mix, which has nothing to compare. Deferred checks whose
    arrays are not ready yet wait for a later call unless `block`."""
    out, self._verified = self._verified, []
    waiting = []
    for p, version, arrays in self._unverified:
      if waiting or not (block or all(a.is_ready() for a in arrays)):
        waiting.append((p, version, arrays))  # Later ones wait too: apply order is kept.
        continue
      digest = values_digest(self._host_values(p, arrays))
      if self.anchor[p] == version:
        self.applied_digest[p] = digest
      out.append((p, version, digest))
    self._unverified = waiting
    return out

  def digest_of(self, p: int) -> str:
    """Digest of this learner's current θ_p (equals the syncer's after an α = 0 apply)."""
    return values_digest(self.fragment_values(p))
