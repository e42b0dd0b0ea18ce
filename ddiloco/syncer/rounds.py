"""Each fragment's round: the open one, and which round steps were opened and are closed (docs/algorithm.md,
"Rounds")."""

import collections
from collections.abc import Iterable

from ddiloco.protocol import MAX_STEP
from ddiloco.syncer.types import Round, RoundRequest

_RECENT_ROUNDS = 16  # Round steps remembered per fragment (`status`).


class RoundTable:
  """Per fragment, its open round (or none), its newest round step and its recent round steps.

  An answer to one of the recent steps (closed) is late, one to any other step was never asked for.
  """

  def __init__(self, num_fragments: int):
    num = num_fragments
    self._rounds = [Round() for _ in range(num)]
    self._last_round_step = [-1] * num  # Step of each fragment's newest round, open or closed.
    # Steps of each fragment's recent rounds: an answer to one of them (closed) is late, one to any
    # other step was never asked for. Steps up to `_rounds_known_after` are too old to tell (or
    # from before a restore) and count as closed. Not saved.
    self._recent_rounds = [collections.deque(maxlen=_RECENT_ROUNDS) for _ in range(num)]
    self._rounds_known_after = [-1] * num
    # Set by a restore (`restore`): the restored syncer's first tick closes every round step
    # before it (`settle_restore`).
    self._restored = False
    # Per fragment, (round step, first answer's time) of its last closed round: a late answer to it
    # still tells the grace window how long answers take (`GraceModel.observe_answer_delay`).
    self._closed_first: list[tuple[int, float] | None] = [None] * num

  def __getitem__(self, p: int) -> Round:
    """Fragment p's round (step -1: none open); the core files answers into its entries."""
    return self._rounds[p]

  def __iter__(self):
    return iter(self._rounds)

  def is_open(self, p: int) -> bool:
    return self._rounds[p].step >= 0

  def last_step(self, p: int) -> int:
    """The step of p's newest round, open or closed (-1: none yet)."""
    return self._last_round_step[p]

  def newest_step(self) -> int:
    """The step of the newest round of any fragment (-1: none yet)."""
    return max(self._last_round_step)

  def closed_first(self, p: int) -> tuple[int, float] | None:
    """(round step, first answer's time) of p's last closed round that had an answer, or None."""
    return self._closed_first[p]

  def open(self, p: int, step: int, base_version: int, now: float) -> None:
    """Opens round (p, step) against `base_version` (p has no open round; step is after its newest)."""
    self._rounds[p] = Round(step=step, base_version=base_version, open_time=now)
    self._last_round_step[p] = step
    recent = self._recent_rounds[p]
    if len(recent) == recent.maxlen:
      self._rounds_known_after[p] = recent[0]
    recent.append(step)

  def close(self, p: int) -> None:
    """Closes p's round: answers to it are late from now on."""
    rnd = self._rounds[p]
    if rnd.first_time is not None:
      self._closed_first[p] = (rnd.step, rnd.first_time)
    self._rounds[p] = Round()

  def open_requests(self) -> list[RoundRequest]:
    """The rounds open now."""
    return [
      RoundRequest(p, rnd.step, rnd.base_version)
      for p, rnd in enumerate(self._rounds)
      if rnd.step >= 0
    ]

  def status(self, p: int, round_step: int) -> str:
    """ "open", "closed" or "never" (opened) for round (p, round_step)."""
    rnd = self._rounds[p]
    if round_step < 0 or round_step > MAX_STEP:
      return "never"
    if round_step > self._last_round_step[p]:
      # Restored and not ticked yet: such a round can only be the lost incarnation's.
      return "closed" if self._restored else "never"
    if rnd.step >= 0 and round_step == rnd.step:
      return "open"
    if round_step in self._recent_rounds[p] or round_step <= self._rounds_known_after[p]:
      return "closed"  # Or too old to tell (then it cannot be open either).
    return "never"

  def late_reason(self, fragment: int, round_step: int) -> str | None:
    """Why an answer to round (fragment, round_step) comes too late, or None."""
    if self.status(fragment, round_step) == "closed":
      return f"round ({fragment}, {round_step}) is closed"
    return None  # Open, or never opened (`Admission.invalid_header` rejects that).

  def settle_restore(self, first_step: int) -> None:
    """At a restored syncer's first tick (step clock at `first_step`): closes every round before it.

    Rounds the lost incarnation opened after its checkpoint are unknown here; the learners may
    still answer them. They are closed (their answers late: dropped and counted), not "never
    opened" (refused as invalid): every step before this first tick's.
    """
    if not self._restored:
      return
    self._restored = False
    before = first_step - 1
    for p in range(len(self._rounds)):
      self._last_round_step[p] = max(self._last_round_step[p], before)
      self._rounds_known_after[p] = max(self._rounds_known_after[p], before)

  def restore(
    self,
    rounds: list[Round],
    last_steps: Iterable[int],
    closed_first: list[tuple[int, float] | None],
  ) -> None:
    """Replaces every round with a checkpoint's; rounds up to the newest are too old to tell apart."""
    self._rounds = rounds
    self._last_round_step = [max(last, rounds[p].step) for p, last in enumerate(last_steps)]
    self._recent_rounds = [collections.deque(maxlen=r.maxlen) for r in self._recent_rounds]
    self._rounds_known_after = list(self._last_round_step)
    self._restored = True
    self._closed_first = closed_first
