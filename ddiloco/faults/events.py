"""`FaultEvent` and the kinds of fault every runtime shares.

Each kind acts on a learner, the syncer or the network. A fault that lasts has a completion kind
that ends it (a kill its start, a pause its resume, a window its end); a schedule always follows a
fault with its completion, so a runtime never has to remember to undo one.

  kill_learner / start_learner     the learner's process dies (its unmerged progress with it) and
                                   is started again; it rejoins from the global model.
  pause_learner / resume_learner   the process is frozen (SIGSTOP) and thawed: a straggler.
  slow_learner / unslow_learner    the learner steps `factor` times slower (simulator only: a
                                   process slowdown is a duty cycle of pauses).
  add_learner / remove_learner     the fleet grows (scavenged capacity) or shrinks for good.
  kill_syncer / start_syncer       the syncer's process dies and restarts from its checkpoint.
  net_delay / net_clear            added one-way latency on every connection, and its end.
  net_drop                         every connection reset at once.
  net_partition / net_heal         traffic stalls (or is refused), and flows again.

A syncer or network event may name a shard of a sharded syncer (`FaultEvent.shard`): the shard's
process, or the connections to it. Without one it acts on every shard at once: the whole syncer
dies and restarts, every connection to the syncer misbehaves. An unsharded syncer is shard 0.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

LEARNER_KINDS = (
  "kill_learner",
  "start_learner",
  "pause_learner",
  "resume_learner",
  "slow_learner",
  "unslow_learner",
  "add_learner",
  "remove_learner",
)
SYNCER_KINDS = ("kill_syncer", "start_syncer")
NETWORK_KINDS = ("net_delay", "net_clear", "net_drop", "net_partition", "net_heal")
KINDS = LEARNER_KINDS + SYNCER_KINDS + NETWORK_KINDS
# The kinds that end a lasting fault. At equal times a completion runs before a new injection, so
# a learner restarted at t can be chosen again at t and a window that ends at t frees its slot.
COMPLETIONS = (
  "start_learner",
  "resume_learner",
  "unslow_learner",
  "start_syncer",
  "net_clear",
  "net_heal",
)


@dataclasses.dataclass(frozen=True)
class FaultEvent:
  """One fault at one time.

  Attributes:
    t: seconds after the start of the run (wall or virtual, as the runtime's clock).
    kind: one of KINDS.
    learner: the learner for LEARNER_KINDS, None otherwise.
    params: kind-specific values, JSON-serialisable (e.g. {"latency_s": 0.2} for net_delay,
      {"factor": 2.0} for slow_learner, {"restart_delay_s": 20.0} for a kill that is restarted).
    shard: for SYNCER_KINDS and NETWORK_KINDS, the syncer shard it acts on; None (the default):
      every shard (module docstring). None for learner kinds.
  """

  t: float
  kind: str
  learner: int | None = None
  params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  shard: int | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Unknown fault kind {self.kind!r}; expected one of {KINDS}.")
    if not math.isfinite(self.t) or self.t < 0:
      raise ValueError(f"Event time must be finite and >= 0, got {self.t}.")
    if (self.kind in LEARNER_KINDS) != (self.learner is not None):
      raise ValueError(f"{self.kind} needs a learner exactly when it is a learner event: {self}.")
    if self.learner is not None and self.learner < 0:
      raise ValueError(f"Negative learner index in {self}.")
    if self.shard is not None and (self.kind not in SYNCER_KINDS + NETWORK_KINDS or self.shard < 0):
      raise ValueError(f"A shard (>= 0) is for syncer and network events only: {self}.")
    if self.kind == "slow_learner" and not self.params.get("factor", 0) > 0:
      raise ValueError(f"slow_learner needs a factor > 0: {self}.")
