"""`LearnerSlot`: the simulator's view of one learner slot, its state across lives and its counters."""

import dataclasses
import math
from typing import Any

import numpy as np

from ddiloco.learner.learner import Learner
from ddiloco.simulation.config import LearnerSpec
from ddiloco.simulation.interface import Link


@dataclasses.dataclass
class LearnerSlot:
  """The simulator's view of one learner slot."""

  index: int
  spec: LearnerSpec
  learner: Learner | None = None
  data: Any = None
  link: Link | None = None  # This life's connection to the syncer (a new one at each (re)start).
  alive: bool = False
  gen: int = 0  # Bumped on crash/rejoin: cancels that slot's pending events.
  blocked: bool = False
  left: bool = False  # Removed for good (leave, or a crash without return).
  slow_factor: float = 1.0
  restart_at: float = math.inf  # When the latest kill's restart is due (inf: none).
  step_time_ema: float = 0.0
  last_metrics: Any = None
  losses: list[float] = dataclasses.field(default_factory=list)
  steps_done: int = 0
  tokens_done: int = 0

  def draw_step_duration(self, rng: np.random.Generator) -> float:
    """The virtual duration of the learner's next step: its spec's, slowed, with its jitter."""
    base = self.spec.step_time_s * self.slow_factor
    if self.spec.jitter > 0:
      base *= float(np.exp(rng.normal(0.0, self.spec.jitter)))
    return base

  def count_step(self, tokens: int) -> float:
    """Counts a step of `tokens` tokens; returns its nominal step time (without jitter), which
    the learner's step-time EMA follows."""
    self.steps_done += 1
    self.tokens_done += tokens
    step_time = self.spec.step_time_s * self.slow_factor
    self.step_time_ema = (
      step_time if self.step_time_ema == 0 else 0.8 * self.step_time_ema + 0.2 * step_time
    )
    return step_time
