"""The simulator's virtual clock and network: the event queue, message latencies and transfers."""

import heapq
import itertools
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ddiloco.fragments import compression


class EventQueue:
  """Events ordered by virtual time, then by when they were scheduled (ties keep their order).

  A kind scheduled with `schedule_once` (e.g. the syncer's "wake") has one pending time: an
  earlier one supersedes a later one, and the superseded events are dropped when they come up, so
  that they never move the clock.
  """

  def __init__(self):
    self._heap: list[tuple[float, int, str, tuple]] = []
    self._seq = itertools.count()
    self._pending_at: dict[str, float] = {}
    self._once_kinds: set[str] = set()

  def __bool__(self) -> bool:
    return bool(self._heap)

  def push(self, t: float, kind: str, *payload: Any) -> None:
    heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

  def schedule_once(self, kind: str, at: float | None, now: float) -> None:
    """Schedules a `kind` event at `at` (not before `now`) unless one is pending sooner."""
    if at is None:
      return
    self._once_kinds.add(kind)
    at = max(at, now)
    pending = self._pending_at.get(kind)
    if pending is None or at < pending:
      self._pending_at[kind] = at
      self.push(at, kind)

  def pop(self) -> tuple[float, str, tuple] | None:
    """The next event (time, kind, payload) that is not superseded; None when none is left."""
    while self._heap:
      t, _, kind, payload = heapq.heappop(self._heap)
      if kind in self._once_kinds:
        if t != self._pending_at.get(kind):
          continue  # Superseded by an earlier one.
        del self._pending_at[kind]
      return t, kind, payload
    return None

  def has_any(self, kinds: Collection[str]) -> bool:
    """Whether an event of one of `kinds` is queued."""
    return any(kind in kinds for _, _, kind, _ in self._heap)


class VirtualNetwork:
  """Message latencies (with log-normal jitter from their own random stream) and transfer times.

  Args:
    bandwidth_gbps: link bandwidth; 0 = infinite (a transfer takes its latency only).
    latency_jitter: σ of the log-normal factor on each message's latency; 0 = none.
    rng: the jitter's random stream.
  """

  def __init__(self, *, bandwidth_gbps: float, latency_jitter: float, rng: np.random.Generator):
    self.bandwidth_gbps = bandwidth_gbps
    self.latency_jitter = latency_jitter
    self._rng = rng

  def latency(self, latency: float) -> float:
    """One message's latency: `latency`, times a log-normal draw with `latency_jitter`."""
    if self.latency_jitter > 0:
      latency *= float(np.exp(self._rng.normal(0.0, self.latency_jitter)))
    return latency

  def transfer_s(self, nbytes: int, latency: float) -> float:
    """Seconds for `nbytes` to arrive after a message latency of `latency`."""
    bw = self.bandwidth_gbps
    return latency + (nbytes * 8 / (bw * 1e9) if bw > 0 else 0.0)

  @staticmethod
  def wire_bytes(values: Mapping[str, np.ndarray], codec: str, block_size: int) -> int:
    """Bytes of `values` in `codec` (payload and scales), for transfer times."""
    c = compression.get_codec(codec, block_size)
    return sum(sum(c.nbytes(v.size)) for v in values.values())
