"""Tests for the simulator's event queue and virtual network."""

import numpy as np
import pytest

from ddiloco.simulation.clock import EventQueue, VirtualNetwork


def test_events_come_out_by_time_then_by_scheduling_order():
  q = EventQueue()
  q.push(2.0, "b", 1)
  q.push(1.0, "a")
  q.push(2.0, "c", 2, 3)
  assert [q.pop(), q.pop(), q.pop(), q.pop()] == [
    (1.0, "a", ()),
    (2.0, "b", (1,)),
    (2.0, "c", (2, 3)),
    None,
  ]


def test_schedule_once_keeps_the_earliest_and_drops_superseded_ones():
  q = EventQueue()
  q.schedule_once("wake", 5.0, now=0.0)
  q.schedule_once("wake", 3.0, now=0.0)  # Supersedes 5.
  q.schedule_once("wake", 4.0, now=0.0)  # Later than the pending 3: ignored.
  q.schedule_once("wake", None, now=0.0)  # Nothing due: ignored.
  q.push(4.5, "step")
  assert q.pop() == (3.0, "wake", ())
  assert q.pop() == (4.5, "step", ())  # The superseded wake at 5 never comes out.
  assert q.pop() is None and not q
  q.schedule_once("wake", 1.0, now=2.0)  # In the past: now.
  assert q.has_any({"wake"}) and not q.has_any({"step"})
  assert q.pop() == (2.0, "wake", ())


def test_network_latency_jitter_and_transfer_time():
  flat = VirtualNetwork(bandwidth_gbps=0.0, latency_jitter=0.0, rng=np.random.default_rng(0))
  assert flat.latency(0.05) == 0.05 and flat.transfer_s(10**9, 0.05) == 0.05
  link = VirtualNetwork(bandwidth_gbps=8.0, latency_jitter=1.0, rng=np.random.default_rng(0))
  assert link.transfer_s(10**9, 0.5) == pytest.approx(1.5)  # 8 Gbit at 8 Gbit/s, plus latency.
  draws = [link.latency(0.05) for _ in range(200)]
  assert min(draws) > 0 and len(set(draws)) == 200
  assert np.median(draws) == pytest.approx(0.05, rel=0.3)  # Log-normal around the latency.
  assert VirtualNetwork.wire_bytes({"w": np.zeros(8, np.float32)}, "fp32", 64) == 32
