"""The syncer's value types: its config, reports, merge events, fragment states (SPEC §3, §4).

Also the core's own mutable bookkeeping (`RoundEntry`, `Round`, `LearnerRecord`), shared by
`core.py` and `checkpoint.py` but not part of the package's API. Everything public here is re-exported
by `ddiloco.syncer.core`, so `from ddiloco.syncer.core import SyncerConfig, Report, ...` keeps working.
"""

import dataclasses
import math

import gin
import numpy as np
import optax

from ddiloco.protocol import FragmentState, Report, ReportResult, RoundRequest
from ddiloco.syncer import merge as merge_lib

# The types learners and the syncer exchange live in `ddiloco.protocol`; re-exported here.
__all__ = [
  "COUNTERS",
  "FragmentState",
  "LearnerRecord",
  "MergeEvent",
  "Report",
  "ReportResult",
  "Round",
  "RoundEntry",
  "RoundRequest",
  "SyncerConfig",
  "readonly",
]

# The core's counters, reported by `SyncerCore.stats()` and saved by its `state_dict()`.
COUNTERS = (
  "fleet_step",  # Largest step of an accepted weight>0 report: the fleet's schedule phase.
  "merges",
  "accepted",
  "superseded",
  "late",
  "duplicate",
  "rejected",
  "dropped_tokens",
  "merged_tokens",
  "zero_weight_reports",
  "zero_weight_tokens",
  # Rounds the syncer opened, and the due rounds it could not open because the fragment's previous
  # round was still open (K not reached within a period: a synchronous quorum waiting).
  "rounds_opened",
  "overrun_rounds",
  # The token ledger (docs/resilience.md): every report's `new_tokens` is received once and ends
  # merged or dropped; what is neither sits in an open round. received = merged + dropped + pending.
  "ledger_received",
  "ledger_merged",
  "ledger_dropped",
)

CLOCKS = ("fleet_rate", "slowest")

# Counters added after checkpoints were first written: an older checkpoint loads them as 0.
NEW_COUNTERS = (
  "ledger_received",
  "ledger_merged",
  "ledger_dropped",
  "rounds_opened",
  "overrun_rounds",
)


@gin.configurable(module="ddiloco")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncerConfig:
  """Syncer settings (SPEC §4). Bound from gin as `ddiloco.SyncerConfig.<field>`.

  Attributes:
    min_quorum: K, weight>0 reports needed before a round may merge (SPEC §4.1).
    use_grace: whether to keep a round open for the adaptive grace window after quorum (SPEC §4.2).
    grace_gamma: γ, the fraction of slack the window spends (decision 0.8).
    grace_max_s: upper bound of the window, seconds.
    overlap: τ in steps; only the grace model uses it here.
    ema_decay: decay of the ξ EMAs.
    merge_method: "rda" (default) or "mean" for non-embedding tensors (SPEC §4.5).
    clock: how the syncer's step clock advances. "fleet_rate" (default): at the median step rate
      of the alive learners, whatever their positions. "slowest": to the lowest schedule step any
      alive learner has reached, so a round opens once every learner has reached its step; the
      synchronous baselines use it with blocking learners (lock-step).
    outer_lr: outer SGD learning rate (DiLoCo 0.7, SPEC §4.6).
    outer_momentum: outer momentum; 0 disables it.
    nesterov: Nesterov momentum.
    keep_versions: recent versions kept per fragment, current included: the anchors a delta on
      the wire may be encoded against (a learner that has not applied the newest version yet).
  """

  min_quorum: int = 1
  use_grace: bool = True
  grace_gamma: float = 0.8
  grace_max_s: float = 10.0
  overlap: int = 2
  ema_decay: float = 0.8
  merge_method: str = "rda"
  clock: str = "fleet_rate"
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  nesterov: bool = True
  keep_versions: int = 4

  def __post_init__(self):
    if self.min_quorum < 1:
      raise ValueError(f"min_quorum must be >= 1, got {self.min_quorum}.")
    if not 0.0 <= self.grace_gamma <= 1.0:
      raise ValueError(f"grace_gamma must be in [0, 1], got {self.grace_gamma}.")
    if not math.isfinite(self.grace_max_s) or self.grace_max_s < 0:
      raise ValueError(f"grace_max_s must be finite and >= 0, got {self.grace_max_s}.")
    if self.overlap < 0:
      raise ValueError(f"overlap must be >= 0, got {self.overlap}.")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}.")
    if self.merge_method not in merge_lib.MERGE_METHODS:
      raise ValueError(
        f"merge_method must be one of {merge_lib.MERGE_METHODS}, got {self.merge_method!r}."
      )
    if self.clock not in CLOCKS:
      raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}.")
    if not self.outer_lr > 0:
      raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}.")
    if not 0.0 <= self.outer_momentum < 1.0:
      raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}.")
    if self.keep_versions < 2:
      raise ValueError(
        f"keep_versions must be >= 2, got {self.keep_versions}: a learner answering a round may "
        "still hold the previous version, and its delta is encoded against it."
      )

  def outer_optimizer(self) -> optax.GradientTransformation:
    """optax.sgd(outer_lr, momentum or None, nesterov): DiLoCo's outer step (SPEC §4.6)."""
    return optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.nesterov)


