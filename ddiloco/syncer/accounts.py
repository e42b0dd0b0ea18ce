"""The syncer's counters and token ledger: what became of every answer and its tokens (docs/resilience.md)."""

from collections.abc import Iterable, Sequence

import numpy as np

from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.types import COUNTERS, Round, RoundEntry

_INT64_MAX = 2**63 - 1


def checked_add(total: int, n: int) -> int:
  """total + n for a counter that is saved as int64: saturates at int64's maximum (never reached
  with the learners' counters bounded, `protocol.MAX_TOKENS`), so it can never break a save."""
  return min(int(total) + int(n), _INT64_MAX)


class Accounts:
  """The counters (`COUNTERS`), merges per quorum size, and each learner's ledger (in its record)."""

  def __init__(self, learners: LearnerRegistry):
    self._learners = learners
    self._counters = dict.fromkeys(COUNTERS, 0)
    self._fleet_step_time: float | None = None  # When the report that set fleet_step arrived.
    # Merges per quorum size (index = number of weight>0 contributors): bounded, unlike a list.
    self._quorum_hist = np.zeros(1, np.int64)

  def count(self, name: str, n: int = 1) -> None:
    self._counters[name] = checked_add(self._counters[name], n)

  def __getitem__(self, name: str) -> int:
    return self._counters[name]

  def observe_step(self, step: int, now: float) -> None:
    """A filed weight>0 answer at schedule `step`, arrived `now`: raises `fleet_step` to it."""
    if step >= self._counters["fleet_step"]:
      self._counters["fleet_step"], self._fleet_step_time = step, now

  def ledger_in(self, learner_id: int, new_tokens: int, *, dropped: bool) -> None:
    """Books a report's ledger tokens as received, and as dropped at once if it joins no round."""
    ledger = self._learners.require(learner_id).ledger
    ledger["received"] = checked_add(ledger["received"], new_tokens)
    self.count("ledger_received", new_tokens)
    if dropped:
      ledger["dropped"] = checked_add(ledger["dropped"], new_tokens)
      self.count("ledger_dropped", new_tokens)

  def book_dropped(self, rnd: Round) -> None:
    """A round closed without a merge: its answers' tokens are dropped."""
    for i, e in rnd.entries.items():
      self.count("dropped_tokens", e.report.tokens)
      self.count("ledger_dropped", e.report.new_tokens)
      record = self._learners.get(i)
      if record is not None:
        record.ledger["dropped"] = checked_add(record.ledger["dropped"], e.report.new_tokens)

  def book_merged(self, p: int, contributors: Sequence[int], entries: Sequence[RoundEntry]) -> None:
    """A merge of p took `entries` from `contributors`: their tokens are merged."""
    tokens = sum(e.report.tokens for e in entries)
    self.count("merges")
    self.count("merged_tokens", tokens)
    for i, e in zip(contributors, entries):
      # The ledger: the report's new tokens reached Θ_p. Learners hear merged_step in heartbeats.
      self.count("ledger_merged", e.report.new_tokens)
      record = self._learners.get(i)
      if record is not None:
        record.ledger["merged"] = checked_add(record.ledger["merged"], e.report.new_tokens)
        record.merged_step[p] = max(e.report.step, record.merged_step.get(p, -1))
    if len(entries) >= len(self._quorum_hist):
      self._quorum_hist = np.pad(self._quorum_hist, (0, len(entries) + 1 - len(self._quorum_hist)))
    self._quorum_hist[len(entries)] += 1

  def merged_steps(self, learner_id: int, num_fragments: int) -> list[int]:
    """Per fragment, the step of `learner_id`'s newest report merged into it (-1: none yet).

    With `version(p)` read at the same time it settles a learner's ledger: a report of p at step s
    that a round took for version r was merged iff merged_steps[p] >= s once version(p) >= r.
    """
    record = self._learners.require(learner_id)
    return [record.merged_step.get(p, -1) for p in range(num_fragments)]

  def ledger(self, rounds: Iterable[Round]) -> dict:
    """The token ledger: totals, the tokens pending in `rounds` (the open ones), and per learner.

    Totals balance by construction of each path: received = merged + dropped + pending.
    """
    pending = {i: 0 for i, _ in self._learners.items()}
    for rnd in rounds:
      for i, e in rnd.entries.items():
        pending[i] = pending.get(i, 0) + e.report.new_tokens
    return {
      "received": self._counters["ledger_received"],
      "merged": self._counters["ledger_merged"],
      "dropped": self._counters["ledger_dropped"],
      "pending": sum(pending.values()),
      "learners": {
        i: {**lr.ledger, "pending": pending.get(i, 0)} for i, lr in sorted(self._learners.items())
      },
    }

  def stats(self) -> dict:
    """The counters, merges per quorum size and their mean."""
    out: dict = dict(self._counters)
    hist = self._quorum_hist
    out["quorum_size_counts"] = {n: int(c) for n, c in enumerate(hist) if c}
    merges = int(hist.sum())
    out["mean_quorum_size"] = float(np.arange(len(hist)) @ hist / merges) if merges else 0.0
    return out

  # -- checkpoints (`checkpoint.py`) ---------------------------------------------------------------

  def counters(self) -> dict[str, int]:
    return dict(self._counters)

  def quorum_hist(self) -> np.ndarray:
    return self._quorum_hist.copy()

  def fleet_step_time(self) -> float | None:
    return self._fleet_step_time

  def restore(
    self, counters: dict[str, int], quorum_hist: np.ndarray, fleet_step_time: float | None
  ) -> None:
    """Replaces the counters, the quorum histogram and the fleet step's time (a checkpoint's)."""
    self._counters = counters
    self._quorum_hist = quorum_hist
    self._fleet_step_time = fleet_step_time
