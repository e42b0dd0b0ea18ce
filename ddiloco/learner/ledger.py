"""A learner's token ledger: where every token it trained went, fragment by fragment.

Each inner step trains every fragment on the batch's tokens (docs/algorithm.md §3), so for each fragment p the
learner's trained tokens are followed, as `new_tokens` of the reports that carry them, to one fate:

  unsent      trained since the last report of p; still only on this learner.
  awaiting    in a report handed to the sender and not yet answered (queued, on the wire, retried).
  pending     in a report a round took (accepted or superseded, weight > 0): merged once the round is.
  merged      the round holding the report (or a newer report of this learner that superseded it)
              published: the tokens' progress on p reached the global model.
  dropped     never will: the report was late, a duplicate, weight 0 or refused; the round was lost in
              a syncer restart; or the learner overwrote its unsent progress on p with the global values
              (an α = 0 apply, docs/algorithm.md §3, or a (re)load at registration). An apply with
              the `carry` rule keeps the progress since the answer, which stays unsent.

so that, for every p, trained = unsent + awaiting + pending + merged + dropped, where "in flight" is
unsent + awaiting + pending. The syncer books the same reports on its side (`SyncerCore.ledger`):
received = merged + dropped + pending. A learner learns that a pending report merged from its
heartbeats: the syncer sends, with the fragment versions, the step of its newest report merged into
each fragment (`merged_steps`). A report at step s taken by the round for version r was merged iff
merged_steps[p] >= s; once version(p) >= r without that, the round was lost (a restart).

Counts are in token-fragments; `totals` also gives them per fragment on average (divide by P), and
`merged_fraction`, the share of trained work that reached the global model: the learner's goodput in
the sense of "steps that reached the global model".
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

_TAKEN = ("accepted", "superseded")
FATES = ("unsent", "awaiting", "pending", "merged", "dropped")


def taken(status: str, weight: float, round_version: int) -> bool:
  """Whether the syncer's answer to a report means a round took it: it merges once the round does."""
  return status in _TAKEN and weight > 0 and round_version >= 0


@dataclasses.dataclass(frozen=True)
class _Pending:
  step: int  # The report's schedule step.
  tokens: int  # Its new_tokens.
  round_version: int  # The version its round will publish.


