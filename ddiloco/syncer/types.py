"""The syncer's value types: its config, reports, merge events, fragment states (docs/algorithm.md §3, §4).

Also the core's own mutable bookkeeping (`RoundEntry`, `Round`, `LearnerRecord`), shared by the
core's collaborators and `checkpoint.py` but not part of the package's API. Everything public here is re-exported
by `ddiloco.syncer.core`, so `from ddiloco.syncer.core import SyncerConfig, Report, ...` keeps working.
"""

import collections
import dataclasses
import math
from collections.abc import Callable

import numpy as np
import optax

from ddiloco.protocol import FragmentState, Report, ReportResult, RoundRequest
from ddiloco.syncer import outer_optimizers
from ddiloco.syncer.merge_rules import MergeRule, WeightedMean, check_rule
from ddiloco.types import check_int_fields

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
  # Plausibility (docs/resilience.md): answers refused because their outer gradient was out of
  # scale (also counted as "rejected"), rounds whose merge would have produced a non-finite or
  # out-of-range value (nothing was updated; their answers were dropped), and answers a learner
  # sent again (a retry) that got the first one's result without being filed twice.
  "implausible",
  "failed_merges",
  "replayed",
)

CLOCKS = ("fleet_rate", "slowest")

# Counters added after checkpoints were first written: an older checkpoint loads them as 0.
NEW_COUNTERS = (
  "ledger_received",
  "ledger_merged",
  "ledger_dropped",
  "rounds_opened",
  "overrun_rounds",
  "implausible",
  "failed_merges",
  "replayed",
)


# The default outer step (docs/algorithm.md §4.6): SGD with Nesterov momentum 0.9 whose momentum
# ramps up from 0, and whose learning rate comes down from 0.7 to 0.4, over the first 20 outer
# steps of each fragment: the best of the settings measured with 4 to 10 outer steps and with 192.
OUTER_LR = 0.4
OUTER_INITIAL_LR = 0.7
OUTER_MOMENTUM = 0.9
OUTER_WARMUP_STEPS = 20


def default_outer_optimizer() -> optax.GradientTransformation:
  """The outer optimizer of a `SyncerConfig` that names none: Nesterov SGD with a warm-up
  (`outer_optimizers.nesterov_warmup`; docs/algorithm.md §4.6 gives the study behind it)."""
  return outer_optimizers.nesterov_warmup(
    OUTER_LR,
    momentum=OUTER_MOMENTUM,
    warmup_steps=OUTER_WARMUP_STEPS,
    initial_learning_rate=OUTER_INITIAL_LR,
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncerConfig:
  """Syncer settings (docs/algorithm.md §4). Bound from gin as `ddiloco.SyncerConfig.<field>`.

  Attributes:
    min_quorum: K, weight>0 reports needed before a round may merge (docs/algorithm.md §4.1).
    use_grace: whether to keep a round open for the adaptive grace window after quorum (docs/algorithm.md §4.2).
    grace_gamma: γ, the fraction of slack the window spends (decision 0.8).
    grace_max_s: upper bound of the window, seconds.
    grace_spread: let the window cover the observed spread of the answers, up to the whole slack
      (syncer/grace.py); False: γ · slack alone.
    ema_decay: decay of the ξ EMAs.
    merge_rule: how a round's answers merge (docs/algorithm.md §4.4–4.5): each answer's weight and
      each non-embedding tensor's coefficients (embeddings take the weighted mean whatever the
      rule). A `MergeRule` (`syncer/merge_rules.py`); in gin, e.g.
      `SyncerConfig.merge_rule = @WeightedMean()` (the default) or `@RDA()`.
    clock: how the syncer's step clock advances. "fleet_rate" (default): at the median step rate
      of the alive learners, whatever their positions. "slowest": to the lowest schedule step any
      alive learner has reached, so a round opens once every learner has reached its step; the
      synchronous baselines use it with blocking learners (lock-step).
    outer_optimizer: builds the outer optimizer, called with no arguments: any optax
      transformation, applied to each fragment's merged outer gradient with one state per
      fragment (docs/algorithm.md §4.6). In gin, one binding, e.g.
      `SyncerConfig.outer_optimizer = @outer/optax.adam` with `outer/optax.adam.learning_rate = 0.1`.
      Default: `default_outer_optimizer`.
    keep_versions: recent versions kept per fragment, current included: the anchors a delta on
      the wire may be encoded against (a learner that has not applied the newest version yet).
    max_update_ratio: plausibility bound on an answer's outer gradient: its norm ‖Θ^(base) − θ_m‖
      over the fragment may be at most this many times the larger of ‖Θ^(base)‖ and the median
      norm of the fragment's recent merged answers; larger answers are refused. 0 disables it
      (non-finite values and merges are refused whatever it is).
    max_step_rate: the fastest inner-step rate (steps/s) a learner may claim or be measured at;
      faster samples are clamped, so that no learner can race the syncer's step clock.
    max_tokens_per_step: if set, an answer may carry at most this many tokens per inner step
      (a learner's batch in tokens, with slack); None checks only the global counter bounds.
    fused_merge_bytes: fragments of at least this many float32 bytes merge in one XLA program
      with the outer step (about 2x faster at 16 MiB, but compiled once per answer count, ~0.2 s
      each); smaller ones merge in numpy, then step (ddiloco/syncer/outer.py). The same
      mathematics either way, rounded differently (float32 sums in another order).
  """

  min_quorum: int = 1
  use_grace: bool = True
  grace_gamma: float = 0.8
  grace_max_s: float = 10.0
  grace_spread: bool = True
  ema_decay: float = 0.8
  merge_rule: MergeRule = dataclasses.field(default_factory=WeightedMean)
  clock: str = "fleet_rate"
  outer_optimizer: Callable[[], optax.GradientTransformation] = default_outer_optimizer
  keep_versions: int = 4
  max_update_ratio: float = 10.0
  max_step_rate: float = 1000.0
  max_tokens_per_step: int | None = None
  fused_merge_bytes: int = 8 << 20

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    if self.min_quorum < 1:
      raise ValueError(f"min_quorum must be >= 1, got {self.min_quorum}.")
    if not 0.0 <= self.grace_gamma <= 1.0:
      raise ValueError(f"grace_gamma must be in [0, 1], got {self.grace_gamma}.")
    if not math.isfinite(self.grace_max_s) or self.grace_max_s < 0:
      raise ValueError(f"grace_max_s must be finite and >= 0, got {self.grace_max_s}.")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}.")
    check_rule(self.merge_rule)
    if self.clock not in CLOCKS:
      raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}.")
    # Built once, here: a factory bound in gin reads gin's bindings when called, and a config may
    # outlive them (a factory that cannot build one fails here, not at a merge). optax
    # transformations are pure, so every fragment's state can come from this one.
    object.__setattr__(self, "_outer", self._build_outer_optimizer())
    if self.keep_versions < 2:
      raise ValueError(
        f"keep_versions must be >= 2, got {self.keep_versions}: a learner answering a round may "
        "still hold the previous version, and its delta is encoded against it."
      )
    if not math.isfinite(self.max_update_ratio) or self.max_update_ratio < 0:
      raise ValueError(f"max_update_ratio must be finite and >= 0, got {self.max_update_ratio}.")
    if not math.isfinite(self.max_step_rate) or self.max_step_rate <= 0:
      raise ValueError(f"max_step_rate must be finite and > 0, got {self.max_step_rate}.")
    if self.fused_merge_bytes < 0:
      raise ValueError(f"fused_merge_bytes must be >= 0, got {self.fused_merge_bytes}.")
    if self.max_tokens_per_step is not None and self.max_tokens_per_step < 1:
      raise ValueError(f"max_tokens_per_step must be >= 1 or None, got {self.max_tokens_per_step}.")

  def make_outer_optimizer(self) -> optax.GradientTransformation:
    """The outer optimizer `outer_optimizer` built when this config was made (docs/algorithm.md §4.6)."""
    return self._outer

  def _build_outer_optimizer(self) -> optax.GradientTransformation:
    """Calls `outer_optimizer` and checks what it returns.

    Raises:
      ValueError: if `outer_optimizer` is not callable, fails, or returns something that is not
        an optax transformation (no `init` and `update`).
    """
    if not callable(self.outer_optimizer):
      raise ValueError(
        f"SyncerConfig.outer_optimizer must be a callable that builds an optax transformation "
        f"(e.g. @outer/optax.sgd in gin), got {self.outer_optimizer!r}."
      )
    try:
      opt = self.outer_optimizer()
    except Exception as e:  # Reported with the field's name: gin's own message says which binding.
      raise ValueError(f"SyncerConfig.outer_optimizer failed to build the optimizer: {e}") from e
    if not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
      raise ValueError(
        f"SyncerConfig.outer_optimizer must return an optax GradientTransformation, got {opt!r}."
      )
    return opt


