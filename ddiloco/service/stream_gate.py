"""Admission of data streams: who gets one of the syncer's places for a push, a pull or a Recover.

Every data stream holds a thread for its life (a bulk port connection's, a gRPC server's), so
their number is bounded; and the bound must not let one learner, or clients that never say who
they are, lock the others out. `StreamGate` keeps two pools:

- **Claimed** streams, counted against a learner id: at most `total` in all and `per_learner`
  for one learner. When they are all taken, a learner with fewer streams open than the one
  holding the most takes that one's newest place (max-min fairness): the newest stream of the
  learner with the most is evicted (its `on_evict` called) if that learner holds at least two
  more than the newcomer. A learner with nothing open thus always gets a place while another
  holds two or more, however many of its streams are stalled, and with `total` at least the
  fleet's size, always. Evicting the newest, not the oldest, leaves a learner's older transfers,
  likelier to finish, alone.
- **Unclaimed** streams, whose learner is not known yet (a push names it in its first chunk; a
  bulk port connection in its hello's session): at most `unclaimed`, a pool of their own, so
  they can never take a claimed place. When it is full, a new one evicts the oldest unclaimed one
  not yet `arrived` (that has shown nothing of itself); an arrived one (its header in, waiting for
  the service's lock to be checked) is not stalling and is not evicted.

A stream is admitted in one step if its learner is known (`admit(learner_id)`: a pull) or in two,
`admit()` then `StreamTicket.claim`. `StreamTicket.close` undoes both; it is idempotent, and
every handler closes its ticket on every exit (service/streams.py), so counts never leak. An
evicted stream gives its place up at once (the newcomer takes it), and its handler ends on its
own: a push's at its next read (`door.PacedStream.interrupt`), a pull's before its next message.
"""

import threading
from collections.abc import Callable

import grpc

from ddiloco.service.refusals import Refusal

# Why a stream was not admitted (`StreamGate.admit`, `StreamTicket.claim`).
TOTAL, LEARNER, UNCLAIMED, EVICTED = "total", "learner", "unclaimed", "evicted"


