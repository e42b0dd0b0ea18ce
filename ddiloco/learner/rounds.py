"""A learner's book of rounds, per fragment: those asked for and not answered yet, the newest it
answered, and the answers whose merge it has not applied yet (docs/algorithm.md §3)."""

import dataclasses
from collections.abc import Container, Iterable

import numpy as np

from ddiloco.protocol import RoundRequest


@dataclasses.dataclass
class _Outstanding:
  """An answered round of a fragment whose merge has not been applied yet."""

  send_step: int
  apply_step: int
  round_step: int


class RoundBook:
  """The rounds of one learner's fragments (see module docstring); `Learner` decides with it."""

  def __init__(self, num_fragments: int):
    self._requests: dict[int, RoundRequest] = {}  # Rounds asked for and not answered yet.
    # Round step of the newest answer, per fragment.
    self._answered = np.full(num_fragments, -1, np.int64)
    self._outstanding: dict[int, _Outstanding] = {}

  def ask(self, request: RoundRequest, newest: int) -> None:
    """Records round (p, t) unless its base is older than `newest`, the newest version of p held
    or received (that round has merged). A newer round of p replaces an unanswered older one."""
    if request.base_version < newest:
      self._answered[request.fragment] = max(self._answered[request.fragment], request.round_step)
      return  # That round merged without this learner: nothing to answer, nor to wait for.
    p = request.fragment
    old = self._requests.get(p)
    if old is None or request.round_step > old.round_step:
      self._requests[p] = request

  def pending(self) -> dict[int, RoundRequest]:
    """The rounds asked for and not answered yet, by fragment."""
    return dict(self._requests)

  def request(self, p: int) -> RoundRequest | None:
    """p's round asked for and not answered yet, or None."""
    return self._requests.get(p)

  def answer(self, p: int, send_step: int, apply_step: int) -> int:
    """Answers p's pending round at `send_step` (without one: an unsolicited report), outstanding
    until its merge is applied (not before `apply_step`). Returns the round's step (-1: none)."""
    request = self._requests.pop(p, None)
    round_step = request.round_step if request is not None else -1
    self._answered[p] = max(self._answered[p], round_step)
    self._outstanding[p] = _Outstanding(send_step, apply_step, round_step)
    return round_step

  def sent_step(self, p: int) -> int:
    """The step of p's last answer still outstanding (-1: none)."""
    out = self._outstanding.get(p)
    return out.send_step if out is not None else -1

  def apply_step(self, p: int) -> int | None:
    """The step from which the merge of p's outstanding answer applies (None: none outstanding)."""
    out = self._outstanding.get(p)
    return out.apply_step if out is not None else None

  def received(self, p: int, version: int) -> None:
    """Version `version` of p arrived: an unanswered request of an older base has merged."""
    request = self._requests.get(p)
    if request is not None and request.base_version < version:
      del self._requests[p]  # Merged without this learner: a blocking one waits for it no more.
      self._answered[p] = max(self._answered[p], request.round_step)

  def applied(self, p: int) -> None:
    """A version of p was applied: nothing of p is outstanding any more."""
    self._outstanding.pop(p, None)

  def answered_up_to(self, step: int) -> None:
    """Counts every round up to `step` as answered (the fleet's before this learner (re)joined)."""
    self._answered = np.maximum(self._answered, step)

  def unanswered(self, fragments: Iterable[int], step: int) -> bool:
    """Whether any of `fragments` has its round of `step` not answered yet."""
    return any(self._answered[p] < step for p in fragments)

  def awaiting_merge(self, step: int, arrived: Container[int]) -> bool:
    """Whether an answer's merge is due by `step` and its fragment is not in `arrived`."""
    return any(step >= out.apply_step and p not in arrived for p, out in self._outstanding.items())

  def clear(self) -> None:
    """Forgets every round (the learner loaded the global model)."""
    self._outstanding.clear()
    self._requests.clear()
