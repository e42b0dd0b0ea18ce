"""Configuration of a simulated fleet: learners' speeds, sizes, faults, network and run length."""

import dataclasses
import math

from ddiloco.faults import parse_faults
from ddiloco.learner.factory import LearnerSpec  # Re-exported: the fleet is a list of them.


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """A simulated fleet (docs/architecture.md "simulated cluster").

  Attributes:
    num_learners: learners at the start (M).
    steps_per_learner: sets the token budget: M x steps x (nominal tokens per step). The run ends when
      the fleet has trained that many tokens, so runs with faults or baselines compare at equal tokens.
    step_time_s: nominal virtual step time.
    jitter: log-normal sigma of step times.
    slow_learners: how many learners (the last ones) are slower, by `slow_factor` (docs/algorithm.md §6: 18 %).
    devices_per_learner: size of each learner's mesh (slices of jax.devices(); see parallel.mesh).
    batch_size: per-learner batch override (None: the data config's).
    faults: fault strings (the grammar of ddiloco.faults.grammar), e.g. ("crash:1@30+20",).
    uplink_latency_s, downlink_latency_s: one-way network latency of a report / a delivery.
    latency_jitter: log-normal sigma of each message's latency (0: every message takes exactly
      its latency). The spread of the answers' arrival that the grace window covers.
    bandwidth_gbps: link bandwidth for transfer times (0: infinite).
    eval_every_s: virtual seconds between evaluations of the global model (0: only at the end).
    max_time_s: hard stop in virtual seconds.
    log_every: steps between logged training losses.
    seed: seed of the step-time and latency jitter.

  The wire codecs are the syncer service's (`ServiceConfig`, `simulate(service=...)`), as in a
  distributed run: the simulated learners talk to that very service.
  """

  num_learners: int = 4
  steps_per_learner: int = 100
  step_time_s: float = 1.0
  jitter: float = 0.0
  slow_learners: int = 0
  slow_factor: float = 1.18
  devices_per_learner: int = 1
  batch_size: int | None = None
  faults: tuple[str, ...] = ()
  uplink_latency_s: float = 0.05
  downlink_latency_s: float = 0.05
  latency_jitter: float = 0.0
  bandwidth_gbps: float = 0.0
  eval_every_s: float = 0.0
  max_time_s: float = math.inf
  log_every: int = 10
  seed: int = 0

  def __post_init__(self):
    if self.num_learners < 1:
      raise ValueError(f"num_learners must be >= 1, got {self.num_learners}.")
    if self.steps_per_learner < 1:
      raise ValueError(f"steps_per_learner must be >= 1, got {self.steps_per_learner}.")
    if self.step_time_s <= 0 or self.slow_factor <= 0:
      raise ValueError("step_time_s and slow_factor must be > 0.")
    if not 0 <= self.slow_learners <= self.num_learners:
      raise ValueError(f"slow_learners must be in [0, {self.num_learners}].")
    if (
      min(
        self.uplink_latency_s,
        self.downlink_latency_s,
        self.bandwidth_gbps,
        self.jitter,
        self.latency_jitter,
      )
      < 0
    ):
      raise ValueError("Latencies, bandwidth and jitter must be >= 0.")
    if self.log_every < 1:
      raise ValueError("log_every must be >= 1.")
    parse_faults(self.faults)  # Fails early on a malformed schedule.

  def spec_for(self, index: int) -> LearnerSpec:
    """The spec of learner `index` (joined learners beyond M get the nominal spec)."""
    slow = self.num_learners - self.slow_learners <= index < self.num_learners
    return LearnerSpec(
      step_time_s=self.step_time_s * (self.slow_factor if slow else 1.0),
      batch_size=self.batch_size,
      devices=self.devices_per_learner,
      jitter=self.jitter,
    )

  def num_shards(self) -> int:
    """Data shards: one per learner slot that can ever exist (initial ones and joins)."""
    joins = [e.learner + 1 for e in parse_faults(self.faults) if e.kind == "add_learner"]
    return max([self.num_learners, *joins])

  def token_budget(self, tokens_per_step: int) -> int:
    return self.num_learners * self.steps_per_learner * tokens_per_step