class TokenLedger:
  """Books one learner's trained tokens per fragment (see module docstring).

  Args:
    num_fragments: P.
  """

  def __init__(self, num_fragments: int):
    if num_fragments < 1:
      raise ValueError(f"num_fragments must be >= 1, got {num_fragments}.")
    self.num_fragments = num_fragments
    self.trained = 0
    self._unsent = np.zeros(num_fragments, np.int64)
    self._merged = np.zeros(num_fragments, np.int64)
    self._dropped = np.zeros(num_fragments, np.int64)
    self._awaiting: list[dict[int, int]] = [{} for _ in range(num_fragments)]
    self._pending: list[list[_Pending]] = [[] for _ in range(num_fragments)]

  # -- the learner's events ---------------------------------------------------------------------

  def train(self, tokens: int) -> None:
    """An inner step on `tokens` tokens: every fragment trained on them."""
    if tokens < 0:
      raise ValueError(f"tokens must be >= 0, got {tokens}.")
    self.trained += tokens
    self._unsent += tokens

  def send(self, p: int, step: int) -> int:
    """A report of p at schedule step `step` takes p's unsent tokens; returns them (its new_tokens)."""
    n = int(self._unsent[p])
    self._unsent[p] = 0
    self._awaiting[p][step] = self._awaiting[p].get(step, 0) + n
    return n

  def fold(self, p: int, old_step: int, new_step: int) -> int:
    """A queued report of p (at `old_step`) was replaced before it was pushed by the one at
    `new_step`, whose θ_p holds its progress: its tokens move over. Returns the tokens moved."""
    n = self._awaiting[p].pop(old_step, 0)
    if n:
      self._awaiting[p][new_step] = self._awaiting[p].get(new_step, 0) + n
    return n

  def answered(self, p: int, step: int, status: str, weight: float, round_version: int) -> None:
    """The syncer answered the report of p at `step`: a round took it (pending) or not (dropped)."""
    n = self._awaiting[p].pop(step, 0)
    if taken(status, weight, round_version):
      self._pending[p].append(_Pending(step, n, round_version))
    else:
      self._dropped[p] += n

  def overwritten(self, p: int, *, keep: int = 0) -> int:
    """θ_p was overwritten with the global values: the unsent progress on p is gone, but for the
    `keep` tokens of it that the apply carried over (learner/carry.py), which stay unsent. Returns
    the tokens dropped."""
    kept = min(max(int(keep), 0), int(self._unsent[p]))
    n = int(self._unsent[p]) - kept
    self._dropped[p] += n
    self._unsent[p] = kept
    return n

  def settle(self, versions: Sequence[int], merged_steps: Sequence[int]) -> int:
    """Resolves pending reports with a heartbeat's versions and merged steps (read together).

    Returns the number of reports resolved.
    """
    if len(merged_steps) != self.num_fragments or len(versions) != self.num_fragments:
      return 0  # Not a ledger-aware syncer (or not registered): nothing to learn.
    resolved = 0
    for p in range(self.num_fragments):
      keep = []
      for e in self._pending[p]:
        if merged_steps[p] >= e.step:
          self._merged[p] += e.tokens
        elif versions[p] >= e.round_version:
          self._dropped[p] += e.tokens  # Its round published without it: lost in a restart.
        else:
          keep.append(e)
          continue
        resolved += 1
      self._pending[p] = keep
    return resolved

  def restored(self) -> None:
    """After a restore from a checkpoint: reports awaiting an answer when it was saved may have been
    answered since, by the syncer, to a process that died. They become pending with round version 0,
    so the next heartbeat settles them: merged if the syncer merged them, dropped otherwise."""
    for p in range(self.num_fragments):
      for step, n in sorted(self._awaiting[p].items()):
        self._pending[p].append(_Pending(step, n, 0))
      self._awaiting[p] = {}

  # -- reading ------------------------------------------------------------------------------------

  def fates(self) -> dict[str, int]:
    """Each fate's token-fragments, summed over fragments."""
    return {
      "unsent": int(self._unsent.sum()),
      "awaiting": sum(sum(a.values()) for a in self._awaiting),
      "pending": sum(e.tokens for q in self._pending for e in q),
      "merged": int(self._merged.sum()),
      "dropped": int(self._dropped.sum()),
    }

  def totals(self) -> dict[str, Any]:
    """The ledger for summaries: fates per fragment on average, whether it balances, goodput."""
    fates = self.fates()
    num = self.num_fragments
    booked = sum(fates.values())
    return {
      "trained": self.trained,
      **{k: v / num for k, v in fates.items()},
      "in_flight": (fates["unsent"] + fates["awaiting"] + fates["pending"]) / num,
      "balanced": booked == self.trained * num,
      "merged_fraction": fates["merged"] / (self.trained * num) if self.trained else 0.0,
      "num_fragments": num,
      "token_fragments": fates,  # The exact integer counts behind the averages.
    }

  def state(self) -> dict[str, Any]:
    """A JSON-able copy, for the learner's checkpoint."""
    return {
      "trained": self.trained,
      "unsent": self._unsent.tolist(),
      "merged": self._merged.tolist(),
      "dropped": self._dropped.tolist(),
      "awaiting": [[[s, n] for s, n in sorted(a.items())] for a in self._awaiting],
      "pending": [[[e.step, e.tokens, e.round_version] for e in q] for q in self._pending],
    }

  def load_state(self, state: dict[str, Any]) -> None:
    """Restores `state()`.

    Raises:
      ValueError: if it was saved for another number of fragments.
    """
    if len(state["unsent"]) != self.num_fragments:
      raise ValueError(
        f"Ledger state has {len(state['unsent'])} fragments, this learner {self.num_fragments}."
      )
    self.trained = int(state["trained"])
    self._unsent = np.array(state["unsent"], np.int64)
    self._merged = np.array(state["merged"], np.int64)
    self._dropped = np.array(state["dropped"], np.int64)
    self._awaiting = [{int(s): int(n) for s, n in a} for a in state["awaiting"]]
    self._pending = [[_Pending(int(s), int(n), int(r)) for s, n, r in q] for q in state["pending"]]
