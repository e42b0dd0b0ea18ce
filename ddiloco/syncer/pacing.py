"""The syncer's step clock and the rounds it opens: cadence, ticks and frozen fragments
(docs/algorithm.md, "Rounds")."""

import statistics
from collections.abc import Callable

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import MAX_STEP
from ddiloco.syncer.accounts import Accounts
from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.types import RoundRequest, SyncerConfig
from ddiloco.syncer.versions import VersionStore


class RoundPacer:
  """Keeps the step clock at the fleet's cadence and opens the rounds that come due on it.

  Reads the learners' step samples (`LearnerRegistry`); opens rounds in the `RoundTable` against
  the current versions (`VersionStore`), counting them (`Accounts`).
  """

  def __init__(
    self,
    *,
    config: SyncerConfig,
    schedule: FragmentSchedule,
    clock: Callable[[], float],
    learners: LearnerRegistry,
    rounds: RoundTable,
    versions: VersionStore,
    accounts: Accounts,
  ):
    self._config = config
    self._schedule = schedule
    self._clock = clock
    self._learners = learners
    self._rounds = rounds
    self._versions = versions
    self._accounts = accounts
    self._next_round_step: int | None = None  # First clock step `tick` has not yet processed.
    self._frozen: set[int] = set()  # Fragments `tick` opens no round for (`freeze`).
    self._cadence: float | None = None  # See cadence_step.
    self._cadence_time = 0.0

  def cadence_step(self) -> int:
    """The syncer's step clock now: the schedule step at which rounds are due.

    A clock, not a vote: it starts at the largest step an alive learner reported (heartbeats,
    `observe_steps`; or a report) and advances at the median rate (inner steps per second) of the
    alive learners, measured from their own step counts. Learners never change their pace for it,
    so there is no feedback: each answers the rounds at its own next step boundary, and a slower
    learner contributes fewer steps (and weighs less) per round. -1 before anything was observed.
    Not checkpointed; a restored syncer restarts it past every round it had opened.
    """
    now = self._clock()
    if self._config.clock == "slowest":
      positions = [lr.position for lr in self._learners.records() if lr.alive and lr.position >= 0]
      if positions:
        self._cadence = float(max(min(positions), self._cadence or 0.0))
      self._cadence_time = now
      return -1 if self._cadence is None else int(self._cadence)
    if self._cadence is None:
      seen = [
        max(
          lr.progress[0] if lr.progress is not None else -1,
          lr.steps_seen[0] if lr.steps_seen is not None else -1,
        )
        for lr in self._learners.records()
        if lr.alive
      ]
      seen = [s for s in seen if s >= 0]
      if not seen:
        return -1
      # The median learner's step (the larger middle one): a single learner claiming a far-off
      # step cannot move the clock of a fleet, and none moves it past a round already opened.
      start = sorted(seen)[len(seen) // 2]
      self._cadence = float(max(start, self._rounds.newest_step()))
    else:
      rate = self._fleet_rate()
      if rate:
        self._cadence = min(self._cadence + (now - self._cadence_time) * rate, float(MAX_STEP))
    self._cadence_time = now
    return int(self._cadence + 1e-9)  # A tick at the computed time lands on its step.

  def _fleet_rate(self) -> float:
    """The median inner-step rate of the alive learners heard from lately (0: none).

    A learner silent for 4 of its steps (at least 2 s: paused, crashed, partitioned) does not pace
    the clock until it is heard again; the liveness timeout that declares it dead is much longer.
    """
    now = self._clock()
    rates = [
      lr.rate
      for lr in self._learners.records()
      if lr.alive
      and lr.rate > 0
      and lr.heard is not None
      and now - lr.heard <= max(2.0, 4.0 / lr.rate)
    ]
    # statistics' median, not numpy's: the same value (the middle one, or the two middle ones'
    # mean), without numpy's ~20 µs a call; the merge loop asks for it on every pass.
    return float(statistics.median(rates)) if rates else 0.0

  def tick(self) -> list[RoundRequest]:
    """Opens every round that came due on the step clock since the last tick (see `SyncerCore`).

    Returns:
      The rounds opened, in due order: the transport asks every live learner for each.
    """
    now_step = self.cadence_step()
    if now_step < 0:
      return []
    if self._next_round_step is None:
      self._next_round_step = max(now_step, self._rounds.newest_step() + 1)
      self._rounds.settle_restore(self._next_round_step)
    # After a long stall (no alive learner) the clock may have moved by more than a period: each
    # fragment is due at most once in any H steps, so only the last period's steps matter.
    first = max(self._next_round_step, now_step - self._schedule.period + 1)
    opened = []
    for t in range(first, now_step + 1):
      if t < 1:
        continue
      for p in self._schedule.due(t):
        if t <= self._rounds.last_step(p) or p in self._frozen or p not in self._versions.owned:
          # Opened already (`open_round` called directly, or a restored round); frozen; another
          # shard's.
          continue
        request = self.open_round(p, t)
        if request is not None:
          opened.append(request)
    self._next_round_step = max(self._next_round_step, now_step + 1)
    return opened

  def open_round(self, p: int, step: int) -> RoundRequest | None:
    """Opens round (p, step) against p's current version; None if p's previous round is still open.

    `tick` calls this for every due fragment; tests and tools may call it directly.

    Raises:
      ValueError: on a step not after p's newest round.
    """
    if step <= self._rounds.last_step(p):
      raise ValueError(
        f"Round step {step} of fragment {p} is not after its newest round ({self._rounds.last_step(p)})."
      )
    if self._rounds.is_open(p):
      self._accounts.count("overrun_rounds")
      return None
    version = self._versions.version(p)
    self._rounds.open(p, step, version, self._clock())
    self._accounts.count("rounds_opened")
    return RoundRequest(p, step, version)

  def next_tick_time(self) -> float | None:
    """Clock time at which the step clock reaches the next unprocessed step; None if not running."""
    step = self.cadence_step()
    if self._config.clock == "slowest":  # Moves only when a learner reports its step.
      nxt = self._next_round_step
      return self._clock() if step >= 0 and (nxt is None or step >= nxt) else None
    rate = self._fleet_rate()
    if step < 0 or not rate:
      return None
    nxt = self._next_round_step if self._next_round_step is not None else int(self._cadence) + 1
    return self._cadence_time + max(nxt - self._cadence, 0.0) / rate

  def freeze(self, p: int) -> None:
    self._frozen.add(p)

  def unfreeze(self, p: int) -> None:
    self._frozen.discard(p)

  def frozen(self) -> frozenset[int]:
    return frozenset(self._frozen)

  def restart(self) -> None:
    """Restarts the step clock (a restore): past every restored round, at the next observation."""
    self._next_round_step, self._cadence = None, None
