"""Configuration of the fleet-scale goodput simulator (docs/algorithm.md §7).

Plain frozen dataclasses, validated in their constructors; `ddiloco.launch.configurables` registers
them with gin. The defaults are the constants fitted to the paper's goodput table by
`scripts/fit_goodput.py` (docs/goodput.md explains the model, the fit and its sensitivity).
"""

import dataclasses
import functools
import math

import numpy as np

_HOUR_S = 3600.0

# Fitted by scripts/fit_goodput.py to docs/algorithm.md §7's table (docs/goodput.md). The rejoin window is
# fitted per kind of job: elastic jobs batch re-admissions over ~2.5 minutes; a job that must
# restart to re-admit slices does so after a short rendezvous (cf. torchelastic's 30 s last call).
ELASTIC_REJOIN_WINDOW_S = 146.0
RESTART_REJOIN_WINDOW_S = 23.7
RESTART_CHECKPOINT_INTERVAL_S = 2.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryDelay:
  """How long a failed slice stays out: an exponentiated Weibull (docs/algorithm.md §7).

  Same parameterization as `scipy.stats.exponweib(a, c, scale=scale_s)`:
  CDF(x) = (1 - exp(-(x / scale_s) ** c)) ** a.
  """

  a: float = 1.04
  c: float = 0.655
  scale_s: float = 349.0

  def __post_init__(self):
    for field in ("a", "c", "scale_s"):
      value = getattr(self, field)
      if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"RecoveryDelay.{field} must be positive and finite, got {value}.")

  def sample(self, rng: np.random.Generator, size: int | tuple[int, ...]) -> np.ndarray:
    """Draws recovery delays in seconds by inverting the CDF (faster than scipy's rvs)."""
    u = rng.random(size)
    return self.scale_s * (-np.log1p(-(u ** (1.0 / self.a)))) ** (1.0 / self.c)

  @functools.cached_property
  def mean_s(self) -> float:
    """Mean recovery delay in seconds (scipy integrates numerically: cached)."""
    # Imported here: scipy.stats takes seconds to load, and every entry point imports this module
    # (launch/configurables.py registers its classes with gin).
    from scipy import stats

    return float(stats.exponweib.mean(self.a, self.c, scale=self.scale_s))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fleet:
  """The hardware: slices of chips that fail as Poisson processes and recover after a delay.

  Attributes:
    slice_chips: chips per slice, the unit that fails and that elastic jobs add or drop.
    chip_mtbi_hours: per-chip mean time between interruptions (docs/algorithm.md §7: one year);
      `math.inf` switches failures off.
    recovery: distribution of the time a failed slice stays out.
    slice_speed_cv: relative spread (std/mean) of the slices' static speeds; a synchronous job
      runs at the pace of its slowest slice.
    horizon_hours: simulated wall-clock time.
  """

  slice_chips: int = 256
  chip_mtbi_hours: float = 365.0 * 24.0
  recovery: RecoveryDelay = RecoveryDelay()
  slice_speed_cv: float = 0.0019
  horizon_hours: float = 7 * 24.0

  def __post_init__(self):
    if self.slice_chips < 1:
      raise ValueError(f"slice_chips must be >= 1, got {self.slice_chips}.")
    if not self.chip_mtbi_hours > 0:
      raise ValueError(f"chip_mtbi_hours must be positive (or inf), got {self.chip_mtbi_hours}.")
    if not 0 <= self.slice_speed_cv < 0.3:
      raise ValueError(f"slice_speed_cv must be in [0, 0.3), got {self.slice_speed_cv}.")
    if not (self.horizon_hours > 0 and math.isfinite(self.horizon_hours)):
      raise ValueError(f"horizon_hours must be positive and finite, got {self.horizon_hours}.")

  @property
  def slice_failure_rate(self) -> float:
    """Failures per second of one healthy slice (any of its chips interrupts it)."""
    return self.slice_chips / (self.chip_mtbi_hours * _HOUR_S)

  @property
  def horizon_s(self) -> float:
    return self.horizon_hours * _HOUR_S


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
  """Time, in seconds, that each reaction to a membership change stops a synchronous job.

  Attributes:
    detection_s: a failed slice hangs the job's collectives until the failure is detected.
    downscale_s: elastic reconfiguration to drop failed slices (after detection).
    upscale_s: elastic reconfiguration to re-admit recovered slices.
    restart_s: restart from checkpoint of a job that cannot resize in place (after detection
      when a failure caused it).
  """

  detection_s: float = 19.3
  downscale_s: float = 0.9
  upscale_s: float = 19.2
  restart_s: float = 39.2

  def __post_init__(self):
    for field in ("detection_s", "downscale_s", "upscale_s", "restart_s"):
      value = getattr(self, field)
      if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"Costs.{field} must be >= 0 and finite, got {value}.")


