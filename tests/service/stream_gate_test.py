"""Admission of data streams (service/stream_gate.py): the bounds, the unclaimed pool and its
eviction of the oldest silent stream, and fairness between learners."""

import pytest

from ddiloco.service import stream_gate
from ddiloco.service.stream_gate import StreamGate

pytestmark = pytest.mark.timeout(30)


def _evictable(gate: StreamGate, log: list, name: str, learner_id: int | None = None):
  return gate.enter(learner_id, on_evict=lambda: log.append(name))


def test_stream_gate_bounds_the_claimed_streams_and_each_learner():
  gate = StreamGate(total=3, per_learner=2, unclaimed=4)
  tickets = [gate.enter() for _ in range(4)]
  assert all(t is not None for t in tickets)
  assert gate.admit() == (None, "unclaimed")  # Four unclaimed, none evictable.
  assert tickets[0].claim(7) == "" and tickets[1].claim(7) == ""
  assert tickets[2].claim(7) == "learner"  # Learner 7 has its two.
  assert tickets[2].claim(8) == ""
  assert tickets[3].claim(9) == "total"  # Three claimed; learner 7's two have no on_evict.
  assert gate.open_streams() == (4, {7: 2, 8: 1})
  tickets[0].close()
  tickets[0].close()  # Idempotent: the handler and the call's end both close.
  assert gate.open_streams() == (3, {7: 1, 8: 1})
  assert tickets[3].claim(9) == ""
  for t in tickets:
    t.close()
  assert gate.open_streams() == (0, {})


def test_stream_gate_bounds_streams_yet_to_name_their_learner_in_a_pool_of_their_own():
  gate = StreamGate(total=2, per_learner=2, unclaimed=2)
  first, second = gate.enter(), gate.enter()
  assert gate.enter() is None  # Two unclaimed already.
  named = [gate.enter(learner_id=5), gate.enter(learner_id=6)]  # Pulls: never unclaimed.
  assert all(t is not None for t in named)
  assert first.claim(1) == "total"  # The learners' places are full: an unclaimed one waits.
  named[0].close()
  assert first.claim(1) == ""
  third = gate.enter()  # Claiming freed an unclaimed place.
  assert third is not None and gate.enter() is None
  for t in (first, second, third, named[1]):
    t.close()
  assert gate.open_streams() == (0, {})


def test_stream_gate_evicts_the_oldest_unclaimed_stream_for_a_new_one():
  gate = StreamGate(total=4, per_learner=4, unclaimed=2)
  evicted: list[str] = []
  a = _evictable(gate, evicted, "a")
  b = _evictable(gate, evicted, "b")
  c = _evictable(gate, evicted, "c")
  assert c is not None and evicted == ["a"]
  assert a.claim(1) == "evicted" and "the oldest" in a.evicted  # It can no longer name a learner.
  assert b.claim(1) == ""
  a.close()
  assert gate.open_streams() == (2, {1: 1})
  d = _evictable(gate, evicted, "d")
  assert d is not None and evicted == ["a"]  # b claimed: room without evicting.
  e = _evictable(gate, evicted, "e")  # c and d wait: c, the oldest, goes.
  assert e is not None and evicted == ["a", "c"]
  for t in (b, c, d, e):
    t.close()
  assert gate.open_streams() == (0, {})


def test_stream_gate_does_not_evict_a_stream_whose_first_chunk_arrived():
  gate = StreamGate(total=4, per_learner=4, unclaimed=2)
  evicted: list[str] = []
  a = _evictable(gate, evicted, "a")
  b = _evictable(gate, evicted, "b")
  assert a.arrived()  # Its header is in: it waits (for the service's lock) to name its learner.
  c = _evictable(gate, evicted, "c")
  assert c is not None and evicted == ["b"]  # b, still silent, goes; a stays.
  assert not b.arrived() and b.evicted and b.claim(1) == "evicted"
  assert c.arrived()
  ticket, why = gate.admit(on_evict=lambda: evicted.append("d"))
  assert ticket is None and why == "unclaimed"  # a and c arrived: neither is evicted.
  assert evicted == ["b"] and not a.evicted and not c.evicted
  assert a.claim(1) == "" and c.claim(1) == ""
  for t in (a, b, c):
    t.close()
  assert gate.open_streams() == (0, {})


