"""Tests for `FaultEvent` and the executor interface."""

import pytest

from ddiloco.faults import KINDS, FaultEvent, check_supported


@pytest.mark.parametrize(
  "kwargs",
  [
    {"t": 1.0, "kind": "explode"},
    {"t": -1.0, "kind": "net_drop"},
    {"t": float("nan"), "kind": "net_drop"},
    {"t": 1.0, "kind": "kill_learner"},  # A learner kind without a learner.
    {"t": 1.0, "kind": "kill_syncer", "learner": 0},  # A learner on a syncer kind.
    {"t": 1.0, "kind": "kill_learner", "learner": -1},
    {"t": 1.0, "kind": "slow_learner", "learner": 0},  # No factor.
    {"t": 1.0, "kind": "slow_learner", "learner": 0, "params": {"factor": 0.0}},
    {"t": 1.0, "kind": "kill_learner", "learner": 0, "shard": 1},  # A shard on a learner kind.
    {"t": 1.0, "kind": "kill_syncer", "shard": -1},
  ],
)
def test_bad_events_are_refused(kwargs):
  with pytest.raises(ValueError):
    FaultEvent(**kwargs)


def test_every_kind_builds():
  for kind in KINDS:
    learner = 0 if kind.endswith("_learner") else None
    params = {"factor": 2.0} if kind == "slow_learner" else {}
    assert FaultEvent(0.0, kind, learner, params).kind == kind


def test_syncer_and_network_events_may_name_a_shard():
  assert FaultEvent(1.0, "kill_syncer", shard=1).shard == 1
  assert FaultEvent(1.0, "net_drop", shard=0).shard == 0
  assert FaultEvent(1.0, "start_syncer").shard is None  # Every shard.
  # Positional construction (t, kind, learner, params) is unchanged.
  assert FaultEvent(1.0, "kill_learner", 2, {"restart_delay_s": 1.0}).shard is None


class _OnlyKills:
  kinds = frozenset({"kill_learner", "start_learner"})

  def execute(self, event):
    return True


def test_check_supported_names_what_a_runtime_cannot_do():
  events = [FaultEvent(1.0, "kill_learner", 0), FaultEvent(2.0, "net_drop")]
  with pytest.raises(ValueError, match=r"The toy cannot execute fault kinds \['net_drop'\]"):
    check_supported(_OnlyKills(), events, "The toy")
  check_supported(_OnlyKills(), events[:1], "The toy")  # Supported: no error.
