"""Tests of a SyncerCore that owns a subset of the fragments (one syncer shard)."""

import numpy as np
import pytest

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore
from ddiloco.testing import learners

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


def test_each_slice_of_a_group_is_its_own_round_applied_on_its_own():
  """The per-slice rule (docs/architecture.md, "The sharded syncer"): one group cut into two
  slices, each merged by its own shard with its own quorum and version, each applied by the
  learner when it arrives; the learner's digests are the shards'."""
  learner = learners.tiny_learner(num_fragments=1, period=4, overlap=1, slices=2)
  layout, schedule = learner.layout, learner.schedule
  initial = {p: learner.device.read(p) for p in range(2)}
  clock = FakeClock()
  cores = [
    SyncerCore(
      fragment_keys=layout.fragments,
      init_values=initial[s],
      config=SyncerConfig(use_grace=False, min_quorum=2),
      clock=clock,
      schedule=schedule,
      owned={s},
    )
    for s in range(2)
  ]
  for s, core in enumerate(cores):
    assert core.state(s).digest == learner.kernel.held.newest_held()[s][1]
    for i in range(3):
      core.register(i)
      core.fetch(i, s)
  for t in range(1, 5):
    learner.train_step(learners.batch(t))
  assert schedule.due(4) == (0, 1)  # The group is due at H = 4: both slices together.
  for s, core in enumerate(cores):
    learner.kernel.ask(core.open_round(s, 4))
  assert learner.due() == (0, 1)

  def report(i, s, values):
    return Report(
      learner_id=i,
      fragment=s,
      values=values,
      tokens=8,
      steps=4,
      anchor_version=0,
      step=4,
      round_step=4,
    )

  for s, core in enumerate(cores):
    answer = learner.answer(s, host_copy=True)
    assert core.report(report(0, s, answer.theta())).status == "accepted"
    # Learner 1 answers both slices; learner 2's answer of slice 1 never reaches shard 1.
    for i in (1, 2) if s == 0 else (1,):
      theta = {k: v + np.float32(0.01 * i) for k, v in initial[s].items()}
      assert core.report(report(i, s, theta)).status == "accepted"
  merges = [core.closer.poll() for core in cores]
  assert [[(e.fragment, e.version, e.contributors) for e in m] for m in merges] == [
    [(0, 1, (0, 1, 2))],
    [(1, 1, (0, 1))],
  ]
  # Slice 0 arrives first and is applied alone, τ = 1 step after the answer; slice 1 stays at
  # version 0 until its own merge arrives.
  learner.kernel.receive(cores[0].state(0))
  learner.train_step(learners.batch(5))
  assert learner.apply_ready() == [(0, 1)]
  assert list(learner.kernel.anchor) == [1, 0]
  learner.kernel.receive(cores[1].state(1))
  assert learner.apply_ready() == [(1, 1)]
  checks = learner.verified_applies(block=True)
  assert [(c.fragment, c.version, c.ok) for c in checks] == [(0, 1, True), (1, 1, True)]
  assert [c.expected for c in checks] == [cores[0].state(0).digest, cores[1].state(1).digest]
  for s, core in enumerate(cores):
    for k, v in learner.device.read(s).items():
      np.testing.assert_array_equal(v, core.state(s).values[k])
