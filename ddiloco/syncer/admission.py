"""Admission of learners' answers at the door: header and value checks, the plausibility bound and
the memory of recent answers that makes a retry idempotent (docs/resilience.md)."""

import collections
import math
import numbers
import statistics
from collections.abc import Mapping

import numpy as np

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import counter_error, holds_values_of, step_time_error
from ddiloco.syncer import blockwise
from ddiloco.syncer import merge as merge_lib
from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.types import Report, ReportResult, SyncerConfig
from ddiloco.syncer.versions import VersionStore, non_finite

_RECENT_NORMS = 32  # Merged answers' outer-gradient norms remembered per fragment.
_ANSWERS_PER_FRAGMENT = 4  # Recent answers remembered per learner and fragment (retries).


def fingerprint(r: Report) -> tuple:
  """What makes two answers to one round the same answer (a retry): their counters."""
  return (r.step, r.tokens, r.steps, r.new_tokens, r.anchor_version)


class Admission:
  """Decides whether an answer may be filed, from the learners, the versions and the rounds it reads.

  Changes nothing it reads; it keeps only its own memory: each learner's recent answers and
  results (`remember`), and each fragment's recent merged outer-gradient norms (`note_merged`).
  """

  def __init__(
    self,
    *,
    config: SyncerConfig,
    schedule: FragmentSchedule,
    learners: LearnerRegistry,
    versions: VersionStore,
    rounds: RoundTable,
  ):
    self._config = config
    self._schedule = schedule
    self._learners = learners
    self._versions = versions
    self._rounds = rounds
    # The outer-gradient norms of recent merged answers: with ‖Θ_p‖, the scales of the
    # plausibility bound (`implausible`). Not saved: a restored syncer starts the recent norms
    # afresh.
    self._recent_norms = [
      collections.deque(maxlen=_RECENT_NORMS) for _ in range(versions.num_fragments)
    ]

  def replayed(
    self, learner_id: int, fragment: int, round_step: int, fingerprint: tuple
  ) -> ReportResult | None:
    """The result a learner's earlier, identical answer to this round got, or None.

    A learner that lost the reply to an answer (a timeout, a dropped connection) sends it again:
    the retry gets the first answer's result and is neither filed, merged nor booked twice
    (`ReportIntake.replayed` counts it as "replayed"). Identical means the same registration, round and counters
    (`fingerprint`: step, tokens, steps, new tokens, anchor version), with nothing delivered to
    the learner since (a weight-0 answer may be answered again once the learner holds the
    fragment); a different second answer to the same round is a duplicate. A transport may ask
    before decoding a push.
    """
    learner = self._learners.get(learner_id)
    if learner is None:
      return None
    seen = learner.answers.get((fragment, round_step))
    now = (learner.epoch, tuple(fingerprint), learner.delivered.get(fragment))
    if seen is None or seen[:3] != now:
      return None
    return seen[3]

  def remember(self, r: Report, result: ReportResult) -> None:
    """Keeps `result` as the answer to a retry of `r` (the oldest answers are forgotten)."""
    learner = self._learners.require(r.learner_id)
    answers = learner.answers
    key = (r.fragment, r.round_step)
    answers[key] = (learner.epoch, fingerprint(r), learner.delivered.get(r.fragment), result)
    answers.move_to_end(key)
    while len(answers) > _ANSWERS_PER_FRAGMENT * self._versions.num_fragments:
      answers.popitem(last=False)

  def note_merged(self, p: int, norms: list[float]) -> None:
    """Records the outer-gradient norms of the answers a merge of p took."""
    self._recent_norms[p].extend(norms)

  def implausible(self, p: int, sq_norms: Mapping[str, float]) -> str | None:
    """Why an answer's outer gradient is out of scale (`SyncerConfig.max_update_ratio`), or None."""
    norm = math.sqrt(sum(sq_norms.values()))
    if not math.isfinite(norm):
      return f"the outer gradient of fragment {p} overflows (its norm is not finite)"
    ratio = self._config.max_update_ratio
    recent = self._recent_norms[p]
    scale = max(self._versions.theta_norm(p), statistics.median(recent) if recent else 0.0)
    if ratio > 0 and scale > 0 and norm > ratio * scale:
      return (
        f"implausible outer gradient: its norm {norm:.4g} exceeds {ratio:g} x {scale:.4g}, the "
        f"larger of the norm of fragment {p} and the median norm of its recent merged answers"
      )
    return None

  def invalid_values(self, r: Report) -> tuple[str | None, dict[str, float] | None]:
    """Validates a valid-header report's values at the door.

    Returns:
      (why it must be rejected, or None; every tensor's squared outer-gradient norm if it will
      join a round (`_joins`), else None).
    """
    expected = self._versions.values(r.fragment)
    missing = sorted(set(expected) - set(r.values))
    extra = sorted(set(r.values) - set(expected))
    if missing or extra:
      return (
        f"keys differ from fragment {r.fragment}: missing {missing[:3]}, extra {extra[:3]}",
        None,
      )
    # The finiteness check is the door's one pass over the values. For a report that will join a
    # round it also sums ‖Θ^(anchor) − θ_m‖² per tensor: the plausibility bound needs them, and
    # a merge rule that reads the norms (RDA) is spared its first pass over the contributions
    # (the anchor is fixed once filed).
    joins = self._joins(r)
    # An outer gradient as sent (δ) is its own v_m; for θ, v_m = Θ^(anchor) − θ.
    anchor = (
      None if not joins or r.outer_gradient else self._versions.anchor(r.fragment, r.anchor_version)
    )
    sq_norms = {} if joins else None
    # δ's norms summed by the transport as the values arrived (`Report.sq_norms`): the same sums.
    summed = r.sq_norms if r.outer_gradient and r.sq_norms is not None else {}
    for k, ref in expected.items():
      v = np.asarray(r.values[k])
      if v.shape != ref.shape or not holds_values_of(v.dtype, ref.dtype, r.outer_gradient):
        return f"{k!r} is {v.dtype}{list(v.shape)}, expected {ref.dtype}{list(ref.shape)}", None
      if k in summed:  # Every block's dot product finite: the values are.
        if sq_norms is not None:
          sq_norms[k] = summed[k]
      elif sq_norms is not None:
        sq = merge_lib.finite_sq_norm(None if anchor is None else anchor[k], v)  # None: NaN/Inf.
        if sq is None:
          return non_finite(k, v), None
        sq_norms[k] = sq
      elif not blockwise.all_finite(v):  # Blockwise: no full-size bool temporary.
        return non_finite(k, v), None
    return None, sq_norms

  def invalid_header(self, r: Report) -> str | None:
    """Why a report's fragment, learner, counters or anchor version are invalid, or None."""
    num = self._versions.num_fragments
    if not isinstance(r.fragment, int | np.integer) or not 0 <= r.fragment < num:
      return f"unknown fragment {r.fragment!r}; this syncer holds 0..{num - 1}"
    learner = self._learners.get(r.learner_id)
    if learner is None:
      return f"learner {r.learner_id} is not registered"
    if not learner.alive:
      return f"learner {r.learner_id} is not alive; it must register again"
    for name in ("anchor_version", "round_step"):
      value = getattr(r, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return f"{name} must be an integer, got {value!r}"
    reason = counter_error(
      tokens=r.tokens, steps=r.steps, step=r.step, new_tokens=r.new_tokens
    ) or step_time_error(r.step_time_s)
    if reason is not None:
      return reason
    per_step = self._config.max_tokens_per_step
    if per_step is not None and r.tokens > r.steps * per_step:
      return (
        f"{r.tokens} tokens in {r.steps} steps: more than the {per_step} tokens per step a "
        "learner's batch can hold"
      )
    if not isinstance(r.outer_gradient, bool | np.bool_):
      return f"outer_gradient must be a bool, got {r.outer_gradient!r}"
    if r.outer_gradient and r.anchor_version < 0:
      return "an outer gradient needs the anchor version it was taken against (got -1)"
    cur = self._versions.version(r.fragment)
    if r.anchor_version < -1 or r.anchor_version > cur:
      return (
        f"anchor_version {r.anchor_version} outside [-1, {cur}] (current version of {r.fragment})"
      )
    if self._rounds.status(r.fragment, r.round_step) == "never":
      return f"round ({r.fragment}, {r.round_step}) was never opened"
    return None

  def _joins(self, r: Report) -> bool:
    """Whether the core will put a valid-header report in a round with a weight above 0.

    Only then are its norms needed; otherwise (weight 0, late) the door only checks finiteness.
    """
    p, learner = r.fragment, self._learners.require(r.learner_id)
    if p not in learner.delivered:
      return False
    if self._rounds.late_reason(p, r.round_step) is not None:
      return False
    if r.anchor_version != self._rounds[p].base_version:
      return False
    return self.weight(r) > 0

  def weight(self, r: Report) -> float:
    """The weight the merge rule gives an answer that joins its round (`MergeRule.weight`).

    Raises:
      ValueError: if the rule's weight is not finite and >= 0 (a bug in the rule).
    """
    rule = self._config.merge_rule
    w = rule.weight(r, self._schedule)
    if not (isinstance(w, numbers.Real) and math.isfinite(w) and w >= 0):
      raise ValueError(f"The merge rule {rule!r} gave weight {w!r}; weights are finite and >= 0.")
    return float(w)
