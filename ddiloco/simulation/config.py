"""Configuration of a simulated fleet: its learners' speeds and meshes, faults and network."""

import dataclasses
import math

from ddiloco.faults import parse_faults
from ddiloco.learner.factory import LearnerSpec  # Re-exported: the fleet is a list of them.
from ddiloco.types import check_int_fields


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """A simulated fleet: what executes a run (`RunConfig`) on the virtual clock.

  The run sets how many learners start, how long they train, their batch and how often the global
  model is evaluated; this sets how fast they are, what goes wrong and the network between them
  (docs/architecture.md "simulated cluster").

  Attributes:
    step_time_s: nominal virtual step time.
    jitter: log-normal sigma of step times.
    slow_learners: how many learners (the last ones of the run's M) are slower, by `slow_factor`
      (docs/algorithm.md §6: 18 %).
    devices_per_learner: size of each learner's mesh (slices of jax.devices(); see parallel.mesh).
    faults: fault strings (the grammar of ddiloco.faults.grammar), e.g. ("crash:1@30+20",).
    uplink_latency_s, downlink_latency_s: one-way network latency of a report / a delivery.
    latency_jitter: log-normal sigma of each message's latency (0: every message takes exactly
      its latency). The spread of the answers' arrival that the grace window covers.
    bandwidth_gbps: link bandwidth for transfer times (0: infinite).
    max_time_s: hard stop in virtual seconds.
    seed: seed of the step-time and latency jitter.

  The wire codecs are the syncer service's (`RunConfig.service`), as in a distributed run: the
  simulated learners talk to that very service.
  """

  step_time_s: float = 1.0
  jitter: float = 0.0
  slow_learners: int = 0
  slow_factor: float = 1.18
  devices_per_learner: int = 1
  faults: tuple[str, ...] = ()
  uplink_latency_s: float = 0.05
  downlink_latency_s: float = 0.05
  latency_jitter: float = 0.0
  bandwidth_gbps: float = 0.0
  max_time_s: float = math.inf
  seed: int = 0

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    # Written as `not x > 0` and with isfinite so NaN is refused too: `x <= 0` lets it through.
    for name in ("step_time_s", "slow_factor"):
      value = getattr(self, name)
      if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value}.")
    if not self.max_time_s > 0:
      raise ValueError(f"max_time_s must be > 0 (inf: no limit), got {self.max_time_s}.")
    if self.slow_learners < 0 or self.devices_per_learner < 1:
      raise ValueError("slow_learners must be >= 0 and devices_per_learner >= 1.")
    for name in ("uplink_latency_s", "downlink_latency_s", "jitter", "latency_jitter"):
      value = getattr(self, name)
      if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}.")
    if not self.bandwidth_gbps >= 0:
      raise ValueError(f"bandwidth_gbps must be >= 0 (0: infinite), got {self.bandwidth_gbps}.")
    parse_faults(self.faults)  # Fails early on a malformed schedule.

  def check_fleet(self, num_learners: int) -> None:
    """Checks this fleet against the run's M learners.

    Raises:
      ValueError: if more learners are slow than the run has.
    """
    if self.slow_learners > num_learners:
      raise ValueError(f"slow_learners must be in [0, {num_learners}] (the run's num_learners).")

  def spec_for(self, index: int, *, num_learners: int, batch_size: int | None) -> LearnerSpec:
    """The spec of learner `index` of a run of `num_learners` learners of `batch_size` examples
    (None: the task's); joined learners beyond M get the nominal spec."""
    slow = num_learners - self.slow_learners <= index < num_learners
    return LearnerSpec(
      step_time_s=self.step_time_s * (self.slow_factor if slow else 1.0),
      batch_size=batch_size,
      devices=self.devices_per_learner,
      jitter=self.jitter,
    )

  def num_shards(self, num_learners: int, data_slots: int = 0) -> int:
    """Data slots: `data_slots` when the run sets them (`RunConfig.data_slots`: learner i reads
    slot i mod them, as in a distributed run), else one per learner that can ever exist (the
    run's M and joins), so that a joining learner reads a slot of its own."""
    if data_slots:
      return data_slots
    joins = [e.learner + 1 for e in parse_faults(self.faults) if e.kind == "add_learner"]
    return max([num_learners, *joins])
