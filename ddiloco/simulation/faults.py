"""`SimulatedFaults`: the simulator's executor of fault events, on its virtual clock.

A killed learner loses its step in flight and its unmerged progress; the syncer learns of it only
from its silence, as in a real run. A restarted one rejoins from the global model (the inner
optimizer state is kept, as if restored from its own checkpoint). A removed learner leaves the
fleet for good; an added one joins it (scavenging). A slowed one steps `factor` times slower.
"""

import math
from typing import Any, Protocol

from ddiloco.faults import FaultEvent


class FaultTarget(Protocol):
  """What the executor needs of the simulated cluster."""

  now: float
  # Learner index -> its slot: `alive`, `left`, `slow_factor`, `restart_at` (kept by the executor).
  slots: dict[int, Any]

  def start_learner(self, index: int, *, rejoin: bool) -> None: ...

  def stop_learner(self, index: int, *, left: bool) -> None: ...

  def log_fault(self, event: FaultEvent) -> None: ...


class SimulatedFaults:
  """Executes the learner faults of a schedule on a `FaultTarget` (see the module docstring)."""

  def __init__(self, fleet: FaultTarget):
    self._fleet = fleet
    self._handlers = {
      "kill_learner": self._kill,
      "start_learner": self._restart,
      "slow_learner": self._slow,
      "unslow_learner": self._unslow,
      "add_learner": self._add,
      "remove_learner": self._remove,
    }
    self.kinds = frozenset(self._handlers)

  def execute(self, event: FaultEvent) -> bool:
    done = self._handlers[event.kind](event.learner, event.params)
    if done:
      self._fleet.log_fault(event)
    return done

  def _kill(self, i: int, params: dict[str, Any]) -> bool:
    slot = self._fleet.slots.get(i)
    if slot is None or not slot.alive:
      return False  # Not running (not joined yet, already down, or gone): nothing to kill.
    self._fleet.stop_learner(i, left=False)
    slot.restart_at = self._fleet.now + params.get("restart_delay_s", math.inf)
    return True

  def _restart(self, i: int, _) -> bool:
    slot = self._fleet.slots.get(i)
    if slot is None or slot.alive or slot.left or self._fleet.now < slot.restart_at:
      # Started already (added back), removed for good since, or killed again since: the restart
      # that stands is the latest kill's.
      return False
    self._fleet.start_learner(i, rejoin=True)
    return True

  def _add(self, i: int, _) -> bool:
    slot = self._fleet.slots.get(i)
    if slot is not None and slot.alive:
      raise ValueError(f"join:{i} but that learner is already running.")
    self._fleet.start_learner(i, rejoin=False)
    return True

  def _remove(self, i: int, _) -> bool:
    self._fleet.stop_learner(i, left=True)
    slot = self._fleet.slots.get(i)
    if slot is None:
      return False
    slot.left = True
    return True

  def _slow(self, i: int, params: dict[str, Any]) -> bool:
    slot = self._fleet.slots.get(i)
    if slot is None:
      return False
    slot.slow_factor = float(params["factor"])
    return True

  def _unslow(self, i: int, _) -> bool:
    slot = self._fleet.slots.get(i)
    if slot is None:
      return False
    slot.slow_factor = 1.0
    return True
