"""Faults written as short strings, so gin files and flags can carry a schedule.

Grammar: `KIND:LEARNER@TIME[+DURATION][xFACTOR]` for a learner, `syncer[:SHARD]@TIME[+DURATION]`
for the syncer, times in seconds of the run's clock.
  crash:1@30+20     learner 1 is killed at t=30 s and started again (it rejoins) at t=50 s
  crash:1@30        learner 1 is killed at t=30 s and never returns
  leave:2@80        learner 2 is removed at t=80 s (scale-down)
  join:4@50         learner 4 is added at t=50 s (scavenging)
  slow:3@10+40x2.0  learner 3 steps 2x slower from t=10 s to t=50 s (a straggler)
  syncer@60+5       the syncer (every shard of a sharded one) is killed at t=60 s and restarted
                    from its checkpoint at t=65 s
  syncer:1@60+5     shard 1 of a sharded syncer alone is killed at t=60 s and restarted at t=65 s

Each string becomes the `FaultEvent`s of its kind and, for one that lasts, of its completion
(crash: kill_learner and start_learner; slow: slow_learner and unslow_learner; syncer: kill_syncer
and start_syncer, with `FaultEvent.shard` the shard or None for every shard).
"""

import math
import re
from collections.abc import Sequence

from ddiloco.faults.events import COMPLETIONS, FaultEvent

_PATTERN = re.compile(
  r"^(?P<kind>[a-z]+)(?::(?P<learner>\d+))?@(?P<time>[0-9.]+)"
  r"(?:\+(?P<duration>[0-9.]+|inf))?(?:x(?P<factor>[0-9.]+))?$"
)
_WORDS = ("crash", "leave", "join", "slow", "syncer")


def parse_fault(text: str) -> list[FaultEvent]:
  """The events of one fault string (see the module docstring), in time order.

  Raises:
    ValueError: with the offending text if it does not match the grammar or its values are out
      of range.
  """
  m = _PATTERN.match(text.strip())
  if m is None:
    raise ValueError(
      f"Cannot parse fault {text!r}; expected KIND:LEARNER@TIME[+DURATION][xFACTOR] or "
      "syncer[:SHARD]@TIME[+DURATION], e.g. 'crash:1@30+20'."
    )
  word, t = m["kind"], float(m["time"])
  learner = None if m["learner"] is None else int(m["learner"])
  duration = math.inf if m["duration"] in (None, "inf") else float(m["duration"])
  factor = float(m["factor"]) if m["factor"] else 1.0
  if word not in _WORDS:
    raise ValueError(f"Unknown fault kind {word!r} in {text!r}; expected one of {_WORDS}.")
  if word == "syncer":
    return _syncer_fault(text, learner, t, duration, m["factor"])
  if learner is None:
    raise ValueError(f"A {word} fault needs a learner, e.g. '{word}:1@30': {text!r}.")
  if word == "crash":
    if math.isinf(duration):
      return [FaultEvent(t, "kill_learner", learner)]
    return [
      FaultEvent(t, "kill_learner", learner, {"restart_delay_s": duration}),
      FaultEvent(t + duration, "start_learner", learner),
    ]
  if word == "slow":
    if math.isinf(duration) or not factor > 0:
      raise ValueError(f"slow needs a finite +DURATION and a factor > 0: {text!r}.")
    return [
      FaultEvent(t, "slow_learner", learner, {"factor": factor, "duration_s": duration}),
      FaultEvent(t + duration, "unslow_learner", learner),
    ]
  return [FaultEvent(t, "remove_learner" if word == "leave" else "add_learner", learner)]


def _syncer_fault(
  text: str, shard: int | None, t: float, duration: float, factor: str | None
) -> list[FaultEvent]:
  """The events of a `syncer[:SHARD]@TIME[+DURATION]` string."""
  if factor:
    raise ValueError(f"A syncer fault has no xFACTOR: {text!r}.")
  if math.isinf(duration):
    return [FaultEvent(t, "kill_syncer", shard=shard)]
  return [
    FaultEvent(t, "kill_syncer", params={"restart_delay_s": duration}, shard=shard),
    FaultEvent(t + duration, "start_syncer", shard=shard),
  ]


def parse_faults(texts: Sequence[str]) -> list[FaultEvent]:
  """The events of a schedule, sorted by time (at equal times completions first, then syncer
  events, then by learner).

  Raises:
    ValueError: if a string does not parse (see `parse_fault`).
  """
  events = [e for text in texts for e in parse_fault(text)]
  return sorted(events, key=_order)


def _order(e: FaultEvent) -> tuple:
  who = (-1, -1 if e.shard is None else e.shard) if e.learner is None else (e.learner, -1)
  return (e.t, e.kind not in COMPLETIONS, *who)
