"""Time accounting: goodput and global downtime from per-learner state changes.

Definitions (docs/algorithm.md):
- A learner slot is *provisioned* from its start (or join) to the end of the run (or its leave).
- It is *busy* while it computes inner steps that complete; *blocked* while a synchronous learner waits
  for a merged fragment; *down* between a crash and its rejoin.
- goodput = Σ busy / Σ provisioned.
- global downtime = total time during which no provisioned learner was busy (the whole job made no
  progress): a crashed data-parallel job, or a synchronous quorum waiting for a dead learner.
"""

import dataclasses

BUSY, BLOCKED, DOWN, GONE = "busy", "blocked", "down", "gone"


@dataclasses.dataclass
class _Slot:
  state: str
  since: float
  totals: dict[str, float] = dataclasses.field(default_factory=dict)


class TimeLedger:
  """Tracks each learner's state over time (virtual or wall clock)."""

  def __init__(self):
    self._slots: dict[int, _Slot] = {}
    self._busy_count = 0
    self._idle_since: float | None = 0.0
    self.global_downtime_s = 0.0

  def set_state(self, learner: int, state: str, now: float) -> None:
    """Moves `learner` to `state` at time `now` (first call provisions the slot)."""
    if state not in (BUSY, BLOCKED, DOWN, GONE):
      raise ValueError(f"Unknown state {state!r}.")
    slot = self._slots.get(learner)
    if slot is not None:
      if slot.state == state:
        return
      slot.totals[slot.state] = slot.totals.get(slot.state, 0.0) + (now - slot.since)
      was_busy = slot.state == BUSY
      slot.state, slot.since = state, now
    else:
      was_busy = False
      self._slots[learner] = _Slot(state, now)
    self._busy_count += (state == BUSY) - was_busy
    if self._busy_count == 0 and self._idle_since is None:
      self._idle_since = now
    elif self._busy_count > 0 and self._idle_since is not None:
      self.global_downtime_s += now - self._idle_since
      self._idle_since = None

  def close(self, now: float) -> None:
    """Ends the run at `now`: every slot's state, and any trailing idle time, is accounted up to it."""
    if self._idle_since is not None and self._busy_count == 0 and self._slots:
      self.global_downtime_s += max(now - self._idle_since, 0.0)
      self._idle_since = None
    for learner, slot in self._slots.items():
      if slot.state != GONE:
        self.set_state(learner, GONE, now)
    self._idle_since = None

  def totals(self, learner: int) -> dict[str, float]:
    """Seconds spent per state by one learner (after `close`, or up to its last change)."""
    return dict(self._slots[learner].totals)

  def goodput(self, now: float | None = None) -> float:
    """Σ busy / Σ provisioned over all slots (provisioned = busy + blocked + down).

    With `now`, each slot's current state counts up to `now` too (goodput so far, mid-run).
    """
    busy = provisioned = 0.0
    for slot in self._slots.values():
      totals = dict(slot.totals)
      if now is not None and slot.state != GONE:
        totals[slot.state] = totals.get(slot.state, 0.0) + max(now - slot.since, 0.0)
      busy += totals.get(BUSY, 0.0)
      provisioned += sum(v for k, v in totals.items() if k != GONE)
    return busy / provisioned if provisioned > 0 else 0.0
