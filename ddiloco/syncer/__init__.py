"""ddiloco.syncer: the pure, clock-injected syncer core (docs/algorithm.md §4) and its merge and timing pieces."""

from ddiloco.syncer.core import SyncerCore
from ddiloco.syncer.grace import Ema, GraceModel
from ddiloco.syncer.merge_rules import RDA, Coefficients, MergeRule, WeightedMean, token_weight
from ddiloco.syncer.types import FragmentState, MergeEvent, Report, ReportResult, SyncerConfig

__all__ = [
  "RDA",
  "Coefficients",
  "Ema",
  "FragmentState",
  "GraceModel",
  "MergeEvent",
  "MergeRule",
  "Report",
  "ReportResult",
  "SyncerConfig",
  "SyncerCore",
  "WeightedMean",
  "token_weight",
]
