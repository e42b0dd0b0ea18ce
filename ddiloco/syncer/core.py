"""The syncer's core: syncer-paced rounds, quorum, grace window, token-weighted merge, outer step.

Pure and clock-injected: no threads, no sleeping, no I/O, no wall clock. Time comes only from `clock`, so
the same object runs under a virtual clock (simulated cluster) and a wall clock (the gRPC service, which
wraps it with a lock). The protocol (docs/algorithm.md, "Rounds"):

- The syncer owns the schedule. It keeps a step clock at the fleet's cadence
  (`pacer.cadence_step`: it advances at the median inner-step rate of the alive learners, measured
  from their step counts). When the clock reaches step t, every fragment p due at t
  (`FragmentSchedule.due`) gets its round (p, t), opened against p's current version (the round's
  base). `pacer.tick` returns the opened rounds as
  `RoundRequest`s and the transport asks every live learner for them; each learner answers at its
  next step boundary with θ_p and its counters, tagged with the round's step.
- A fragment has at most one open round. A round that is still open when p is due again (its quorum
  K was not reached within a period) stays open and the due round is not opened ("overrun"). So
  every fragment merges at most once per period.
- An answer for a round that is already closed is "late": dropped and counted. It never opens a
  round of its own, and its progress is never applied on top of a merge that already covered the
  same steps. An answer for a round that was never opened is rejected.
- A learner weighs 0 for p until p was delivered to it since its last registration, and whenever its
  answer is not anchored at the round's base version; such answers are accepted but neither count
  toward the quorum nor touch the merge.
- Quorum: K weight>0 answers, timed from the round's opening (ξ_quorum). Then the round stays open for
  the grace window, or closes at once when every alive learner that has received p has answered.
  It never merges with fewer than K: K = M with a dead learner stalls, which is the synchronous
  baselines' cost, made visible.
- Merge: v_m = Θ^(base) − θ_m (the outer gradient against the round's base, which is Θ_p: nothing
  else merges p while its round is open), combined by the merge rule (`SyncerConfig.merge_rule`:
  its weights, tokens²/steps for the shipped rules, and its coefficients: RDA, the weighted mean,
  ...), then one optax state per fragment, float32 math, results cast back to each tensor's dtype. Each merge publishes
  version + 1 and the `values_digest` of the new values.

Its state lives in collaborators it composes, each in its own module: the published versions
(`versions.py`), the learners (`learners.py`), the rounds (`rounds.py`) and their pacing on the step
clock (`pacing.py`), the door's checks (`admission.py`), the counters and token ledger
(`accounts.py`), the merge and outer step (`updates.py`) and checkpoints (`core_state.py`). The value
types live in `types.py` (re-exported here). Callers drive the step clock through `pacer`
(`tick`, `next_tick_time`, `cadence_step`), merge through `closer` (`poll`, `flush`,
`next_deadline`), ask `rounds` about open and closed rounds, `intake` about retries and late
answers, and feed `grace` the delivery times; the core's own methods are those that check a
fragment or join several collaborators.
"""

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.syncer import core_state
from ddiloco.syncer.accounts import Accounts
from ddiloco.syncer.admission import Admission
from ddiloco.syncer.closing import RoundCloser
from ddiloco.syncer.grace import GraceModel
from ddiloco.syncer.intake import ReportIntake
from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.pacing import RoundPacer
from ddiloco.syncer.restore import FragmentRestore
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.types import (
  FragmentState,
  MergeEvent,
  Report,
  ReportResult,
  RoundRequest,
  SyncerConfig,
)
from ddiloco.syncer.updates import FragmentUpdater
from ddiloco.syncer.versions import VersionStore

__all__ = [
  "FragmentState",
  "MergeEvent",
  "Report",
  "ReportResult",
  "RoundRequest",
  "SyncerConfig",
  "SyncerCore",
]