class StreamGate:
  """Admission of data streams (see module docstring).

  Args:
    total: claimed streams open at once.
    per_learner: claimed streams open at once for one learner id.
    unclaimed: streams open at once whose learner is not known yet (default: `total`).
  """

  def __init__(self, total: int, per_learner: int, unclaimed: int | None = None):
    if not 1 <= per_learner <= total:
      raise ValueError(f"Need 1 <= per_learner <= total, got {per_learner} and {total}.")
    self.total, self.per_learner = total, per_learner
    self.unclaimed = total if unclaimed is None else unclaimed
    self._lock = threading.Lock()
    # Claimed tickets by learner, each learner's in admission order (newest last).
    self._claimed: dict[int, dict[int, StreamTicket]] = {}
    self._n_claimed = 0
    self._unclaimed = 0
    self._waiting: dict[int, StreamTicket] = {}  # Evictable unclaimed tickets, oldest first.

  def enter(
    self, learner_id: int | None = None, on_evict: Callable[[], None] | None = None
  ) -> "StreamTicket | None":
    """`admit`'s ticket, or None."""
    return self.admit(learner_id, on_evict)[0]

  def admit(
    self, learner_id: int | None = None, on_evict: Callable[[], None] | None = None
  ) -> "tuple[StreamTicket | None, str]":
    """(a ticket for a new stream, "") or (None, why: `TOTAL`, `LEARNER` or `UNCLAIMED`).

    A stream whose learner is known at once (a pull) passes `learner_id`: it is claimed at entry
    (evicting another learner's newest stream if the claimed places are full and that is fair),
    or refused. An unclaimed stream takes an unclaimed place, evicting the oldest unclaimed
    stream not yet arrived if they are full. `on_evict` is called (outside the gate's lock) if
    this stream is evicted later; a stream without one is never evicted.
    """
    ticket = StreamTicket(self, on_evict)
    with self._lock:
      if learner_id is None:
        evicted = None
        if self._unclaimed >= self.unclaimed:
          if not self._waiting:
            return None, UNCLAIMED
          evicted = self._waiting.pop(next(iter(self._waiting)))
          evicted._evicted = "the oldest of the streams that had not named their learner yet"
          self._unclaimed -= 1
        self._unclaimed += 1
        if on_evict is not None:
          self._waiting[id(ticket)] = ticket
      else:
        why, evicted = self._take_claimed(ticket, learner_id)
        if why:
          return None, why
    if evicted is not None:
      evicted._on_evict()
    return ticket, ""

  def open_streams(self) -> tuple[int, dict[int, int]]:
    """(open streams, claimed or not, {learner id: its open streams})."""
    with self._lock:
      by_learner = {i: len(t) for i, t in self._claimed.items()}
      return self._n_claimed + self._unclaimed, by_learner

  def _take_claimed(self, ticket: "StreamTicket", learner_id: int):
    """(why not, evicted ticket or None): a claimed place for `ticket`; under the lock."""
    mine = self._claimed.get(learner_id, {})
    if len(mine) >= self.per_learner:
      return LEARNER, None
    evicted = None
    if self._n_claimed >= self.total:
      evicted = self._fair_victim(learner_id, len(mine))
      if evicted is None:
        return TOTAL, None
      evicted._evicted = (
        f"the newest of learner {evicted._learner}'s {len(self._claimed[evicted._learner])} "
        f"streams, to admit one of learner {learner_id}, which had {len(mine)} open"
      )
      self._drop_claimed(evicted)
    self._claimed.setdefault(learner_id, {})[id(ticket)] = ticket
    self._n_claimed += 1
    ticket._learner = learner_id
    return "", evicted

  def _fair_victim(self, learner_id: int, mine: int) -> "StreamTicket | None":
    """The newest evictable stream of the learner holding the most, if it holds two or more
    than `mine`; under the lock."""
    best = None
    for other, tickets in self._claimed.items():
      if other == learner_id or len(tickets) < mine + 2:
        continue
      if best is not None and len(tickets) <= len(self._claimed[best]):
        continue
      if any(t._evictable for t in tickets.values()):
        best = other
    if best is None:
      return None
    return next(t for t in reversed(self._claimed[best].values()) if t._evictable)

  def _drop_claimed(self, ticket: "StreamTicket") -> None:
    tickets = self._claimed[ticket._learner]
    del tickets[id(ticket)]
    if not tickets:
      del self._claimed[ticket._learner]
    self._n_claimed -= 1

  def _arrive(self, ticket: "StreamTicket") -> bool:
    with self._lock:
      self._waiting.pop(id(ticket), None)
      return not ticket._evicted

  def _claim(self, ticket: "StreamTicket", learner_id: int) -> tuple[str, "StreamTicket | None"]:
    with self._lock:
      if ticket._evicted:
        return EVICTED, None
      why, evicted = self._take_claimed(ticket, learner_id)
      if not why:
        self._unclaimed -= 1
        self._waiting.pop(id(ticket), None)
      return why, evicted

  def _watch(self, ticket: "StreamTicket", on_evict: Callable[[], None]) -> bool:
    with self._lock:
      if ticket._evicted:
        return False
      ticket._on_evict, ticket._evictable = on_evict, True
      return True

  def _release(self, ticket: "StreamTicket") -> None:
    with self._lock:
      self._waiting.pop(id(ticket), None)
      if ticket._evicted:
        return  # It gave its place up when it was evicted.
      if ticket._learner is None:
        self._unclaimed -= 1
      else:
        self._drop_claimed(ticket)


