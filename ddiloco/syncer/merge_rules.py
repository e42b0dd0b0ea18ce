"""Merge rules: how a round's answers combine into one outer gradient (docs/algorithm.md §4.4–4.5).

A rule decides three things, and the syncer does the rest:

- `weight`: each answer's weight w_m, from its report (its token counters) when it is filed. Every
  shipped rule starts from the token weight tokens² / steps (§4.4); a rule may change it. An answer
  of weight 0 is accepted but never merged and does not count toward the quorum.
- `needs_norms`: whether `coefficients` reads the answers' squared norms ‖v_m‖² per tensor. They
  are summed at the door as an answer is filed (`merge.finite_sq_norm`, in the same pass as its
  finiteness check), so asking for them costs no extra pass at the merge.
- `coefficients`: per tensor, from the weights (and the norms), the coefficients c_m of the merge
  Σ_m c_m · v_m and, optionally, a radius that sum is rescaled to (`Coefficients`).

Both merge paths apply exactly that form, so a rule never touches arrays: the numpy blockwise merge
(`merge.merge_reports`) and the merge fused with the outer step (`outer.OuterStep.merge_and_step`,
for fragments of at least `SyncerConfig.fused_merge_bytes`). Embedding tensors take the weighted
mean of the rule's weights whatever the rule (§4.5). A rule is a frozen dataclass: gin builds it
(`SyncerConfig.merge_rule = @RDA()`), and two configs with equal rules compare equal. This module
holds the interface and the two rules of §4.5, the weighted mean (the default) and RDA; a new
rule is a module of its own beside it (`staleness_rule.py`), registered for gin in
`launch/configurables.py`.
"""

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, NamedTuple

import numpy as np

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import Report

EPS = 1e-12  # RDA's zero-norm guard: norms at or below it count as zero.


def token_weight(tokens: int, steps: int) -> float:
  """Token weight ("quantity x quality") of one report, docs/algorithm.md §4.4: tokens² / steps.

  `tokens / steps` is the learner's batch size (quality: a learner that lost chips runs a smaller batch)
  and `tokens` is how much it trained since it last received the fragment (quantity).

  Args:
    tokens: tokens consumed since the learner last received the fragment.
    steps: inner steps over which they were consumed.

  Returns:
    tokens**2 / steps, or 0.0 when either counter is 0 (an absent learner weighs 0).

  Raises:
    ValueError: if a counter is negative.
  """
  if tokens < 0 or steps < 0:
    raise ValueError(f"Counters must be >= 0, got tokens={tokens}, steps={steps}.")
  if tokens == 0 or steps == 0:
    return 0.0
  # Python ints: tokens**2 is exact before the single rounding of the division.
  return float(int(tokens) ** 2 / int(steps))


def mean_coefficients(w: Sequence[float]) -> dict[int, float]:
  """{m: w_m / Σ w} for the contributions of weight > 0: the weighted mean is Σ_m c_m · v_m."""
  total = float(np.sum(np.asarray(w, np.float64)))
  return {m: float(wm) / total for m, wm in enumerate(w) if wm > 0}


def rda_coefficients(
  w: Sequence[float], sq_norms: Mapping[int, float], eps: float
) -> tuple[dict[int, float], float]:
  """RDA's coefficients and radius from the weights and the squared norms ‖v_m‖².

  The direction is Σ_m c_m · v_m with c_m = w_m / ‖v_m‖ / Σ w, over the contributions of weight
  > 0 and norm > eps; the radius is Σ_m w_m ‖v_m‖ / Σ w over the same. The merge is the direction
  scaled to the radius: radius / ‖direction‖ · direction, or zeros when the returned coefficients
  are empty (no contribution has a norm > eps, or the radius is <= eps) or ‖direction‖ <= eps.

  Args:
    w: one weight per contribution.
    sq_norms: ‖v_m‖² for every contribution of weight > 0.
    eps: norms at or below this are treated as zero.
  """
  total = float(np.sum(np.asarray(w, np.float64)))
  norms = {m: sq_norms[m] ** 0.5 for m, wm in enumerate(w) if wm > 0}
  norms = {m: n for m, n in norms.items() if n > eps}
  radius = sum(float(w[m]) * n for m, n in norms.items()) / total
  if not norms or radius <= eps:
    return {}, 0.0
  return {m: float(w[m]) / n / total for m, n in norms.items()}, radius