class SyncerCore:
  """Global fragments, their rounds and outer optimizer states, driven by reports and an injected clock.

  Not thread-safe: the service wraps it with a lock.
  """

  def __init__(
    self,
    *,
    fragment_keys: Sequence[Sequence[str]],
    init_values: Mapping[str, np.ndarray],
    config: SyncerConfig,
    clock: Callable[[], float],
    embedding_keys: Collection[str] = (),
    adopt: Callable[[int, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], dict] | None = None,
    schedule: FragmentSchedule | None = None,
    owned: Collection[int] | None = None,
  ):
    """Creates the syncer at version 0 of every fragment.

    Args:
      fragment_keys: per fragment, the parameter keys it holds (e.g. `FragmentLayout.fragments`).
      init_values: initial value of every key (floating dtypes); copied.
      config: syncer settings.
      clock: returns the current time in seconds (wall or virtual).
      embedding_keys: keys merged with the weighted mean (docs/algorithm.md §4.5); others may be absent.
      adopt: maps (fragment, merged values, previous version's values) to the values published.
        A lossy downlink codec passes "what a learner holding the previous version decodes" here, so
        the syncer adopts the dequantized values and every copy stays bit-identical (docs/algorithm.md §5).
      schedule: when each fragment is due on the syncer's step clock, and τ (the overlap the grace
        window spends): the run's one `FragmentSchedule`, which the learners follow too.
        Default: P = H = the number of fragments (at least 3), τ = 2.
      owned: the fragments this core merges, on a syncer shard (fragments/shards.py): it holds
        values, versions and outer states only for them and opens rounds only for them; fragment
        ids stay global. Default: all.

    Raises:
      ValueError: if fragments are empty or overlap, keys and init_values disagree, a value is not
        a floating array, or the schedule does not fit.
    """
    self._versions = VersionStore(fragment_keys, init_values, config.keep_versions, owned)
    num = self._versions.num_fragments
    self._config = config
    if schedule is None:
      schedule = FragmentSchedule(num_fragments=num, period=max(num, 3), overlap=2)
    if schedule.total_fragments != num:
      raise ValueError(
        f"The schedule has {schedule.total_fragments} fragments (P={schedule.num_fragments} "
        f"x {schedule.slices} slices), this syncer {num}."
      )
    self._schedule = schedule
    self._clock = clock
    self._embedding_keys = frozenset(embedding_keys)
    self._grace = GraceModel(
      gamma=config.grace_gamma,
      grace_max_s=config.grace_max_s,
      overlap=schedule.overlap,
      decay=config.ema_decay,
      spread_cover=config.grace_spread,
    )
    self._updater = FragmentUpdater(
      config=config,
      versions=self._versions,
      optimizer=config.make_outer_optimizer(),
      embedding_keys=self._embedding_keys,
      adopt=adopt,
    )
    self._learners = LearnerRegistry(clock, config.max_step_rate)
    self._rounds = RoundTable(num)
    self._accounts = Accounts(self._learners)
    self._admission = Admission(
      config=config,
      schedule=schedule,
      learners=self._learners,
      versions=self._versions,
      rounds=self._rounds,
    )
    # The state every collaborator below reads or books into.
    shared = dict(
      config=config,
      clock=clock,
      learners=self._learners,
      versions=self._versions,
      rounds=self._rounds,
      accounts=self._accounts,
    )
    self._pacer = RoundPacer(schedule=schedule, **shared)
    self._intake = ReportIntake(
      embedding_keys=self._embedding_keys,
      grace=self._grace,
      pacer=self._pacer,
      admission=self._admission,
      **shared,
    )
    self._closer = RoundCloser(
      grace=self._grace, updater=self._updater, admission=self._admission, **shared
    )
    self._restore = FragmentRestore(
      versions=self._versions, rounds=self._rounds, pacer=self._pacer, closer=self._closer
    )

  # -- membership and delivery (docs/algorithm.md §3, §6) -------------------------------------------------------

  @property
  def num_fragments(self) -> int:
    return self._versions.num_fragments

  @property
  def config(self) -> SyncerConfig:
    return self._config

  @property
  def owned(self) -> frozenset[int]:
    """The fragments this core merges (all of them unless it is one shard of several)."""
    return self._versions.owned

  def owns(self, p: int) -> bool:
    """Whether this core merges fragment p."""
    return p in self._versions.owned

  def register(self, learner_id: int) -> dict[int, int]:
    """Marks a learner alive (`LearnerRegistry.register`) and returns {fragment: current version}
    (its "vector clock", docs/algorithm.md §6)."""
    self._learners.register(learner_id)
    return dict(enumerate(self._versions.versions()))

  @property
  def schedule(self) -> FragmentSchedule:
    return self._schedule

  @property
  def pacer(self) -> RoundPacer:
    """The step clock and the rounds it opens (`tick`, `next_tick_time`, `cadence_step`)."""
    return self._pacer

  @property
  def closer(self) -> RoundCloser:
    """The merges: `poll` (those due now), `flush` (every round with its quorum), `next_deadline`.

    A round whose merge fails (`RoundCloser.merge`) is closed without a merge and is not returned.
    """
    return self._closer

  @property
  def rounds(self) -> RoundTable:
    """The rounds: `open_requests` (a learner that (re)joins is asked for them too) and
    `late_reason` (a transport asks before decoding a push: a closed round's answer is dropped
    unread)."""
    return self._rounds

  @property
  def intake(self) -> ReportIntake:
    """The answers filed: `replayed` (a retry's earlier result) and `drop_late` (a late answer
    counted as dropped, the state otherwise untouched)."""
    return self._intake

  @property
  def grace(self) -> GraceModel:
    """The grace window's model; a transport reports how long delivering a merge took
    (`observe_sync_time`, ξ_sync, docs/algorithm.md §4.2)."""
    return self._grace

  def fleet_step(self) -> int:
    """The fleet's step on the syncer's schedule clock: a (re)joining learner aligns to it.

    `pacer.cadence_step` once the clock runs; before that, the largest schedule step reported.
    """
    step = self._pacer.cadence_step()
    return step if step >= 0 else self._accounts["fleet_step"]

  def open_round(self, p: int, step: int) -> RoundRequest | None:
    """Opens round (p, step) against p's current version; None if p's previous round is still open.

    `pacer.tick` opens the round of every due fragment; tests and tools may call this directly.

    Raises:
      ValueError: on an unknown fragment, or a step not after p's newest round.
    """
    self._check_fragment(p)
    if not self.owns(p):
      raise ValueError(f"Fragment {p} belongs to another syncer shard.")
    return self._pacer.open_round(p, step)

  def observe_steps(
    self,
    learner_id: int,
    inner_step: int,
    *,
    step_time_s: float = 0.0,
    min_interval_s: float = 1.0,
  ) -> None:
    """Samples an alive learner's schedule step (heartbeats) for its rate (`LearnerRegistry`)."""
    self._learners.observe_steps(
      learner_id, inner_step, step_time_s=step_time_s, min_interval_s=min_interval_s
    )

  def leave(self, learner_id: int) -> None:
    """Marks a learner not alive (crash detected or scale-down); idempotent (`LearnerRegistry.leave`)."""
    self._learners.leave(learner_id)

  def alive(self) -> frozenset[int]:
    """Ids of the learners currently alive."""
    return self._learners.alive()

  def fetch(self, learner_id: int, fragment: int) -> FragmentState:
    """Returns the current Θ_p and records that `learner_id` has received this version.

    Raises:
      ValueError: if the learner is not alive or the fragment is unknown.
    """
    state = self.state(fragment)
    self.mark_delivered(learner_id, fragment, state.version)
    return state

  def mark_delivered(self, learner_id: int, fragment: int, version: int) -> None:
    """Records that a transport delivered `version` of `fragment` to `learner_id` (a push).

    Raises:
      ValueError: if the learner is not alive, the fragment is unknown or the version never existed.
    """
    self._check_fragment(fragment)
    self._learners.mark_delivered(learner_id, fragment, version, self._versions.version(fragment))

  # -- reports ------------------------------------------------------------------------------------

  def report(self, r: Report, *, copy: bool = True) -> ReportResult:
    """Validates a learner's answer to a round and files it (see module docstring).

    The answer carries the syncer's step clock (`fleet_step`), whatever the status. With
    `copy=False` the core keeps the report's arrays instead of copying them: for callers that hand
    over freshly decoded arrays nobody else holds (the service; a 64 MiB copy cost ~40 ms).

    Args:
      r: the report; its arrays are copied if it joins a round.

    Returns:
      "rejected" (invalid, or for a round never opened; the state is untouched), "accepted" (weight
      may be 0), "superseded" (a restarted learner's answer replaced its older one in the round),
      "late" (its round is closed: dropped and counted) or "duplicate" (this learner already
      answered the round).
    """
    return dataclasses.replace(self._intake.file(r, copy), fleet_step=self._pacer.cadence_step())

  # -- restores (docs/resilience.md) ----------------------------------------------------------------

  def republish(self, p: int, version: int) -> None:
    """Publishes Θ_p's current values again as `version` (a restore: `FragmentRestore.republish`)."""
    self._check_fragment(p)
    self._restore.republish(p, version)

  def freeze(self, p: int) -> None:
    """Opens no more rounds of p until `unfreeze(p)`; closes its open round (`FragmentRestore.freeze`)."""
    self._check_fragment(p)
    self._restore.freeze(p)

  def unfreeze(self, p: int) -> None:
    """Lets `tick` open rounds of p again (from its next due step)."""
    self._check_fragment(p)
    self._pacer.unfreeze(p)

  def recover(self, p: int, version: int, values: Mapping[str, np.ndarray], digest: str) -> None:
    """Takes `values` back as `version` of p, a version lost in a kill (`FragmentRestore.recover`)."""
    self._check_fragment(p)
    self._restore.recover(p, version, values, digest)

  def state_dict(self) -> dict[str, Any]:
    """The whole state as a flat {name: numpy array | python scalar} dict (`core_state.py`)."""
    return core_state.state_dict(
      versions=self._versions,
      updater=self._updater,
      rounds=self._rounds,
      learners=self._learners,
      accounts=self._accounts,
      grace=self._grace,
    )

  def load_state_dict(self, d: Mapping[str, Any]) -> None:
    """Replaces the whole state with one from `state_dict` (same layout; the config may differ).

    Raises:
      ValueError: if the checkpoint was made for another layout or its arrays do not fit.
      KeyError: if an entry is missing.
    """
    core_state.load_state_dict(
      d,
      versions=self._versions,
      updater=self._updater,
      rounds=self._rounds,
      pacer=self._pacer,
      learners=self._learners,
      accounts=self._accounts,
      grace=self._grace,
    )

  def layout_fingerprint(self) -> str:
    """Hash of fragment keys, shapes and dtypes; guards `load_state_dict` against another layout."""
    return self._versions.layout_fingerprint()

  # -- reading state ------------------------------------------------------------------------------

  def kept(self, p: int, version: int) -> bool:
    """Whether `version` of fragment p is kept (`keep_versions`)."""
    self._check_fragment(p)
    return self._versions.kept(p, version)

  def version(self, p: int) -> int:
    """Current version of fragment p."""
    self._check_fragment(p)
    return self._versions.version(p)

  def state(self, p: int) -> FragmentState:
    """Current Θ_p with its version and digest (read-only arrays)."""
    self._check_fragment(p)
    return self._versions.state(p)

  def state_at(self, p: int, version: int) -> FragmentState:
    """A recent version of Θ_p (the last `keep_versions`), for re-anchoring deltas (docs/algorithm.md §4.3).

    Raises:
      KeyError: if that version is no longer (or not yet) kept.
    """
    self._check_fragment(p)
    return self._versions.state_at(p, version)

  def values_at(self, p: int, version: int) -> dict[str, np.ndarray]:
    """Like `state_at(p, version).values` without hashing them (the service's delta anchors).

    Raises:
      KeyError: if that version is no longer (or not yet) kept.
    """
    self._check_fragment(p)
    return self._versions.values_at(p, version)

  def merged_steps(self, learner_id: int) -> list[int]:
    """Per fragment, the step of `learner_id`'s newest report merged into it (`Accounts.merged_steps`)."""
    return self._accounts.merged_steps(learner_id, self.num_fragments)

  def ledger(self) -> dict:
    """The token ledger: totals, the tokens pending in open rounds, and per learner.

    Totals balance by construction of each path: received = merged + dropped + pending.
    """
    return self._accounts.ledger(self._rounds)

  def grace_window(self) -> float:
    """The grace window a round reaching its quorum now would get (docs/algorithm.md §4.2)."""
    return self._grace.window() if self._config.use_grace else 0.0

  def stats(self) -> dict:
    """Counters (see `COUNTERS`), merges per quorum size and their mean, open rounds, versions."""
    out = self._accounts.stats()
    out["open_rounds"] = sum(1 for r in self._rounds if r.step >= 0)
    out["versions"] = self._versions.versions()
    return out

  def warm_up(self, p: int, answers: int = 1, *, sent_as: np.dtype | None = None) -> None:
    """Compiles fragment p's outer step now, so that its first merge does not (`FragmentUpdater.warm_up`)."""
    self._check_fragment(p)
    self._updater.warm_up(p, answers, sent_as=sent_as)

  def _check_fragment(self, p: int) -> None:
    if not 0 <= p < self.num_fragments:
      raise ValueError(f"Unknown fragment {p}; this syncer holds 0..{self.num_fragments - 1}.")