def test_a_learner_with_nothing_open_takes_the_newest_place_of_the_learner_with_the_most():
  # Four places, learners 1 and 2 hold two each (stalled, say). Learner 0, with none, takes the
  # newest place of a learner holding two more than it; then learner 3, with none, takes the
  # other's. Learner 0, now with one, finds nobody holding two more than it: refused, and
  # nothing is evicted for it.
  gate = StreamGate(total=4, per_learner=3, unclaimed=2)
  evicted: list[str] = []
  held = {
    name: _evictable(gate, evicted, name, learner)
    for name, learner in (("1a", 1), ("2a", 2), ("1b", 1), ("2b", 2))
  }
  assert gate.open_streams() == (4, {1: 2, 2: 2})
  zero, why = gate.admit(0, on_evict=lambda: evicted.append("0"))
  assert zero is not None and why == ""
  assert evicted == ["1b"]  # Learner 1's newest (1 and 2 tie: the first found).
  assert "learner 1's 2 streams, to admit one of learner 0, which had 0 open" in held["1b"].evicted
  three = gate.enter(3)
  assert three is not None and evicted == ["1b", "2b"]
  assert gate.open_streams() == (4, {0: 1, 1: 1, 2: 1, 3: 1})
  assert gate.admit(0) == (None, "total")
  assert evicted == ["1b", "2b"]
  for t in [*held.values(), zero, three]:
    t.close()
  held["1b"].close()  # An evicted ticket gave its place up already: closing it frees nothing.
  assert gate.open_streams() == (0, {})


def test_a_claim_takes_a_fair_place_too_and_streams_without_eviction_are_kept():
  gate = StreamGate(total=3, per_learner=3, unclaimed=1)
  evicted: list[str] = []
  kept = gate.enter(1)  # No on_evict (an in-process pull, say): never evicted.
  a, b = _evictable(gate, evicted, "a", 1), _evictable(gate, evicted, "b", 1)
  newcomer = _evictable(gate, evicted, "n")
  assert newcomer.claim(0) == ""  # Learner 1 holds three, learner 0 none: b, the newest, goes.
  assert evicted == ["b"] and b.evicted and not a.evicted
  assert gate.open_streams() == (3, {0: 1, 1: 2})
  other = gate.enter()
  assert other.claim(2) == ""  # Learner 1 holds two: a goes, `kept` is not evictable.
  assert evicted == ["b", "a"]
  last = gate.enter()
  assert last.claim(3) == "total"  # One each: nobody holds two more.
  assert not b.watch(lambda: None)  # Evicted already: a handler taking it over is told so.
  for t in (kept, a, b, newcomer, other, last):
    t.close()
  assert gate.open_streams() == (0, {})


def test_watch_makes_a_stream_evictable_by_its_handler():
  gate = StreamGate(total=1, per_learner=1, unclaimed=1)
  evicted: list[str] = []
  ticket = gate.enter()  # Admitted by a carrier without a callback.
  assert ticket.claim(1) == ""
  assert ticket.watch(lambda: evicted.append("handler"))
  for _ in range(2):  # Learner 1 holds one; learner 0 none: not two more, nothing evicted.
    assert gate.admit(0) == (None, stream_gate.TOTAL)
  assert evicted == []
  ticket.close()


def test_stream_gate_says_why_it_refused():
  gate = StreamGate(total=2, per_learner=1)
  first = gate.enter(learner_id=3)
  assert gate.admit(learner_id=3) == (None, "learner")
  second, why = gate.admit(learner_id=4)
  assert second is not None and why == ""
  assert gate.admit(learner_id=5) == (None, "total")
  first.close()
  second.close()
  assert gate.open_streams() == (0, {})
  with pytest.raises(ValueError, match="per_learner"):
    StreamGate(total=2, per_learner=3)
