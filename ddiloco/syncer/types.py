"""The syncer's value types: its config, reports, merge events, fragment states (SPEC §3, §4).

Also the core's own mutable bookkeeping (`RoundEntry`, `Round`, `LearnerRecord`), shared by
`core.py` and `checkpoint.py` but not part of the package's API. Everything public here is re-exported
by `ddiloco.syncer.core`, so `from ddiloco.syncer.core import SyncerConfig, Report, ...` keeps working.
"""

import dataclasses
import math
from collections.abc import Mapping

import gin
import numpy as np
import optax

from ddiloco.syncer import merge as merge_lib

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
  # The token ledger (docs/resilience.md): every report's `new_tokens` is received once and ends
  # merged or dropped; what is neither sits in an open round. received = merged + dropped + pending.
  "ledger_received",
  "ledger_merged",
  "ledger_dropped",
)

# Counters added after checkpoints were first written: an older checkpoint loads them as 0.
NEW_COUNTERS = ("ledger_received", "ledger_merged", "ledger_dropped")


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
    max_staleness: largest cur − anchor_version a report may have to join a round; 0 = SPEC §4 literal.
    outer_lr: outer SGD learning rate (DiLoCo 0.7, SPEC §4.6).
    outer_momentum: outer momentum; 0 disables it.
    nesterov: Nesterov momentum.
    keep_versions: recent versions kept per fragment, current included (for re-anchoring, SPEC §4.3).
  """

  min_quorum: int = 1
  use_grace: bool = True
  grace_gamma: float = 0.8
  grace_max_s: float = 10.0
  overlap: int = 2
  ema_decay: float = 0.8
  merge_method: str = "rda"
  max_staleness: int = 2
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
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}.")
    if not self.outer_lr > 0:
      raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}.")
    if not 0.0 <= self.outer_momentum < 1.0:
      raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}.")
    if self.keep_versions < self.max_staleness + 1:
      raise ValueError(
        f"keep_versions ({self.keep_versions}) must be >= max_staleness + 1 "
        f"({self.max_staleness + 1}): re-anchoring needs every anchor a report may have."
      )

  def outer_optimizer(self) -> optax.GradientTransformation:
    """optax.sgd(outer_lr, momentum or None, nesterov): DiLoCo's outer step (SPEC §4.6)."""
    return optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.nesterov)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
  """One learner's report of one fragment (learner → syncer, SPEC §3).

  Attributes:
    learner_id: the reporting learner.
    fragment: fragment index p.
    values: θ_{m,p}, the learner's current parameters of p, {key: array}.
    tokens: tokens since the learner last had p merged/received (learner resets them, SPEC §3).
    steps: inner steps over the same period.
    anchor_version: version of p the learner last applied; -1 if it never received p.
    step: the learner's inner step when it sent the report (orders re-sends).
    step_time_s: the learner's step-time EMA, feeds ξ_step; 0 = unknown.
    new_tokens: tokens trained since the learner's previous report of p (not since it received p):
      each trained token is in exactly one report, which the token ledger follows to its fate.
  """

  learner_id: int
  fragment: int
  values: Mapping[str, np.ndarray]
  tokens: int
  steps: int
  anchor_version: int
  step: int
  step_time_s: float = 0.0
  new_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class ReportResult:
  """What `SyncerCore.report` did: status is accepted | superseded | late | duplicate | rejected.

  `fleet_step` is where the middle of the fleet is on the schedule when the report arrived (see
  `SyncerCore.cadence_step`); learners follow it to keep their schedule in phase with the fleet.
  `round_version` is the version the round that took the report will publish (-1 if none took it):
  once the fragment reaches it, the report was merged, or it was lost (the token ledger).
  """

  status: str
  reason: str
  weight: float
  fleet_step: int = -1
  round_version: int = -1


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


@dataclasses.dataclass(frozen=True)
class FragmentState:
  """A version of a fragment's global values Θ_p; the arrays are read-only and shared."""

  fragment: int
  version: int
  values: dict[str, np.ndarray]
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
  """A fragment's open round: its entries and, once it has its quorum, its grace deadline."""

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
  # (schedule step, clock time, step time) from the learner's newest report; not saved.
  progress: tuple[int, float, float] | None = None
  # Its own inner step and clock time at the last rate sample, and its rate EMA in steps/s; not saved.
  steps_seen: tuple[int, float] | None = None
  rate: float = 0.0


def readonly(a: np.ndarray) -> np.ndarray:
  """Marks `a` read-only in place and returns it: global values are shared, never mutated."""
  a.flags.writeable = False
  return a
