"""Fault schedules for the simulated cluster, written as short strings so gin and flags can carry them.

Grammar: `KIND:LEARNER@TIME[+DURATION][xFACTOR]`, times in (virtual) seconds.
  crash:1@30+20     learner 1 crashes at t=30 s and is back (restarted, rejoined) at t=50 s
  crash:1@30        learner 1 crashes at t=30 s and never returns
  leave:2@80        learner 2 is removed at t=80 s (scale-down)
  join:4@50         learner 4 joins at t=50 s (scavenging; it gets learner_specs[4] or the default)
  slow:3@10+40x2.0  learner 3 steps 2x slower from t=10 s to t=50 s (a straggler)
"""

import dataclasses
import math
import re

KINDS = ("crash", "leave", "join", "slow")
_PATTERN = re.compile(
  r"^(?P<kind>[a-z]+):(?P<learner>\d+)@(?P<time>[0-9.]+)"
  r"(?:\+(?P<duration>[0-9.]+|inf))?(?:x(?P<factor>[0-9.]+))?$"
)


@dataclasses.dataclass(frozen=True)
class Fault:
  """One scheduled fault.

  Attributes:
    kind: "crash" | "leave" | "join" | "slow".
    learner: learner index.
    time_s: when it happens.
    duration_s: crash: downtime before the learner rejoins (inf: never); slow: how long it lasts.
    factor: slow: step-time multiplier.
  """

  kind: str
  learner: int
  time_s: float
  duration_s: float = math.inf
  factor: float = 1.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Unknown fault kind {self.kind!r}; expected one of {KINDS}.")
    if self.learner < 0 or self.time_s < 0 or self.duration_s < 0:
      raise ValueError(f"Fault {self} has a negative learner, time or duration.")
    if self.kind == "slow" and (self.factor <= 0 or math.isinf(self.duration_s)):
      raise ValueError(f"slow needs a finite +DURATION and a factor > 0: {self}.")


def parse_fault(text: str) -> Fault:
  """Parses one fault string (see the module docstring).

  Raises:
    ValueError: with the offending text if it does not match the grammar.
  """
  m = _PATTERN.match(text.strip())
  if m is None:
    raise ValueError(
      f"Cannot parse fault {text!r}; expected KIND:LEARNER@TIME[+DURATION][xFACTOR], "
      "e.g. 'crash:1@30+20'."
    )
  duration = m["duration"]
  return Fault(
    kind=m["kind"],
    learner=int(m["learner"]),
    time_s=float(m["time"]),
    duration_s=math.inf if duration in (None, "inf") else float(duration),
    factor=float(m["factor"]) if m["factor"] else 1.0,
  )


def parse_faults(texts: tuple[str, ...] | list[str]) -> list[Fault]:
  """Parses a schedule, sorted by time."""
  return sorted((parse_fault(t) for t in texts), key=lambda f: (f.time_s, f.learner))
