"""`LearnerSlot`: the simulator's view of one learner slot, its state across lives and its counters.

Its data positions. A learner keeps its data iterator across lives (a crash and restart, a leave
and a join again), as it keeps its inner optimizer state: as if restored from a checkpoint of its
own taken at its last completed step (a step lost in a crash never took its batch). So a restarted
learner continues its slot where it stopped and repeats nothing, where a learner process restores
the position of its last checkpoint and reads again the batches of the steps trained since
(learner_process/worker.py). Each life's positions are booked as read (`data_lives`), so a ledger
of the summary (launch/run_summary.py `data_segments`) would show a repeat if a life started
behind the previous one's end.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from ddiloco.data.token_shards import stream_position
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
  # [start, end) positions each life read, end None while it lives (empty: no numbered positions).
  data_lives: list[list[int | None]] = dataclasses.field(default_factory=list)
  data_start: dict[str, int] | None = None  # Where its first life started reading.

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

  def begin_life(self) -> None:
    """Books the position a (re)started learner reads from."""
    here = stream_position(self.data)
    if here is not None:
      self.data_start = self.data_start or here
      self.data_lives.append([here["position"], None])

  def end_life(self) -> None:
    """Books the position a stopped learner (a crash, a leave) got to."""
    here = stream_position(self.data)
    if here is not None and self.data_lives and self.data_lives[-1][1] is None:
      self.data_lives[-1][1] = here["position"]

  def data_summary(self) -> dict[str, Any] | None:
    """Its summary's "data": `start` and `end` as a learner process writes them (position, slot,
    slots), and `lives`, the [start, end) of each; None for a stream without positions."""
    end = stream_position(self.data)
    if end is None or self.data_start is None:
      return None
    lives = [[start, end["position"] if stop is None else stop] for start, stop in self.data_lives]
    return {"start": self.data_start, "end": end, "lives": lives}
