"""Tests of ddiloco.checkpoint.syncer: orbax checkpoints, the merge journal and the restore rule."""

import json
import os

import numpy as np
import pytest

from ddiloco.checkpoint import syncer as ckpt_lib
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore

KEYS = (("a", "b"), ("c",))


class FakeClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


def _init():
  return {
    "a": np.full((2, 3), 1.5, np.float32),
    "b": np.array([1.0, 1.25, 1.5, 1.75], np.float32),
    "c": np.array([1.0, 1.0], np.float32),
  }


def _core(**cfg) -> SyncerCore:
  cfg.setdefault("use_grace", False)
  cfg.setdefault("outer_momentum", 0.9)  # A non-trivial optimizer state to round-trip.
  core = SyncerCore(
    fragment_keys=KEYS, init_values=_init(), config=SyncerConfig(**cfg), clock=FakeClock()
  )
  for i in (0, 1):
    core.register(i)
    core.fetch(i, 0)
    core.fetch(i, 1)
  return core


def _merge_once(core: SyncerCore, p: int, shift: float, learner: int = 0):
  """One report of fragment p from `learner`, anchored at the current version; K=1 merges it."""
  values = {k: v + np.float32(shift) for k, v in core.state(p).values.items()}
  version = core.version(p)
  result = core.report(
    Report(
      learner_id=learner,
      fragment=p,
      values=values,
      tokens=64,
      steps=4,
      anchor_version=version,
      step=10 * (version + 1),
    )
  )
  assert result.status == "accepted"
  (event,) = [e for e in core.poll() if e.fragment == p]  # Other due rounds merge too.
  core.mark_delivered(learner, p, event.version)
  return event


def _equal_states(a, b):
  assert sorted(a) == sorted(b)
  for k in a:
    if isinstance(a[k], np.ndarray):
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
      assert a[k].dtype == b[k].dtype, k
    elif isinstance(a[k], float) and np.isnan(a[k]):
      assert np.isnan(b[k]), k
    else:
      assert a[k] == b[k], k


def test_checkpoint_round_trip_is_exact(tmp_path):
  core = _core()
  for i in range(3):
    _merge_once(core, 0, 0.125 * (i + 1))
  _merge_once(core, 1, -0.25)
  # An open round with a report in it is part of the state too.
  assert core.config.min_quorum == 1  # It would merge at the next poll; there is none.
  core.report(
    Report(
      learner_id=1,
      fragment=0,
      values=dict(core.state(0).values),
      tokens=8,
      steps=2,
      anchor_version=3,
      step=40,
    )
  )
  state = core.state_dict()
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  ck.save(4, state)
  ck.close()
  step, restored = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck")).restore()
  assert step == 4
  _equal_states(state, restored)
  fresh = _core()
  fresh.load_state_dict(restored)
  assert [fresh.version(p) for p in (0, 1)] == [3, 1]
  assert fresh.state(0).digest == core.state(0).digest
  # The restored core continues exactly like the original.
  ev_a, ev_b = _merge_once(core, 1, 0.5), _merge_once(fresh, 1, 0.5)
  assert (ev_a.version, ev_a.digest) == (ev_b.version, ev_b.digest)


def test_restore_without_checkpoint_is_a_fresh_start(tmp_path):
  core = _core()
  journal = tmp_path / ckpt_lib.JOURNAL_NAME
  journal.write_text(json.dumps({"fragment": 0, "version": 5, "digest": "x"}) + "\n")
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  assert ckpt_lib.restore_core(core, ck, str(journal)) is None
  assert core.version(0) == 0  # The journal alone changes nothing.
  ck.close()


def test_restore_moves_versions_past_the_journal(tmp_path):
  core = _core()
  journal = ckpt_lib.MergeJournal(str(tmp_path / ckpt_lib.JOURNAL_NAME))
  for shift in (0.125, 0.25):
    journal.append(_merge_once(core, 0, shift))
  journal.append(_merge_once(core, 1, 0.5))
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  ck.save(3, core.state_dict())
  ck.wait()
  saved = {p: core.state(p) for p in (0, 1)}
  # Three more merges of fragment 0 after the checkpoint, then the process is killed.
  for shift in (0.375, 0.5, 0.625):
    journal.append(_merge_once(core, 0, shift))
  journal.close()
  assert core.version(0) == 5

  restarted = _core()
  restarted.register(7)  # Learners the fresh core knew are all marked not alive by the restore.
  info = ckpt_lib.restore_core(restarted, ck, journal.path)
  ck.close()
  assert info.step == 3
  # Fragment 0: checkpoint version 2, journal 5 -> republished as 6 (3 merges lost). Fragment 1:
  # checkpoint 1 == journal 1, untouched.
  assert info.republished == {0: (2, 5, 6)}
  assert info.lost_merges == 3
  assert info.versions == (6, 1)
  assert restarted.alive() == frozenset()
  # Version 6 holds the checkpoint's values: same digest as version 2.
  assert restarted.state(0).digest == saved[0].digest
  assert restarted.state(1).digest == saved[1].digest
  # Kept anchors still decode; lost versions 3..5 are not kept.
  assert restarted.kept(0, 2) and restarted.kept(0, 6)
  assert not any(restarted.kept(0, v) for v in (3, 4, 5))
  # A re-registered learner's reports weigh 0 until it has the restored version.
  restarted.register(0)
  result = restarted.report(
    Report(
      learner_id=0,
      fragment=0,
      values=dict(restarted.state(0).values),
      tokens=64,
      steps=4,
      anchor_version=6,
      step=80,
    )
  )
  assert (result.status, result.weight) == ("accepted", 0.0)


def test_journal_ignores_a_torn_last_line(tmp_path):
  path = tmp_path / "j.jsonl"
  path.write_text(
    '{"fragment": 0, "version": 1, "digest": "d1"}\n'
    '{"fragment": 1, "version": 4, "digest": "d4"}\n'
    '{"fragment": 0, "version": 2, "dig'
  )
  assert ckpt_lib.read_journal(str(path)) == {0: 1, 1: 4}
  assert ckpt_lib.read_journal(str(tmp_path / "missing")) == {}


def test_an_unfinished_save_leaves_the_previous_checkpoint(tmp_path):
  core = _core()
  _merge_once(core, 0, 0.125)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  ck.save(1, core.state_dict())
  ck.close()
  # What a kill during the next save leaves behind: orbax's temporary folder, never renamed.
  tmp = tmp_path / "ck" / "2.orbax-checkpoint-tmp-1234567"
  (tmp / "arrays").mkdir(parents=True)
  (tmp / "arrays" / "garbage").write_bytes(b"\x00" * 10)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  assert ck.latest_step() == 1
  step, state = ck.restore()
  assert step == 1 and state["fragment/0/version"] == 1
  ck.close()


def test_republish_validates_and_trims_history():
  core = _core(keep_versions=2, max_staleness=1)
  _merge_once(core, 0, 0.125)
  with pytest.raises(ValueError, match="needs a version > 1"):
    core.republish(0, 1)
  core.republish(0, 9)
  assert core.version(0) == 9
  assert core.kept(0, 9) and core.kept(0, 1) and not core.kept(0, 0)


def test_config_validation():
  with pytest.raises(ValueError, match="every_s"):
    ckpt_lib.SyncerCheckpointConfig(every_s=0)
  with pytest.raises(ValueError, match="max_to_keep"):
    ckpt_lib.SyncerCheckpointConfig(max_to_keep=0)
  with pytest.raises(ValueError, match="relative"):
    ckpt_lib.SyncerCheckpointConfig(subdir=os.path.join("..", "x"))
