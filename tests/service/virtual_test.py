"""Tests for `VirtualSyncer`: the syncer service on a clock its caller moves, reached by links.

Two fragments of 64 float32 values (P = H = 2, τ = 1), K = 1 without a grace window, mean merge,
outer SGD with lr 1: a merge publishes the answers' mean exactly.
"""

import numpy as np
import optax
import pytest

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import Answer, HostTheta, RoundRequest, Uplink
from ddiloco.service.service_config import ServiceConfig
from ddiloco.service.virtual import VirtualSyncer
from ddiloco.syncer.merge_rules import WeightedMean
from ddiloco.syncer.types import SyncerConfig

pytestmark = pytest.mark.timeout(60)

KEYS = [["a"], ["b"]]
INIT = {"a": np.zeros(64, np.float32), "b": np.ones(64, np.float32)}


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def _syncer(clock, **service):
  return VirtualSyncer(
    fragment_keys=KEYS,
    init_values=INIT,
    syncer_config=SyncerConfig(
      use_grace=False, merge_rule=WeightedMean(), outer_optimizer=lambda: optax.sgd(1.0)
    ),
    service_config=ServiceConfig(uplink_codec="fp32", downlink_codec="fp32", **service),
    layout_digest="digest",
    schedule=FragmentSchedule(num_fragments=2, period=2, overlap=1),
    clock=clock,
  )


def _connect(syncer, learner_id, heard):
  link = syncer.link(learner_id)
  reg = link.register(num_devices=1, batch_size=1)
  states = [link.pull(p, -1) for p in range(2)]
  initial = syncer.subscribe(link, heard.append, lambda: heard.append("closed"))
  return link, reg, states, initial


def test_rounds_pushes_merges_and_pulls_run_on_the_callers_clock():
  clock, heard = _Clock(), []
  syncer = _syncer(clock)
  try:
    link, reg, states, initial = _connect(syncer, 0, heard)
    assert reg.versions == (0, 0) and [s.version for s in states] == [0, 0]
    assert initial == [(0, 0), (1, 0)]  # No round open yet; the current versions.
    assert syncer.next_wakeup() == pytest.approx(30.0)  # Only the liveness deadline so far.
    clock.now = 1.0
    link.heartbeat(1, step_time_s=1.0)  # Starts the syncer's step clock: step 1, a step a second.
    clock.now = syncer.next_wakeup()
    assert clock.now == pytest.approx(2.0)  # Step 2: fragment 0 is due.
    syncer.advance()
    (request,) = heard
    assert request == RoundRequest(0, 2, 0)
    p = request.fragment
    theta = {k: v + 0.5 for k, v in states[p].values.items()}
    answer = Answer(
      learner_id=0,
      fragment=p,
      round_step=2,
      step=2,
      anchor_version=0,
      tokens=8,
      steps=1,
      new_tokens=8,
      theta=HostTheta(theta),
      anchor=link.held.get(p, 0),  # Held since the pull: δ against it.
    )
    assert answer.uplink is Uplink.DELTA
    result = link.push(answer)
    assert result.status == "accepted" and result.round_version == 1
    syncer.advance()  # Everyone alive answered: it merges now.
    assert heard[-1] == (p, 1)
    state = link.pull(p)
    assert state.version == 1 and link.pull(p) is None  # Held now.
    np.testing.assert_array_equal(state.values[KEYS[p][0]], theta[KEYS[p][0]])
    assert state.digest == syncer.core.state(p).digest
    assert [m.version for m in syncer.merge_log()] == [1]
    up, down = syncer.traffic()
    assert up > 64 * 4 and down > 3 * 64 * 4
    assert syncer.stats()["refused"] == {}
  finally:
    syncer.close()


def test_a_silent_learner_is_declared_dead_at_its_liveness_deadline():
  clock, heard = _Clock(), []
  syncer = _syncer(clock, heartbeat_interval_s=0.5, liveness_timeout_s=3.0)
  try:
    link, *_ = _connect(syncer, 0, heard)
    clock.now = 1.0
    link.heartbeat(0)
    assert syncer.next_wakeup() == pytest.approx(4.0)
    clock.now = 3.9
    syncer.advance()
    assert syncer.core.alive() == {0}
    clock.now = 4.0
    syncer.advance()
    assert syncer.core.alive() == frozenset() and heard[-1] == "closed"
    assert not link.heartbeat(5).registered  # As a learner process finds out.
    link.register()
    assert syncer.core.alive() == {0}
  finally:
    syncer.close()