def _check_window(name: str, value: float) -> None:
  if not value >= 0:
    raise ValueError(f"{name} must be >= 0 (or inf), got {value}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataParallel:
  """One synchronous data-parallel job over all chips.

  Attributes:
    name: label in tables and plots.
    elastic: True drops and re-admits slices in place (downscale/upscale); False restarts
      from checkpoint on every change of the slice set.
    rejoin_window_s: a recovered slice waits at most this long before a reconfiguration
      (upscale or restart) re-admits it; it joins earlier, for free, if a failure
      reconfigures the job first. None: the fitted default for the kind of job.
    checkpoint_interval_s: running time between checkpoints; a failure rolls back the work
      since the last one. None: healthy replicas hold the state, nothing is rolled back.
  """

  name: str
  elastic: bool
  rejoin_window_s: float | None = None
  checkpoint_interval_s: float | None = None

  def __post_init__(self):
    if self.rejoin_window_s is None:
      default = ELASTIC_REJOIN_WINDOW_S if self.elastic else RESTART_REJOIN_WINDOW_S
      object.__setattr__(self, "rejoin_window_s", default)
    _check_window("rejoin_window_s", self.rejoin_window_s)
    if self.checkpoint_interval_s is not None and not self.checkpoint_interval_s > 0:
      raise ValueError(f"checkpoint_interval_s must be positive, got {self.checkpoint_interval_s}.")

  @property
  def learners(self) -> int:
    return 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scavenging:
  """Temporary learners added for a while on spare chips (docs/algorithm.md §6).

  Attributes:
    learners: number of temporary learners.
    chips_fraction: their chips, as a fraction of the base system's chips.
    start_hours: when they join.
    duration_hours: how long they stay.
  """

  learners: int
  chips_fraction: float
  start_hours: float
  duration_hours: float

  def __post_init__(self):
    if self.learners < 1:
      raise ValueError(f"Scavenging.learners must be >= 1, got {self.learners}.")
    if not self.chips_fraction > 0:
      raise ValueError(f"Scavenging.chips_fraction must be positive, got {self.chips_fraction}.")
    if self.start_hours < 0 or not self.duration_hours > 0:
      raise ValueError("Scavenging needs start_hours >= 0 and duration_hours > 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoupledDiLoCo:
  """M independent learners, each an elastic data-parallel job, merged by the syncer.

  Attributes:
    name: label in tables and plots.
    learners: M; the chips are split evenly between them.
    quorum: K, learners that must report a fragment before the syncer merges it (docs/algorithm.md §4).
    rejoin_window_s: as `DataParallel.rejoin_window_s`, inside each (elastic) learner.
    learner_speeds: relative pace of each learner (heterogeneous hardware); empty means all 1.
      A learner faster than the K-th fastest running learner waits for the quorum.
    overlap_slack_s: how long learners keep computing while fewer than K learners run (τ steps
      of overlap hide that long a wait, docs/algorithm.md §2).
    scavenging: optional temporary learners.
  """

  name: str
  learners: int
  quorum: int = 1
  rejoin_window_s: float = ELASTIC_REJOIN_WINDOW_S
  learner_speeds: tuple[float, ...] = ()
  overlap_slack_s: float = 2.0
  scavenging: Scavenging | None = None

  def __post_init__(self):
    if self.learners < 1:
      raise ValueError(f"learners must be >= 1, got {self.learners}.")
    if not 1 <= self.quorum <= self.learners:
      raise ValueError(f"quorum must be in [1, learners={self.learners}], got {self.quorum}.")
    _check_window("rejoin_window_s", self.rejoin_window_s)
    if self.learner_speeds and len(self.learner_speeds) != self.learners:
      raise ValueError(
        f"learner_speeds has {len(self.learner_speeds)} entries for {self.learners} learners."
      )
    if any(not s > 0 for s in self.learner_speeds):
      raise ValueError(f"learner_speeds must be positive, got {self.learner_speeds}.")
    if self.overlap_slack_s < 0:
      raise ValueError(f"overlap_slack_s must be >= 0, got {self.overlap_slack_s}.")

  def speeds(self) -> np.ndarray:
    """Relative pace of each learner."""
    if not self.learner_speeds:
      return np.ones(self.learners)
    return np.asarray(self.learner_speeds, dtype=np.float64)


System = DataParallel | DecoupledDiLoCo


@dataclasses.dataclass(frozen=True)
class Result:
  """Outcome of simulating one system on one fleet size.

  Attributes:
    system: the system's name.
    learners: learners (1 for data-parallel).
    chips: chips the system was given.
    goodput: useful chip-time / available chip-time (each chip at its own speed).
    uptime: fraction of wall-clock during which the system made global progress (the
      data-parallel job ran; at least K learners ran, so the syncer merged).
    useful_chip_hours: useful work, in chip-hours at nominal speed.
    failures: slice failures that hit a running configuration.
    reconfigurations: pauses (detections, downscales, upscales, restarts).
  """

  system: str
  learners: int
  chips: int
  goodput: float
  uptime: float
  useful_chip_hours: float
  failures: int
  reconfigurations: int

  def record(self) -> dict[str, object]:
    """The JSON record written to goodput.json."""
    return dataclasses.asdict(self)


# docs/algorithm.md §7: the paper's goodput table (percent), fleet sizes in chips.
PAPER_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_GOODPUT: tuple[tuple[str, int, tuple[float, ...]], ...] = (
  ("data-parallel, no elasticity", 1, (72, 57, 38, 27, 18)),
  ("elastic data-parallel", 1, (88, 80, 69, 58, 40)),
  ("Decoupled DiLoCo M=2", 2, (94, 88, 80, 70, 54)),
  ("Decoupled DiLoCo M=4", 4, (96, 93, 89, 82, 73)),
  ("Decoupled DiLoCo M=8", 8, (98, 96, 94, 88, 80)),
  ("Decoupled DiLoCo M=16", 16, (99, 98, 96, 93, 86)),
)


def paper_systems() -> tuple[System, ...]:
  """The six systems of docs/algorithm.md §7's table, with the fitted defaults."""
  (ne, _, _), (el, _, _), *diloco = PAPER_GOODPUT
  return (
    DataParallel(name=ne, elastic=False, checkpoint_interval_s=RESTART_CHECKPOINT_INTERVAL_S),
    DataParallel(name=el, elastic=True),
    *(DecoupledDiLoCo(name=name, learners=m) for name, m, _ in diloco),
  )
