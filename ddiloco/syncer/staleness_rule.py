"""A staleness-discounted weighted mean: a merge rule in one module (docs/algorithm.md §4.5).

w_m = tokens_m² / steps_m · γ^(s_m), merged with the weighted mean, where s_m is the answer's
staleness in periods: the inner steps it trained on its anchor beyond one period H,
s_m = max(0, steps_m − H) / H.

Why that measure. The first candidate, how many versions the fragment moved since the answer's
anchor, is 0 for every answer that is merged: a round takes only answers anchored at its base
version (others weigh 0, §4 "Rounds"), and the base is Θ_p's current version while the round is
open. What an answer carries that does vary is `Report.steps`, the inner steps since its learner
applied Θ^(base): a learner on the fleet's pace answers H − τ steps after its apply (H with
`apply_rule = "carry"`), so neither is discounted. More than H means its local model drifted from
the global one for longer than the period the outer step is tuned for (local SGD's drift grows with
the local steps): it ran ahead of the syncer's step clock, which paces rounds at the fleet's median
rate. Its tokens still count (the token weight grows with them), but each period beyond the first
multiplies its weight by γ, which also keeps one fast learner from dominating the merge.

In gin: `SyncerConfig.merge_rule = @StalenessDiscountedMean()` and
`StalenessDiscountedMean.gamma = 0.5`. Embeddings take the weighted mean of these weights too, as
under every rule.
"""

import dataclasses
from collections.abc import Mapping, Sequence

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import Report
from ddiloco.syncer.merge_rules import Coefficients, MergeRule, mean_coefficients, token_weight


def staleness(steps: int, period: int) -> float:
  """An answer's staleness in periods: max(0, steps − period) / period (see the module docstring)."""
  return max(int(steps) - int(period), 0) / int(period)


@dataclasses.dataclass(frozen=True)
class StalenessDiscountedMean(MergeRule):
  """The weighted mean of token weights discounted by γ per period of staleness.

  Attributes:
    gamma: γ in [0, 1], the factor per period of staleness (continuous: half a period beyond H
      multiplies by √γ). 1 is the plain weighted mean; 0 gives every stale answer weight 0 (it is
      accepted but not merged, and does not count toward the quorum).
  """

  gamma: float = 0.5

  def __post_init__(self):
    if not (isinstance(self.gamma, int | float) and 0.0 <= self.gamma <= 1.0):
      raise ValueError(f"StalenessDiscountedMean.gamma must be in [0, 1], got {self.gamma!r}.")

  def weight(self, report: Report, schedule: FragmentSchedule) -> float:
    """tokens² / steps · γ^(staleness); an answer of a period or less keeps its token weight."""
    w = token_weight(report.tokens, report.steps)
    s = staleness(report.steps, schedule.period)
    if s == 0:
      return w
    # Answers over a thousand periods stale (γ = 0.5) underflow to weight 0: not merged.
    return w * self.gamma**s

  def coefficients(
    self, weights: Sequence[float], sq_norms: Mapping[int, float] | None
  ) -> Coefficients:
    del sq_norms
    return Coefficients(mean_coefficients(weights), None)