@dataclasses.dataclass(frozen=True)
class MergeEvent:
  """One published merge: fragment p went to `version` at `time` (docs/algorithm.md §4.7)."""

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

  def log_fields(self) -> dict:
    """The merge as a metrics event's fields (both runtimes' `merge` events in metrics.jsonl)."""
    return {
      "fragment": self.fragment,
      "version": self.version,
      "contributors": list(self.contributors),
      "weights": [round(w, 6) for w in self.weights],
      "tokens": self.tokens,
      "grace_s": round(self.grace_s, 6),
      # Seconds from the round's opening to its quorum and to the merge.
      "quorum_s": round(self.quorum_time - self.open_time, 4),
      "merge_s": round(self.time - self.open_time, 4),
      "digest": self.digest,
    }


@dataclasses.dataclass
class RoundEntry:
  """A weight>0 report filed in an open round."""

  report: Report  # values are the syncer's own copies.
  weight: float
  epoch: int  # the learner's registration epoch when the report arrived.
  # {key: ‖Θ^(anchor) − θ‖²} of its non-embedding tensors if the merge rule reads them
  # (`MergeRule.needs_norms`), summed at the door's finiteness pass, or None: the merge then
  # computes them (`merge.merge_reports`). Not checkpointed: a restored entry has None.
  sq_norms: dict[str, float] | None = None
  # ‖Θ^(anchor) − θ‖ over the fragment, from the door (the plausibility bound's recent norms).
  norm: float | None = None


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
  # Its recent answers: (fragment, round step) -> (registration epoch, the answer's counters, the
  # version of the fragment delivered to it then, the result it got). A retry of the same answer
  # gets the same result and is not filed again. Bounded (`Admission` evicts the oldest); not saved.
  answers: "collections.OrderedDict[tuple[int, int], tuple[int, tuple, int | None, ReportResult]]" = dataclasses.field(
    default_factory=collections.OrderedDict
  )


def readonly(a: np.ndarray) -> np.ndarray:
  """Marks `a` read-only in place and returns it: global values are shared, never mutated."""
  a.flags.writeable = False
  return a
