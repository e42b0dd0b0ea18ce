"""Tests of a SyncerCore that owns a subset of the fragments (one syncer shard)."""

import numpy as np
import pytest

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore

# Four fragments of one key each; shard 1 of 2 owns fragments 1 and 3.
KEYS = (("a",), ("b",), ("c",), ("d",))


class FakeClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


def init_values():
  return {k: np.full((3,), 1.0 + i, np.float32) for i, (k,) in enumerate(KEYS)}


def make_core(owned=None, clock=None):
  return SyncerCore(
    fragment_keys=KEYS,
    init_values=init_values(),
    config=SyncerConfig(use_grace=False, min_quorum=1),
    clock=clock or FakeClock(),
    schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
    owned=owned,
  )


def test_a_shard_holds_only_its_fragments():
  values = init_values()
  core = make_core({1, 3})
  assert core.owned == {1, 3} and core.owns(3) and not core.owns(0)
  assert set(core.state(1).values) == {"b"} and set(core.state(0).values) == set()
  np.testing.assert_array_equal(core.state(3).values["d"], values["d"])
  whole = make_core()
  # The shard's digests of its fragments are the unsharded syncer's.
  assert core.state(1).digest == whole.state(1).digest
  # Its checkpoint holds only its fragments, and only a core owning the same fragments loads it.
  d = core.state_dict()
  assert not any(k.startswith(("fragment/0/v0/", "fragment/2/v0/")) for k in d)
  assert any(k.startswith("fragment/1/v0/") for k in d)
  assert core.layout_fingerprint() != whole.layout_fingerprint()
  make_core({1, 3}).load_state_dict(d)
  with pytest.raises(ValueError, match="different fragment layout"):
    make_core({0, 2}).load_state_dict(d)
  # Only the owned fragments' values are needed.
  SyncerCore(
    fragment_keys=KEYS,
    init_values={"b": values["b"], "d": values["d"]},
    config=SyncerConfig(),
    clock=FakeClock(),
    owned={1, 3},
  )


def test_a_shard_opens_and_merges_only_its_rounds():
  clock = FakeClock()
  core = make_core({1, 3}, clock)
  core.register(7)
  for p in (1, 3):
    core.fetch(7, p)
  opened = set()
  for step in range(1, 9):  # Two periods of the step clock.
    for p in range(4):
      if core.schedule.is_due(p, step) and core.owns(p):
        r = core.open_round(p, step)
        if r is not None:
          opened.add(p)
          values = {k: v + np.float32(0.5) for k, v in core.state(p).values.items()}
          result = core.report(
            Report(
              learner_id=7,
              fragment=p,
              values=values,
              tokens=10,
              steps=4,
              anchor_version=core.version(p),
              step=step,
              round_step=step,
            )
          )
          assert result.status == "accepted"
    clock.t += 1.0
    core.closer.poll()
  assert opened == {1, 3}
  assert core.version(1) >= 1 and core.version(3) >= 1
  assert core.version(0) == 0 and core.version(2) == 0
  with pytest.raises(ValueError, match="another syncer shard"):
    core.open_round(0, 20)


def test_tick_opens_only_owned_rounds():
  clock = FakeClock()
  core = make_core({0, 2}, clock)
  for i in (1, 2):
    core.register(i)
  # Drive the step clock through heartbeats at one step per second.
  opened = []
  for step in range(12):
    for i in (1, 2):
      core.observe_steps(i, step, step_time_s=1.0, min_interval_s=0.0)
    opened += [r.fragment for r in core.pacer.tick()]
    clock.t += 1.0
  assert opened and set(opened) <= {0, 2}


def test_owned_must_name_known_fragments():
  with pytest.raises(ValueError, match="owned must name"):
    make_core({4})
  with pytest.raises(ValueError, match="owned must name"):
    make_core(set())