class Coefficients(NamedTuple):
  """One tensor's merge: Σ_m coefs[m] · v_m, rescaled to norm `radius` unless it is None.

  Answers absent from `coefs` are not read. With a radius, a sum of norm <= `merge.EPS` (or no
  coefficients at all) merges to zeros.
  """

  coefs: dict[int, float]
  radius: float | None


class MergeRule(abc.ABC):
  """What the syncer merges a round's answers with (see the module docstring).

  A subclass is a frozen dataclass whose fields are its settings (gin binds them). It overrides
  `coefficients`, and `weight` if its weights are not the token weights; it sets `needs_norms` if
  `coefficients` reads the squared norms.
  """

  needs_norms: ClassVar[bool] = False

  def weight(self, report: Report, schedule: FragmentSchedule) -> float:
    """w_m of an answer that joins its round (anchored at the round's base): finite and >= 0.

    Args:
      report: the answer, with its counters (`tokens`, `steps`, `step`, `round_step`, ...).
      schedule: the run's fragment schedule (P, H, τ), which the learners follow too.

    Returns:
      The token weight tokens² / steps (docs/algorithm.md §4.4), unless a rule says otherwise.
    """
    del schedule  # The token weight needs only the counters.
    return token_weight(report.tokens, report.steps)

  @abc.abstractmethod
  def coefficients(
    self, weights: Sequence[float], sq_norms: Mapping[int, float] | None
  ) -> Coefficients:
    """One tensor's merge coefficients.

    Args:
      weights: one weight per answer in the round (the `weight`s they were filed with); Σ > 0.
      sq_norms: with `needs_norms`, {m: ‖v_m‖² of this tensor} for every answer of weight > 0;
        None otherwise.
    """


@dataclasses.dataclass(frozen=True)
class WeightedMean(MergeRule):
  """The plain weighted mean Σ w_m v_m / Σ w (the ablation of docs/algorithm.md §4.5, and the
  synchronous baselines' merge)."""

  def coefficients(
    self, weights: Sequence[float], sq_norms: Mapping[int, float] | None
  ) -> Coefficients:
    del sq_norms
    return Coefficients(mean_coefficients(weights), None)


@dataclasses.dataclass(frozen=True)
class RDA(MergeRule):
  """Radial-directional averaging (docs/algorithm.md §4.5), the default merge.

  `(Σ w‖v‖ / Σ w) · unit(Σ w unit(v) / Σ w)`: the radius is the weighted mean of the norms and
  the direction the normalised weighted mean of the directions, so near-orthogonal outer gradients
  do not shrink like 1/√M as under the mean.

  Attributes:
    eps: norms at or below this count as zero: such an answer adds nothing to the radius and no
      direction (its weight still counts in Σ w).
  """

  needs_norms: ClassVar[bool] = True
  eps: float = EPS

  def __post_init__(self):
    if not math.isfinite(self.eps) or self.eps < 0:
      raise ValueError(f"RDA.eps must be finite and >= 0, got {self.eps}.")

  def coefficients(
    self, weights: Sequence[float], sq_norms: Mapping[int, float] | None
  ) -> Coefficients:
    if sq_norms is None:
      raise ValueError("RDA needs the answers' squared norms.")
    return Coefficients(*rda_coefficients(weights, sq_norms, self.eps))


# The rule of embedding tensors, whatever the configured one (docs/algorithm.md §4.5).
EMBEDDING_RULE = WeightedMean()


def check_rule(rule: object, what: str = "SyncerConfig.merge_rule") -> None:
  """Raises ValueError, saying what to write instead, unless `rule` is a `MergeRule` instance."""
  if isinstance(rule, MergeRule):
    return
  if isinstance(rule, type) and issubclass(rule, MergeRule):
    raise ValueError(
      f"{what} must be a MergeRule instance, got the class {rule.__name__}: "
      f"write @{rule.__name__}() in gin (with parentheses) or {rule.__name__}() in Python."
    )
  raise ValueError(
    f"{what} must be a MergeRule (docs/algorithm.md §4.5), got {rule!r}: in gin, e.g. "
    "@WeightedMean() (the default) or @RDA()."
  )
