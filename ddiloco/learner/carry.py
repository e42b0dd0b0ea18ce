"""The `carry` apply rule: a merge's apply keeps the progress a learner made after its answer.

With the default rule (`overwrite`, α = 0) applying the merged Θ_p overwrites θ_p, and with it the
τ steps the learner trained on p between its answer and the apply (docs/algorithm.md §3). With
`carry`, when Θ_p is the merge of a round this learner answered,

  θ_p ← Θ_p + (θ_p − θ_p^answered)

where θ_p^answered is the exact θ_p its answer sent: the steps since the answer, which no merge holds
yet, stay in θ_p and go out with the next answer (an eager, or delayed, correction of the
communication the steps overlapped). The counters of p then keep the tokens and steps trained since
the answer instead of restarting at 0, and the token ledger books nothing of them as dropped. A
version of a round this learner did not answer (it joined later, its request was dropped, or the
syncer refused its answer) still overwrites.

`AnswerBook` keeps, per fragment, the newest answer whose merge has not been applied: one θ_p per
fragment at most, and only while its round is outstanding (τ steps, or until the syncer refuses it).
"""

import dataclasses
from collections.abc import Callable

import numpy as np

APPLY_RULES = ("overwrite", "carry")


@dataclasses.dataclass
class Answer:
  """An answer whose merge has not been applied yet.

  Attributes:
    step: the schedule step the answer was made at (its ledger key).
    tokens: counters[p].tokens the answer carried.
    steps: counters[p].steps the answer carried.
    values: θ_p^answered on the host, keyed as the layout keys it; or None, and then `fetch` copies
      it from the device copy the answer's snapshot holds (kept on the device until the apply).
    fetch: see `values`.
    refused: the syncer answered that no round took it (late, duplicate, rejected, weight 0).
  """

  step: int
  tokens: int
  steps: int
  values: dict[str, np.ndarray] | None = None
  fetch: Callable[[], dict[str, np.ndarray]] | None = None
  refused: bool = False

  def host_values(self) -> dict[str, np.ndarray]:
    """θ_p^answered on the host."""
    if self.values is None:
      if self.fetch is None:
        raise RuntimeError("An answer without values nor a way to fetch them.")
      self.values = self.fetch()
    return self.values


class AnswerBook:
  """Per fragment, the newest answer whose merge has not been applied (see module docstring)."""

  def __init__(self):
    self._answers: dict[int, Answer] = {}
    self.carried = 0  # Applies that carried an answer's progress over (`take` returned it).

  def record(self, p: int, answer: Answer) -> None:
    """p was answered: this answer replaces any older one of p."""
    self._answers[p] = answer

  def result(self, p: int, step: int, taken: bool) -> None:
    """The syncer answered p's answer at `step`: a round took it, or not (`taken`)."""
    answer = self._answers.get(p)
    if answer is not None and answer.step == step and not taken:
      answer.refused = True

  def take(self, p: int) -> Answer | None:
    """Forgets p's answer (its fragment is being applied); returns it unless the syncer refused it."""
    answer = self._answers.pop(p, None)
    if answer is None or answer.refused:
      return None
    self.carried += 1
    return answer

  def clear(self) -> None:
    """Forgets every answer (the learner loaded the global model)."""
    self._answers.clear()

  def __len__(self) -> int:
    return len(self._answers)


def mixed(
  merged: dict[str, np.ndarray], mine: dict[str, np.ndarray], alpha: float
) -> dict[str, np.ndarray]:
  """(1 − α)·Θ_p + α·θ_p, key by key, in θ_p's dtype: Streaming DiLoCo's mix (`mixing_alpha`)."""
  return {k: ((1 - alpha) * merged[k] + alpha * mine[k]).astype(mine[k].dtype) for k in merged}


def carried(
  merged: dict[str, np.ndarray], mine: dict[str, np.ndarray], answered: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
  """Θ_p + (θ_p − θ_p^answered), key by key, in θ_p's dtype (computed in at least float32).

  Raises:
    ValueError: if the three do not hold the same keys.
  """
  if not merged.keys() == mine.keys() == answered.keys():
    raise ValueError(
      f"carry needs the same keys in Θ_p, θ_p and θ_p^answered; got {sorted(merged)}, "
      f"{sorted(mine)} and {sorted(answered)}."
    )
  out = {}
  for k, m in merged.items():
    dtype = np.asarray(mine[k]).dtype
    wide = np.result_type(dtype, np.float32)
    delta = np.asarray(mine[k], wide) - np.asarray(answered[k], wide)
    out[k] = (np.asarray(m, wide) + delta).astype(dtype)
  return out
