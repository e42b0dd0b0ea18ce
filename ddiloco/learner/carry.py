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

import numpy as np

from ddiloco.protocol import Answer

APPLY_RULES = ("overwrite", "carry")


class AnswerBook:
  """Per fragment, the newest answer whose merge has not been applied (see module docstring)."""

  def __init__(self):
    self._answers: dict[int, Answer] = {}
    self._refused: set[int] = set()  # Fragments whose answer the syncer said no round took.
    self.carried = 0  # Applies that carried an answer's progress over (`take` returned it).

  def record(self, p: int, answer: Answer) -> None:
    """p was answered: this answer replaces any older one of p."""
    self._answers[p] = answer
    self._refused.discard(p)

  def result(self, p: int, step: int, taken: bool) -> None:
    """The syncer answered p's answer at `step`: a round took it, or not (`taken`)."""
    answer = self._answers.get(p)
    if answer is not None and answer.step == step and not taken:
      self._refused.add(p)

  def take(self, p: int) -> Answer | None:
    """Forgets p's answer (its fragment is being applied); returns it unless the syncer refused it.

    Its `theta()` is θ_p^answered: the host copy it was made with, or its device snapshot, copied
    to the host now (kept on the devices until the apply).
    """
    answer = self._answers.pop(p, None)
    refused = p in self._refused
    self._refused.discard(p)
    if answer is None or refused:
      return None
    self.carried += 1
    return answer

  def clear(self) -> None:
    """Forgets every answer (the learner loaded the global model)."""
    self._answers.clear()
    self._refused.clear()

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
