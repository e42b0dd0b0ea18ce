"""One learner's state and its side of the round protocol (docs/algorithm.md §3), free of transports and clocks.

The simulated cluster and the learner process both drive this object:

  learner.ask(request)                      # the syncer opened round (p, t): answer it
  learner.train_step(batch)                 # inner AdamW step; counters[p] += tokens, steps  ∀p
  learner.apply_ready()                     # applies merged Θ_p that arrived, τ steps after answering
  for p in learner.due():                   # rounds to answer at this step boundary
    result = send(learner.make_report(p))   # host copy of θ_p + counters + round id
    learner.on_report_result(p, result)
  learner.receive(fragment_state)           # whenever a merged fragment arrives

Decisions (docs/algorithm.md, "Rounds"):
- The syncer paces the rounds; a learner answers every round it is asked for, once, tagged with
  the round's step, unless a version of p newer than the round's base arrived first (it merged).
- A merged fragment is applied as soon as it has arrived and τ steps have passed since this learner
  answered p's round; a version of a round it did not answer is applied at once. The counters of p
  reset at every apply, whether or not the answer was merged: θ_p is overwritten either way.
- `blocking` (the synchronous baselines) answers a round once the learner's own schedule step has
  reached the round's step, and waits at answer + τ until the merge has arrived: every learner
  runs the same number of inner steps per round, so the fast ones wait for the slow ones.
- α = 0 overwrites θ_p with Θ_p (Decoupled DiLoCo); α = 0.5 mixes as Streaming DiLoCo; with
  `apply_rule = "carry"` an apply of a round this learner answered keeps the progress made since
  the answer, and the counters of p keep what it holds (learner/carry.py).
"""

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.layout import FragmentLayout
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import carry, writes
from ddiloco.learner import train_step as train_step_lib
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.ledger import TokenLedger, taken
from ddiloco.learner.rounds import RoundBook
from ddiloco.learner.snapshot import FragmentSnapshot
from ddiloco.learner.train_step import CompiledSteps
from ddiloco.protocol import FragmentState, Report, ReportResult, RoundRequest
from ddiloco.types import PyTree


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
    self.phase = 0  # Schedule offset: this learner's step on the fleet's clock (align_phase).
    num = layout.num_fragments
    self.tokens = np.zeros(num, np.int64)  # docs/algorithm.md §3 counters[p].tokens
    self.step_counts = np.zeros(num, np.int64)  # docs/algorithm.md §3 counters[p].steps
    self.anchor = np.full(num, -1, np.int64)  # Version of p last applied; -1 = never received.
    self.applied_digest: dict[int, str] = {}  # p -> digest of Θ_p read back after an α = 0 apply.
    self.ledger = TokenLedger(num)  # Where each trained token went (ledger.py).
    self._inbox: dict[int, FragmentState] = {}
    self._rounds = RoundBook(num)  # Asked for, answered, awaiting their merge (rounds.py).
    self.answers = carry.AnswerBook()  # θ_p^answered of outstanding answers; "carry" only.
    leaves, self._treedef = jax.tree_util.tree_flatten_with_path(params)
    self._index = {tree.path_str(path): i for i, (path, _) in enumerate(leaves)}
    self._shardings = jax.tree_util.tree_leaves(
      steps.param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    # The leaves each fragment touches (split tensors are keyed "path@start:stop"; docs/algorithm.md §2).
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
    # Whether answers' δ is int4-encoded on the devices (`LearnerConfig.device_encode`).
    self.device_encode = self.config.device_encode and not self.snapshot_by_reference
    self._keep_params = False  # The next train step must not donate the parameters.
    # A step dispatched by `start_step` and not ended: (its parameters, its tokens).
    self._in_flight: tuple[PyTree, int] | None = None
    self._in_flight_kept = False  # The step in flight keeps its input parameters readable.
    self._standby: dict[int, list[jax.Array]] = {}  # p -> θ_p copied before the step in flight.
    # Digest checks of applies (docs/algorithm.md §4.7): read back at once, or, with `defer_digests` on CPU
    # (snapshot_by_reference; a learner process sets it), once the written arrays are ready: the
    # read-back waited there for the step in flight, like the snapshot's copy. `verified_applies`
    # hands the checks out in apply order.
    self.defer_digests = False
    self._unverified: list[tuple[int, int, list[jax.Array]]] = []  # (p, version, θ_p's arrays).
    self._verified: list[tuple[int, int, str]] = []  # (p, version, Θ_p's digest read back).

  def _readable(self, arrays: list[jax.Array]) -> list[jax.Array]:
    return arrays if self.host_readable is None else self.host_readable(arrays)

  # -- training -------------------------------------------------------------------------------

  def train_step(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """One inner step on `batch`; metrics stay on device (read them lazily)."""
    metrics = self._dispatch(batch, (), mid_step=False)
    self.end_step()
    return metrics

  def start_step(
    self, batch: dict[str, Any], *, standby: Iterable[int] = ()
  ) -> dict[str, jax.Array]:
    """Dispatches one inner step on `batch`; `end_step` makes it this learner's.

    Until `end_step`, θ, the step and the counters stay those of the last step boundary, so a
    round asked for while the step runs can be answered at once with θ_p of the last step
    (`due`, `snapshot_report`) instead of after the step in flight: docs/algorithm.md, "answers".
    θ_p must still be readable then. On CPU (`snapshot_by_reference`) the step keeps its input
    parameters; elsewhere it donates them, and the fragments in `standby` (those the syncer is
    expected to ask for meanwhile) are copied on device first. A multi-process learner answers
    only at boundaries (its processes must snapshot together).

    Raises:
      RuntimeError: if a step is already in flight.
    """
    return self._dispatch(batch, standby, mid_step=True)

  def _dispatch(
    self, batch: dict[str, Any], standby: Iterable[int], *, mid_step: bool
  ) -> dict[str, jax.Array]:
    if self._in_flight is not None:
      raise RuntimeError("A step is in flight: call end_step first.")
    self._standby = {}
    if self.copies_standby:
      for p in sorted(set(standby)):
        self._check_fragment(p)
        self._standby[p] = [jnp.copy(a) for a in self._fragment_arrays(p)]
    # Arrays awaiting a digest check or a snapshot must outlive the step too.
    keep = self._keep_params or bool(self._unverified) or (mid_step and self._by_reference)
    self._keep_params = False
    params, self.opt_state, metrics = self.steps.train(
      self.params, self.opt_state, self.steps.put_batch(batch), keep_params=keep
    )
    self._in_flight = (params, int(np.prod(batch["targets"].shape)))
    self._in_flight_kept = keep
    return metrics

  def end_step(self) -> None:
    """Makes the step `start_step` dispatched this learner's: its θ, step and counters."""
    if self._in_flight is None:
      raise RuntimeError("No step in flight: call start_step first.")
    (self.params, ntok), self._in_flight = self._in_flight, None
    self._standby = {}
    self.step += 1
    self.tokens += ntok
    self.step_counts += 1
    self.ledger.train(ntok)

  @property
  def answers_mid_step(self) -> bool:
    """Whether rounds can be answered while a step runs (one process: `start_step`)."""
    return self.host_readable is None

  @property
  def copies_standby(self) -> bool:
    """Whether `start_step` copies the `standby` fragments (θ is donated to the step)."""
    return self.answers_mid_step and not self._by_reference

  @property
  def _by_reference(self) -> bool:
    """Whether snapshots hold θ's arrays themselves instead of copies (one process on CPU)."""
    return self.snapshot_by_reference and self.host_readable is None

  @property
  def step_in_flight(self) -> bool:
    """Whether a step was dispatched (`start_step`) and not yet ended."""
    return self._in_flight is not None

  def _check_fragment(self, p: int) -> None:
    if not 0 <= p < self.layout.num_fragments:
      raise ValueError(f"Unknown fragment {p}; the layout has {self.layout.num_fragments}.")

  # -- sending --------------------------------------------------------------------------------

  @property
  def schedule_step(self) -> int:
    """The step on the fleet's schedule: this learner's step plus its phase offset."""
    return self.step + self.phase

  def align_phase(self, fleet_step: int) -> None:
    """Puts this learner's schedule step at the fleet's step (the syncer's clock) at (re)join.

    Only `blocking` learners read it (they answer a round when their schedule step reaches the
    round's); the step count (and the inner learning-rate schedule) are the learner's own.
    """
    self.phase = max(fleet_step, 0) - self.step
    # Rounds due up to here were the fleet's before this learner (re)joined: none to wait for.
    self._rounds.answered_up_to(self.schedule_step)

  def join_schedule(self, fleet_step: int) -> None:
    """Continues the fleet's inner learning-rate schedule from `fleet_step` (a (re)join).

    A learner that joins a running fleet would otherwise start its warm-up again; one whose own
    schedule is further along keeps it.
    """
    self.opt_state = train_step_lib.schedule_at_least(self.opt_state, max(int(fleet_step), 0))

  def ask(self, request: RoundRequest) -> None:
    """Records that the syncer asked for fragment p in round (p, t) (docs/algorithm.md §3).

    Ignored if this learner already holds (or has received) a version newer than the round's base:
    that round has merged. A newer round of p replaces an unanswered older one.
    """
    p = request.fragment
    if not 0 <= p < self.layout.num_fragments:
      raise ValueError(f"Round request for unknown fragment {p}.")
    held = self._inbox.get(p)
    newest = max(int(self.anchor[p]), held.version if held is not None else -1)
    self._rounds.ask(request, newest)

  def due(self) -> tuple[int, ...]:
    """Fragments whose round this learner answers now, at this step boundary.

    Every pending request whose base version this learner has applied (until the base arrives, an
    answer would weigh 0), once it has trained p since its last apply (a learner that has just
    joined has nothing to contribute yet); a `blocking` learner answers only rounds whose step its
    own schedule step has reached.
    """
    s = self.schedule_step
    return tuple(
      sorted(
        p
        for p, req in self._rounds.pending().items()
        if req.base_version <= self.anchor[p]
        and self.step_counts[p] > 0
        and (not self.config.blocking or req.round_step <= s)
        and self._readable_now(p)
      )
    )

  def _readable_now(self, p: int) -> bool:
    """Whether θ_p of the last boundary can be read now (always, but while a step that donated it
    runs: then only a standby copy can; `start_step`)."""
    if self._in_flight is None or p in self._standby:
      return True
    return self._by_reference and self._in_flight_kept

  def pending_rounds(self) -> dict[int, RoundRequest]:
    """The rounds asked for and not answered yet, by fragment."""
    return self._rounds.pending()

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
    """The report of fragment p (docs/algorithm.md §3 send), recording it as outstanding."""
    values = self.fragment_values(p)
    return self._record_send(p, values, step_time_s, carry.Answer(-1, 0, 0, values=values))

  def snapshot_report(self, p: int, *, step_time_s: float = 0.0) -> tuple[Report, FragmentSnapshot]:
    """Like `make_report`, but θ_p stays on the devices: the training loop never waits for it.

    Returns the report without values and θ_p's snapshot, which a background sender copies to
    host memory (or has the devices encode: learner/snapshot.py). The leaves are copied on device
    first (asynchronously dispatched), so the next train step may donate the parameters, and their
    host transfer starts at once. With `snapshot_by_reference` (CPU) nothing is copied: the next
    train step keeps its parameters.
    """
    leaves = jax.tree_util.tree_leaves(self.params)
    names = self._leaf_names[p]
    if not self._readable_now(p):
      raise RuntimeError(f"θ_{p} of the last step is not readable while this step runs.")
    if p in self._standby:  # Copied before the step in flight donated θ (`start_step`).
      copies = self._standby.pop(p)
    elif self._by_reference:
      copies = [leaves[self._index[k]] for k in names]
      self._keep_params = True
    else:  # A multi-process learner's replication (host_readable) makes new arrays itself.
      copies = self._readable([jnp.copy(leaves[self._index[k]]) for k in names])
    # With device encoding only δ's bytes come back. Not for a multi-process learner: a program
    # on its arrays would need every process, and only the leader sends.
    encode = self.device_encode and self.host_readable is None
    if not encode:
      for c in copies:
        c.copy_to_host_async()
    snapshot = FragmentSnapshot(self.layout, p, names, copies, device_encode=encode)
    return self._record_send(p, {}, step_time_s, carry.Answer(-1, 0, 0, fetch=snapshot)), snapshot

  def _record_send(
    self, p: int, values: dict[str, np.ndarray], step_time_s: float, answer: carry.Answer
  ) -> Report:
    """Answers p's pending round (or, without one, sends an unsolicited report with no round)."""
    now = self.schedule_step
    round_step = self._rounds.answer(p, now, self.schedule.apply_step(now))
    if self.config.apply_rule == "carry":
      answer.step, answer.tokens, answer.steps = now, int(self.tokens[p]), int(self.step_counts[p])
      self.answers.record(p, answer)
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
      round_step=round_step,
    )

  def on_report_result(self, p: int, result: ReportResult, *, step: int | None = None) -> None:
    """Books the syncer's answer to the report of p sent at `step` (default: the last send) in the
    token ledger."""
    if step is None:
      step = self._rounds.sent_step(p)
    self.ledger.answered(p, step, result.status, result.weight, result.round_version)
    self.answers.result(p, step, taken(result.status, result.weight, result.round_version))

  # -- receiving ------------------------------------------------------------------------------

  def receive(self, state: FragmentState) -> None:
    """Stores a merged fragment; the newest version of each fragment wins.

    An unanswered request of an older base is dropped: its round has merged.
    """
    p = state.fragment
    held = self._inbox.get(p)
    if state.version > self.anchor[p] and (held is None or state.version > held.version):
      self._inbox[p] = state
      self._rounds.received(p, state.version)

  def blocked(self) -> bool:
    """`blocking` only: whether this learner must wait before its next step.

    It waits at a step where a fragment is due until it has answered that round (the syncer opens it
    when the fleet has reached the step), and at answer + τ until the round's merge has arrived.
    """
    if not self.config.blocking:
      return False
    s = self.schedule_step
    if s >= 1 and self._rounds.unanswered(self.schedule.due(s), s):
      return True
    return self._rounds.awaiting_merge(s, self._inbox)

  def apply_ready(self) -> list[tuple[int, int]]:
    """Applies every received fragment whose apply step has come (τ steps after this learner
    answered p's round; at once if it has no answer outstanding); returns (fragment, version)."""
    applied = []
    if self._in_flight is not None:
      return applied  # At step boundaries only: the step in flight would write over it.
    for p in sorted(self._inbox):
      apply_step = self._rounds.apply_step(p)
      request = self._rounds.request(p)
      if (
        apply_step is not None
        and self.schedule_step < apply_step
        and (request is None or request.base_version > self._inbox[p].version)
      ):
        continue  # Not before τ steps, unless a round of p based on it already waits for us.
      state = self._inbox.pop(p)
      answer = self.answers.take(p)  # Not None: "carry", and this learner answered the round.
      alpha = self.config.mixing_alpha
      mine = self.fragment_values(p) if answer is not None or alpha > 0 else None
      self._write_fragment(p, state.values)
      self.anchor[p] = state.version
      self._check_apply(p, state.version)  # Of Θ_p's bits on the devices, before a carry or mix.
      kept = (0, 0)  # θ_p was overwritten, merged or not: its counters restart...
      if answer is not None:  # ... but for the progress since the answer, carried over.
        self._write_fragment(p, carry.carried(state.values, mine, answer.host_values()))
        kept = (self.tokens[p] - answer.tokens, self.step_counts[p] - answer.steps)
      elif alpha > 0:
        self._write_fragment(p, carry.mixed(state.values, mine, alpha))
      if self.config.mixing_alpha == 0:  # α > 0 keeps part of the unsent progress: not dropped.
        self.ledger.overwritten(p, keep=kept[0])
      self.tokens[p], self.step_counts[p] = kept
      self._rounds.applied(p)
      applied.append((p, state.version))
    return applied

  def load_global(self, states: Iterable[FragmentState]) -> None:
    """Overwrites fragments with the syncer's global values (start, rejoin): docs/algorithm.md §6.

    Counters restart, nothing is outstanding, and each fragment's anchor becomes the given version.

    Raises:
      RuntimeError: while a step is in flight (`start_step`), which would write over it.
    """
    if self._in_flight is not None:
      raise RuntimeError("load_global while a step is in flight: call end_step first.")
    for state in states:
      self._write_fragment(state.fragment, state.values)
      self.ledger.overwritten(state.fragment)
      self.anchor[state.fragment] = state.version
      self._record_digest(state.fragment)
      self.tokens[state.fragment] = 0
      self.step_counts[state.fragment] = 0
      self._inbox.pop(state.fragment, None)
    self._rounds.clear()
    self.answers.clear()

  def _write_fragment(self, p: int, values: dict[str, np.ndarray]) -> None:
    leaves = jax.tree_util.tree_leaves(self.params)
    whole = writes.leaf_values(
      values, leaves, self._index, lambda i: jax.device_get(self._readable([leaves[i]])[0])
    )
    # One batched transfer for the fragment's leaves: a device_put per leaf costs its Python
    # dispatch each (bench_learner_overhead.py).
    order = sorted(whole)
    placed = jax.device_put([whole[i] for i in order], [self._shardings[i] for i in order])
    for i, array in zip(order, placed):
      leaves[i] = array
    self.params = jax.tree_util.tree_unflatten(self._treedef, leaves)

  def _record_digest(self, p: int) -> None:
    """Digest of what this learner now holds for p, read back from its devices (docs/algorithm.md §4.7).

    Comparing it with the syncer's digest proves the bits arrived intact (pieces, dtypes, shardings).
    """
    self.applied_digest[p] = self.digest_of(p)

  def _check_apply(self, p: int, version: int) -> None:
    """Queues the digest check of an apply (`verified_applies`), read back at once or deferred.

    With "carry" or α > 0 the check reads the written Θ_p back before the carry or the mix is
    written over it (`apply_ready`): the learner then holds its own θ_p, but Θ_p's bits were proven.
    """
    if self.defer_digests and self._by_reference:
      arrays = self._fragment_arrays(p)
      for a in arrays:
        a.copy_to_host_async()
      self._unverified.append((p, version, arrays))
    else:
      self._record_digest(p)
      self._verified.append((p, version, self.applied_digest[p]))

  def verified_applies(self, *, block: bool = False) -> list[tuple[int, int, str]]:
    """(fragment, version, digest read back) of the applies checked since the last call, in
    apply order. Deferred checks whose arrays are not ready yet wait for a later call unless
    `block`."""
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
    """Digest of this learner's current θ_p (the syncer's after an overwrite; not after a carry or mix)."""
    return values_digest(self.fragment_values(p))