@dataclasses.dataclass(frozen=True)
class MergeEvent:
  """One published merge: fragment p went to `version` at `time` (SPEC §4.7)."""

  fragment: int
  version: int
  time: float
  contributors: tuple[int, ...]
  weights: tuple[float, ...]
  tokens: int
  open_time: float
  quorum_time: float
  grace_s: float
  digest: str


@dataclasses.dataclass
class RoundEntry:
  """A weight>0 report filed in an open round."""

  report: Report  # values are the syncer's own copies.
  weight: float
  epoch: int  # the learner's registration epoch when the report arrived.
  # {key: ‖Θ^(anchor) − θ‖²} of its RDA tensors, summed at the door's finiteness pass, or None: the
  # merge then computes them (`merge.merge_reports`). Not checkpointed: a restored entry has None.
  sq_norms: dict[str, float] | None = None


@dataclasses.dataclass
class Round:
  """A fragment's round: its entries and, once it has its quorum, its grace deadline.

  `step` is the syncer's schedule step that opened it (-1: no round of this fragment is open) and
  `base_version` the version it was opened against.
  """

  step: int = -1
  base_version: int = -1
  first_time: float | None = None  # When its first weight>0 answer arrived; not saved.
  entries: dict[int, RoundEntry] = dataclasses.field(default_factory=dict)  # only weight > 0
  open_time: float | None = None
  quorum_time: float | None = None
  deadline: float | None = None
  grace_s: float = 0.0


@dataclasses.dataclass
class LearnerRecord:
  """What the core knows of one learner: liveness, registration epoch, delivered versions."""

  alive: bool = True
  epoch: int = 0
  delivered: dict[int, int] = dataclasses.field(default_factory=dict)  # fragment -> newest version
  # fragment -> step of its newest report merged into the fragment (learners settle their ledger).
  merged_step: dict[int, int] = dataclasses.field(default_factory=dict)
  # Its ledger at the syncer: new_tokens received, merged and dropped (all its registrations).
  ledger: dict[str, int] = dataclasses.field(
    default_factory=lambda: {"received": 0, "merged": 0, "dropped": 0}
  )
  # (schedule step, clock time, step time) from the learner's newest report or heartbeat; not saved.
  progress: tuple[int, float, float] | None = None
  # Its own inner step and clock time at the last rate sample, and its rate EMA in steps/s; not saved.
  steps_seen: tuple[int, float] | None = None
  rate: float = 0.0
  position: int = -1  # Its newest schedule step (every sample); not saved.
  heard: float | None = None  # Clock time of its newest sample; not saved.


def readonly(a: np.ndarray) -> np.ndarray:
  """Marks `a` read-only in place and returns it: global values are shared, never mutated."""
  a.flags.writeable = False
  return a
