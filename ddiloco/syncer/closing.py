"""Closing rounds: when each is due, its merge published as a new version, or its closing without a
merge (docs/algorithm.md §4.2-4.7)."""

import logging
from collections.abc import Callable

from ddiloco.syncer.accounts import Accounts
from ddiloco.syncer.admission import Admission
from ddiloco.syncer.grace import GraceModel
from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.types import MergeEvent, SyncerConfig
from ddiloco.syncer.updates import FragmentUpdater
from ddiloco.syncer.versions import VersionStore

log = logging.getLogger(
  "ddiloco.syncer.core"
)  # The core's logger: a failed merge is the core's event.


class RoundCloser:
  """Merges the rounds that are due (quorum and grace window) and closes rounds without a merge."""

  def __init__(
    self,
    *,
    config: SyncerConfig,
    clock: Callable[[], float],
    grace: GraceModel,
    learners: LearnerRegistry,
    versions: VersionStore,
    rounds: RoundTable,
    updater: FragmentUpdater,
    admission: Admission,
    accounts: Accounts,
  ):
    self._config = config
    self._clock = clock
    self._grace = grace
    self._learners = learners
    self._versions = versions
    self._rounds = rounds
    self._updater = updater
    self._admission = admission
    self._accounts = accounts

  def poll(self) -> list[MergeEvent]:
    """Performs every merge whose time has come at clock(), earliest due first, and returns them.

    A round whose merge fails (`merge`) is closed without a merge and is not returned.
    """
    now = self._clock()
    due = []
    for p in range(self._versions.num_fragments):
      t = self._due_time(p, now)
      if t is not None and t <= now:
        due.append((t, p))
    return [e for _, p in sorted(due) if (e := self.merge(p)) is not None]

  def flush(self) -> list[MergeEvent]:
    """Merges every round that has its quorum now, grace windows or not (shutdown, end of run)."""
    now = self._clock()
    due = [p for p in range(self._versions.num_fragments) if self._due_time(p, now) is not None]
    return [e for p in due if (e := self.merge(p)) is not None]

  def next_deadline(self) -> float | None:
    """Earliest clock time at which poll() would merge something; None if no round has its quorum.

    A round that may close early (everyone has reported) is due now, i.e. at clock().
    """
    now = self._clock()
    times = [
      t for p in range(self._versions.num_fragments) if (t := self._due_time(p, now)) is not None
    ]
    return min(times) if times else None

  def _due_time(self, p: int, now: float) -> float | None:
    rnd = self._rounds[p]
    if rnd.quorum_time is None or len(rnd.entries) < self._config.min_quorum:
      return None
    if self._everyone_reported(p):
      return min(rnd.deadline, now)
    return rnd.deadline

  def _everyone_reported(self, p: int) -> bool:
    """Whether every alive learner that has received p has a weight>0 report in p's round.

    Learners that never received p weigh 0 (docs/algorithm.md §3), so waiting for them gains nothing.
    """
    entries = self._rounds[p].entries
    return all(i in entries for i, lr in self._learners.items() if lr.alive and p in lr.delivered)

  def merge(self, p: int) -> MergeEvent | None:
    """Merges p's round into Θ_p (docs/algorithm.md §4.3-4.6), publishes version + 1 and closes the round.

    All or nothing: if the merge raises, or the outer step would produce a non-finite or
    out-of-range value (`FragmentUpdater.updated`), nothing is updated, the round closes without a
    merge, its answers are dropped and counted (`failed_merges`), and None is returned.
    """
    t0 = self._clock()
    rnd = self._rounds[p]
    contributors = tuple(sorted(rnd.entries))
    entries = [rnd.entries[i] for i in contributors]
    weights = tuple(e.weight for e in entries)
    try:
      # v_m = Θ^(base) − θ_m in float32; the base is Θ_p itself (only this round merges p).
      # An answer sent as δ is merged as decoded; one sent as θ against the base.
      base = self._versions.anchor(p, rnd.base_version)
      update = self._updater.updated(p, entries, weights, base)
    except Exception as e:  # Any failure leaves Θ_p and its optimizer state as they were.
      self._fail_round(p, e)
      return None
    self._updater.commit(p, update.opt_state)
    self._versions.publish(p, update.values, update.summary)
    self._admission.note_merged(p, [e.norm for e in entries if e.norm is not None])
    self._accounts.book_merged(p, contributors, entries)
    self._rounds.close(p)  # Answers to it are late from now on.
    t1 = self._clock()
    self._grace.observe_sync_time(max(t1 - t0, 0.0))
    return MergeEvent(
      fragment=p,
      version=self._versions.version(p),
      time=t1,
      contributors=contributors,
      weights=weights,
      tokens=sum(e.report.tokens for e in entries),
      open_time=rnd.open_time,
      quorum_time=rnd.quorum_time,
      grace_s=rnd.grace_s,
      digest=self._versions.digest(p),
    )

  def _fail_round(self, p: int, error: Exception) -> None:
    """Closes p's round without a merge: its answers are dropped and counted; Θ_p is untouched."""
    rnd = self._rounds[p]
    log.error(
      "merge of fragment %d (round step %d, %d answers) failed, nothing was updated and its "
      "answers are dropped: %s",
      p,
      rnd.step,
      len(rnd.entries),
      error,
    )
    self._accounts.count("failed_merges")
    self.drop_round(p)

  def drop_round(self, p: int) -> None:
    """Closes p's open round without a merge; its answers' tokens are dropped."""
    self._accounts.book_dropped(self._rounds[p])
    self._rounds.close(p)
