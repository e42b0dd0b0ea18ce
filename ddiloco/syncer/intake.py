"""Filing learners' answers into their rounds: admitted, late, weight 0, duplicate or superseded, and
the quorum and grace deadline each filed answer may set (docs/algorithm.md §3, §4.1-4.2)."""

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping

from ddiloco.fragments import buffers
from ddiloco.syncer.accounts import Accounts
from ddiloco.syncer.admission import Admission, fingerprint
from ddiloco.syncer.grace import GraceModel
from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.pacing import RoundPacer
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.types import Report, ReportResult, RoundEntry, SyncerConfig
from ddiloco.syncer.versions import VersionStore


class ReportIntake:
  """Takes each answer through the door (`Admission`) into its round, booking what it counts."""

  def __init__(
    self,
    *,
    config: SyncerConfig,
    clock: Callable[[], float],
    embedding_keys: Collection[str],
    grace: GraceModel,
    learners: LearnerRegistry,
    versions: VersionStore,
    rounds: RoundTable,
    pacer: RoundPacer,
    admission: Admission,
    accounts: Accounts,
  ):
    self._config = config
    self._clock = clock
    self._embedding_keys = frozenset(embedding_keys)
    self._grace = grace
    self._learners = learners
    self._versions = versions
    self._rounds = rounds
    self._pacer = pacer
    self._admission = admission
    self._accounts = accounts

  def file(self, r: Report, copy: bool = True) -> ReportResult:
    """Validates an answer and files it (see `SyncerCore.report`); its `fleet_step` is the caller's."""
    reason = self._admission.invalid_header(r)
    if reason is not None:
      self._accounts.count("rejected")
      return ReportResult("rejected", reason, 0.0)
    replay = self.replayed(r.learner_id, r.fragment, r.round_step, fingerprint(r))
    if replay is not None:
      return replay
    reason, sq_norms = self._admission.invalid_values(r)
    if reason is None and sq_norms is not None:
      reason = self._admission.implausible(r.fragment, sq_norms)
      if reason is not None:
        self._accounts.count("implausible")
    if reason is not None:
      self._accounts.count("rejected")
      return ReportResult("rejected", reason, 0.0)
    result = self._file_valid(r, sq_norms, copy)
    if result.status != "duplicate":
      self._admission.remember(r, result)
    return result

  def replayed(
    self, learner_id: int, fragment: int, round_step: int, fingerprint: tuple
  ) -> ReportResult | None:
    """The result a learner's earlier, identical answer to this round got, or None (see
    `Admission.replayed`); counted as "replayed"."""
    seen = self._admission.replayed(learner_id, fragment, round_step, fingerprint)
    if seen is None:
      return None
    self._accounts.count("replayed")
    return dataclasses.replace(seen, fleet_step=self._pacer.cadence_step())

  def _file_valid(
    self, r: Report, sq_norms: Mapping[str, float] | None, copy: bool
  ) -> ReportResult:
    if r.step_time_s > 0:
      self._grace.observe_step_time(r.step_time_s)
    self._learners.observe_progress(r.learner_id, r.step, r.step_time_s)
    p, learner = r.fragment, self._learners.require(r.learner_id)
    late = self._rounds.late_reason(p, r.round_step)
    if late is not None:
      return self.drop_late(
        r.tokens,
        late,
        learner_id=r.learner_id,
        new_tokens=r.new_tokens,
        fragment=p,
        round_step=r.round_step,
      )
    rnd = self._rounds[p]
    if p not in learner.delivered or r.anchor_version < 0:
      return self._zero_weight(
        r, f"learner has not received fragment {p} since registering (docs/algorithm.md §3)"
      )
    if r.anchor_version != rnd.base_version:
      return self._zero_weight(
        r,
        f"answered against version {r.anchor_version}; round ({p}, {rnd.step}) is based on "
        f"version {rnd.base_version}",
      )
    weight = self._admission.weight(r)
    if weight == 0:
      if r.tokens == 0 or r.steps == 0:
        return self._zero_weight(
          r, "no tokens or steps since the last receipt (docs/algorithm.md §4.4)"
        )
      return self._zero_weight(r, f"the merge rule {self._config.merge_rule!r} gives it weight 0")
    prev = rnd.entries.get(r.learner_id)
    status = "accepted"
    new_tokens = r.new_tokens
    if prev is not None:
      # One answer per learner and round; a restarted learner (a newer registration) may answer
      # again, and its answer replaces the lost process's.
      if prev.epoch == learner.epoch:
        self._accounts.count("duplicate")
        self._accounts.ledger_in(r.learner_id, r.new_tokens, dropped=True)
        return ReportResult(
          "duplicate", f"learner {r.learner_id} already answered round ({p}, {rnd.step})", 0.0
        )
      status = "superseded"
      # The newer θ_p holds the older report's progress too: its ledger tokens ride along.
      new_tokens += prev.report.new_tokens
    self._accounts.ledger_in(r.learner_id, r.new_tokens, dropped=False)
    # Aligned: the outer step reads them through XLA without a copy (fragments/buffers.py).
    values = {k: buffers.aligned_copy(v) if copy else v for k, v in r.values.items()}
    rule_norms = None  # Kept for the merge if its rule reads them (embeddings take the mean).
    if sq_norms is not None and self._config.merge_rule.needs_norms:
      rule_norms = {k: sq for k, sq in sq_norms.items() if k not in self._embedding_keys}
    rnd.entries[r.learner_id] = RoundEntry(
      dataclasses.replace(r, values=values, new_tokens=new_tokens),
      weight,
      learner.epoch,
      sq_norms=rule_norms,
      norm=None if sq_norms is None else math.sqrt(sum(sq_norms.values())),
    )
    self._accounts.count(status)
    now = self._clock()
    self._accounts.observe_step(r.step, now)
    if rnd.first_time is None:
      rnd.first_time = now
    else:
      self._grace.observe_answer_delay(max(now - rnd.first_time, 0.0))
    if rnd.quorum_time is None and len(rnd.entries) >= self._config.min_quorum:
      # docs/algorithm.md §4.1-4.2: the grace window starts at the quorum and is fixed then. ξ_quorum is the
      # wait from the round's first answer to its quorum (0 for K = 1), not from its opening: the
      # learner that answered first started its τ steps when it answered, so the time before its
      # answer arrived is not slack it has spent (docs/algorithm.md, "grace window").
      rnd.quorum_time = now
      self._grace.observe_quorum_wait(max(now - rnd.first_time, 0.0))
      rnd.grace_s = self._grace.window() if self._config.use_grace else 0.0
      rnd.deadline = now + rnd.grace_s
    return ReportResult(status, "", weight, round_version=self._versions.version(p) + 1)

  def drop_late(
    self,
    tokens: int,
    reason: str,
    *,
    learner_id: int | None = None,
    new_tokens: int = 0,
    fragment: int | None = None,
    round_step: int | None = None,
  ) -> ReportResult:
    """Counts a late report and its tokens as dropped (docs/algorithm.md §4); the state is otherwise untouched.

    `learner_id` and `new_tokens` book the report in the token ledger (a registered learner's).
    `fragment` and `round_step` name its round: if that is p's last closed round, the answer's
    delay after the round's first answer feeds the grace window's spread (syncer/grace.py), which
    would otherwise only ever see the answers that made it.
    """
    closed = (
      self._rounds.closed_first(fragment)
      if fragment in range(self._versions.num_fragments)
      else None
    )
    if closed is not None and closed[0] == round_step:
      self._grace.observe_answer_delay(max(self._clock() - closed[1], 0.0))
    self._accounts.count("late")
    self._accounts.count("dropped_tokens", int(tokens))
    if learner_id in self._learners:
      self._accounts.ledger_in(learner_id, max(int(new_tokens), 0), dropped=True)
    return ReportResult("late", reason, 0.0, self._pacer.cadence_step())

  def _zero_weight(self, r: Report, reason: str) -> ReportResult:
    self._accounts.count("accepted")
    self._accounts.count("zero_weight_reports")
    self._accounts.count("zero_weight_tokens", r.tokens)
    # Weight 0 never touches the merge, so its ledger tokens are dropped (docs/algorithm.md §3).
    self._accounts.ledger_in(r.learner_id, r.new_tokens, dropped=True)
    return ReportResult("accepted", f"weight 0: {reason}", 0.0)