class StreamTicket:
  """One admitted stream (`StreamGate.admit`)."""

  def __init__(self, gate: StreamGate, on_evict: Callable[[], None] | None):
    self._gate = gate
    self._learner: int | None = None
    self._lock = threading.Lock()
    self._closed = False
    self._evicted = ""  # Why it was evicted ("": it was not).
    self._evictable = on_evict is not None
    self._on_evict: Callable[[], None] = on_evict or (lambda: None)

  @property
  def learner(self) -> int | None:
    """The learner the stream is counted against (None: not claimed yet)."""
    return self._learner

  @property
  def evicted(self) -> str:
    """Why the stream was evicted to admit another ("" if it was not): it holds no place."""
    return self._evicted

  def arrived(self) -> bool:
    """The stream has shown itself (a push's first chunk): it is no longer evicted for a newer
    unclaimed one. False if it was evicted already."""
    return self._gate._arrive(self)

  def claim(self, learner_id: int) -> str:
    """Counts the stream against `learner_id`: "" if done, else why not (`LEARNER`: its share is
    open; `TOTAL`: every claimed place is taken, none fairly; `EVICTED`: evicted meanwhile)."""
    if self._learner is not None:
      raise RuntimeError("A stream is claimed once.")
    why, evicted = self._gate._claim(self, learner_id)
    if evicted is not None:
      evicted._on_evict()
    return why

  def watch(self, on_evict: Callable[[], None]) -> bool:
    """Makes `on_evict` what an eviction calls from now on (a handler taking over a stream its
    carrier admitted); False if the stream was evicted already."""
    return self._gate._watch(self, on_evict)

  def close(self) -> None:
    """Frees the stream's place (idempotent: called by the handler and at the call's end)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._gate._release(self)


class Admission:
  """The gate's answers as the service's counted refusals: RESOURCE_EXHAUSTED, saying why.

  A refusal is transient: every stream's handler holds its place until it ends, which may be after
  its client gave up on it (a client deadline or a dropped connection while the server still
  reads, waits for the lock or files), so a retry may meet its first attempt's place still held;
  the client's retry with backoff passes once that handler is done.

  Args:
    gate: the gate.
    refuse: makes (and counts) a refusal from a status code and a message.
  """

  def __init__(self, gate: StreamGate, refuse: Callable[[grpc.StatusCode, str], Refusal]):
    self.gate = gate
    self._refuse = refuse

  def admit(
    self, learner_id: int | None = None, on_evict: Callable[[], None] | None = None
  ) -> StreamTicket:
    """`StreamGate.admit`'s ticket, or its refusal raised."""
    ticket, why = self.gate.admit(learner_id, on_evict)
    if ticket is None:
      raise self.refusal(why, learner_id)
    return ticket

  def claim(self, ticket: StreamTicket, learner_id: int) -> None:
    """`StreamTicket.claim`, or its refusal raised (an eviction's too)."""
    why = ticket.claim(learner_id)
    if why == EVICTED:  # Not the learner's share: the stream was cut for another.
      raise self.evicted(ticket)
    if why:
      raise self.refusal(why, learner_id)

  def refusal(self, why: str, learner_id: int | None) -> Refusal:
    """The counted refusal of a stream the gate did not admit (`why`: the gate's)."""
    gate = self.gate
    if why == LEARNER:
      message = (
        f"Learner {learner_id} has {gate.per_learner} push and pull streams open; retry later."
      )
    elif why == UNCLAIMED:
      message = (
        f"{gate.unclaimed} streams that have not named their learner yet are open, each with its "
        "header in; retry later."
      )
    else:
      message = (
        f"The syncer's {gate.total} push and pull streams are taken, no learner holding two more "
        f"than learner {learner_id}; retry later."
      )
    return self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

  def evicted(self, ticket: StreamTicket) -> Refusal:
    """The counted refusal of a stream evicted to admit another."""
    return self._refuse(
      grpc.StatusCode.RESOURCE_EXHAUSTED,
      f"This stream was cut to make room: it was {ticket.evicted}. Retry later.",
    )
