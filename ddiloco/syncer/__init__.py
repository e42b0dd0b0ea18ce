"""ddiloco.syncer: the pure, clock-injected syncer core (docs/algorithm.md §4) and its merge and timing pieces."""

from ddiloco.syncer.core import SyncerCore
from ddiloco.syncer.grace import Ema, GraceModel
from ddiloco.syncer.merge import merge_outer_gradients, rda, token_weight, weighted_mean
from ddiloco.syncer.types import FragmentState, MergeEvent, Report, ReportResult, SyncerConfig

__all__ = [
  "Ema",
  "FragmentState",
  "GraceModel",
  "MergeEvent",
  "Report",
  "ReportResult",
  "SyncerConfig",
  "SyncerCore",
  "merge_outer_gradients",
  "rda",
  "token_weight",
  "weighted_mean",
]
