"""Tests of ddiloco.checkpoint.syncer: orbax checkpoints, the merge journal and the restore rule."""

import logging
import os
import shutil

import numpy as np
import optax
import pytest

from ddiloco.checkpoint import syncer as ckpt_lib
from ddiloco.checkpoint.version_log import VersionLog
from ddiloco.syncer.core import Report, RoundRequest, SyncerConfig, SyncerCore

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
  # A non-trivial optimizer state to round-trip.
  cfg.setdefault("outer_optimizer", lambda: optax.sgd(0.7, momentum=0.9, nesterov=True))
  core = SyncerCore(
    fragment_keys=KEYS, init_values=_init(), config=SyncerConfig(**cfg), clock=FakeClock()
  )
  for i in (0, 1):
    core.register(i)
    core.fetch(i, 0)
    core.fetch(i, 1)
  return core


def _answer(
  core: SyncerCore, learner: int, request: RoundRequest, values=None, *, tokens=64, delta=False
):
  """`learner`'s answer to `request`, anchored at its base (`values` are δ if `delta`)."""
  p = request.fragment
  if values is None:
    values = dict(core.values_at(p, request.base_version))
  return core.report(
    Report(
      learner_id=learner,
      fragment=p,
      values=values,
      tokens=tokens,
      steps=4,
      anchor_version=request.base_version,
      step=request.round_step + 1,
      round_step=request.round_step,
      outer_gradient=delta,
    )
  )


def _merge_once(core: SyncerCore, p: int, shift: float, learner: int = 0):
  """Opens round (p, 10·(version + 1)); one answer from `learner` at its base; K=1 merges it."""
  values = {k: v + np.float32(shift) for k, v in core.state(p).values.items()}
  version = core.version(p)
  request = core.open_round(p, 10 * (version + 1))
  assert request == RoundRequest(p, 10 * (version + 1), version)
  result = core.report(
    Report(
      learner_id=learner,
      fragment=p,
      values=values,
      tokens=64,
      steps=4,
      anchor_version=version,
      step=10 * (version + 1),
      round_step=request.round_step,
    )
  )
  assert result.status == "accepted"
  (event,) = [e for e in core.closer.poll() if e.fragment == p]  # Other due rounds merge too.
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
  request = core.open_round(0, 40)
  assert request == RoundRequest(0, 40, 3)
  assert _answer(core, 1, request, tokens=8).status == "accepted"
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
  assert fresh.rounds.open_requests() == [request]
  assert fresh.state(0).digest == core.state(0).digest
  # The restored core continues exactly like the original.
  ev_a, ev_b = _merge_once(core, 1, 0.5), _merge_once(fresh, 1, 0.5)
  assert (ev_a.version, ev_a.digest) == (ev_b.version, ev_b.digest)


def _published(core: SyncerCore, events) -> dict[tuple[int, int], str]:
  """{(fragment, version): digest} a learner may hold: version 0 and every journaled merge."""
  out = {(p, 0): _core().state(p).digest for p in range(core.num_fragments)}
  out.update({(e.fragment, e.version): e.digest for e in events})
  return out


def _assert_never_behind(core: SyncerCore, published: dict[tuple[int, int], str]) -> None:
  """No fragment went back, and a version learners may hold was not reissued with other values."""
  for p in range(core.num_fragments):
    newest = max(v for q, v in published if q == p)
    assert core.version(p) >= newest, (p, core.version(p), newest)
    if (p, core.version(p)) in published:
      assert core.state(p).digest == published[(p, core.version(p))], p


def test_restore_without_checkpoint_or_journal_is_a_fresh_start(tmp_path):
  core = _core()
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  assert ckpt_lib.restore_core(core, ck, str(tmp_path / ckpt_lib.JOURNAL_NAME)) is None
  ck.close()
  assert [core.version(p) for p in (0, 1)] == [0, 0]


def test_restore_without_checkpoint_moves_versions_past_the_journal(tmp_path):
  """Killed before its first checkpoint: the learners hold journaled versions the syncer lost."""
  core = _core()
  journal = ckpt_lib.MergeJournal(str(tmp_path / ckpt_lib.JOURNAL_NAME))
  events = [_merge_once(core, 0, 0.125 * (i + 1)) for i in range(3)] + [_merge_once(core, 1, 0.5)]
  for e in events:
    journal.append(e)
  journal.close()
  published = _published(core, events)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))

  restarted = _core()
  info = ckpt_lib.restore_core(restarted, ck, journal.path)
  # From the initial values, published past the journal: 3 -> 4 and 1 -> 2 (4 merges lost).
  assert (info.step, info.versions, info.lost_merges) == (-1, (4, 2), 4)
  assert info.republished == {0: (0, 3, 4), 1: (0, 1, 2)}
  assert restarted.alive() == frozenset()
  _assert_never_behind(restarted, published)
  assert restarted.state(0).digest == published[(0, 0)]
  # The republished versions are journaled before they are served, with their digests.
  records = ckpt_lib.read_journal_records(journal.path)
  assert records[0][4] == published[(0, 0)] and records[1][2] == published[(1, 0)]
  served = {(p, v): records[p][v] for p in records for v in records[p]}

  # It merges once more and is killed again, still before a checkpoint: nothing goes back, and the
  # values of version 4 of fragment 0, unchanged, keep their version.
  again = ckpt_lib.MergeJournal(journal.path)
  restarted.register(0)
  restarted.fetch(0, 1)
  event = _merge_once(restarted, 1, 0.25)
  again.append(event)
  again.close()
  served[(1, event.version)] = event.digest
  third = _core()
  info = ckpt_lib.restore_core(third, ck, journal.path)
  ck.close()
  assert info.versions == (4, 4) and info.republished == {0: (0, 4, 4), 1: (0, 3, 4)}
  _assert_never_behind(third, {**published, **served})


def test_a_journal_of_another_shard_is_refused_naming_the_mismatch(tmp_path):
  """A workdir older than its shard record: the journal of the shard owning fragment 1, restored
  by the shard owning fragment 0, is refused before anything is restored."""
  journal = ckpt_lib.MergeJournal(str(tmp_path / ckpt_lib.JOURNAL_NAME))
  journal.record(1, 1, "0" * 32)
  journal.close()
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  shard0 = SyncerCore(
    fragment_keys=KEYS,
    init_values=_init(),
    config=SyncerConfig(use_grace=False),
    clock=FakeClock(),
    owned=[0],
  )
  with pytest.raises(ckpt_lib.WorkdirMismatch, match="names fragment 1, which this syncer shard"):
    ckpt_lib.restore_core(shard0, ck, journal.path)
  ck.close()
  assert shard0.version(0) == 0


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
  # Rounds go on past the checkpoint's newest round of fragment 0 (20), against version 6.
  assert restarted.rounds.open_requests() == []
  with pytest.raises(ValueError, match=r"not after its newest round \(20\)"):
    restarted.open_round(0, 20)
  request = restarted.open_round(0, 30)
  assert request == RoundRequest(0, 30, 6)
  # A re-registered learner's reports weigh 0 until it has the restored version.
  restarted.register(0)
  result = _answer(restarted, 0, request)
  assert (result.status, result.weight) == ("accepted", 0.0)
  restarted.fetch(0, 0)
  assert _answer(restarted, 0, request).weight == 64**2 / 4


def test_journal_ignores_a_torn_last_line(tmp_path):
  path = tmp_path / "j.jsonl"
  path.write_text(
    '{"fragment": 0, "version": 1, "digest": "d1"}\n'
    '{"fragment": 1, "version": 4, "digest": "d4"}\n'
    '{"fragment": 0, "version": 2, "dig'
  )
  assert ckpt_lib.read_journal(str(path)) == {0: 1, 1: 4}
  assert ckpt_lib.read_journal(str(tmp_path / "missing")) == {}


def test_an_unfinished_save_leaves_the_previous_checkpoint_and_is_removed(tmp_path, caplog):
  core = _core()
  _merge_once(core, 0, 0.125)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  ck.save(1, core.state_dict())
  ck.close()
  # What a kill during the next save leaves behind: orbax's temporary folder, never renamed.
  tmp = tmp_path / "ck" / "2.orbax-checkpoint-tmp-1234567"
  (tmp / "arrays").mkdir(parents=True)
  (tmp / "arrays" / "garbage").write_bytes(b"\x00" * 10)
  with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
    ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  assert not tmp.exists()
  assert ck.removed_partial == [str(tmp)]
  assert f"removed {tmp}: a syncer checkpoint save that never completed" in caplog.text
  assert ck.latest_step() == 1
  step, state = ck.restore()
  assert step == 1 and state["fragment/0/version"] == 1
  # Step 2 can be written now.
  _merge_once(core, 0, 0.25)
  ck.save(2, core.state_dict())
  ck.close()
  assert sorted(os.listdir(tmp_path / "ck")) == ["1", "2"]


def _two_checkpoints(tmp_path):
  """Steps 1 (fragment 0 at version 1) and 2 (at version 2), all merges journaled; 3 is not saved."""
  core = _core()
  journal = ckpt_lib.MergeJournal(str(tmp_path / ckpt_lib.JOURNAL_NAME))
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  events = []
  for step, shift in ((1, 0.125), (2, 0.25), (3, 0.375)):
    events.append(_merge_once(core, 0, shift))
    journal.append(events[-1])
    if step < 3:
      ck.save(step, core.state_dict())
      ck.wait()
  ck.close()
  journal.close()
  return core, journal.path, _published(core, events)


def _garble_meta(step_dir):
  path = step_dir / "meta" / "metadata"
  path.write_bytes(path.read_bytes()[:40])  # Cut mid-JSON.


def _garble_arrays(step_dir):
  for f in (step_dir / "arrays").rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(b"\x5a" * f.stat().st_size)


def _drop_array_index(step_dir):
  (step_dir / "arrays" / "_METADATA").unlink()


@pytest.mark.parametrize("damage", [_garble_meta, _garble_arrays, _drop_array_index])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, caplog, damage):
  _, journal_path, published = _two_checkpoints(tmp_path)
  damage(tmp_path / "ck" / "2")
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  restarted = _core()
  with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
    info = ckpt_lib.restore_core(restarted, ck, journal_path)
  assert "syncer checkpoint 2 is unusable: unreadable" in caplog.text
  assert "syncer restored from the older checkpoint 1" in caplog.text
  # Step 1 holds version 1; the journal's 3 is newer: published again as 4.
  assert (info.step, info.unusable_steps, info.republished) == (1, (2,), {0: (1, 3, 4)})
  _assert_never_behind(restarted, published)
  assert restarted.state(0).digest == published[(0, 1)]
  # The damaged step is set aside: step 2 can be written again and is what the next start reads.
  assert ck.all_steps() == [1]
  assert os.listdir(tmp_path / "ck" / ckpt_lib.UNUSABLE_DIR)[0].startswith("2-")
  ck.save(2, restarted.state_dict())
  ck.close()
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  assert ckpt_lib.restore_core(_core(), ck, journal_path).step == 2
  ck.close()


@pytest.mark.parametrize("where", ["newest_version", "initial_values"])
def test_a_tampered_checkpoint_is_caught_by_the_journal_digests(tmp_path, caplog, where):
  """Step 2 is rewritten with one value changed and a consistent structure (its own arrays digest
  matches): only the journal's digests can tell, and the restore falls back to step 1."""
  _, journal_path, published = _two_checkpoints(tmp_path)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  _, state = ck.restore(2)
  key = "fragment/0/v2/a" if where == "newest_version" else "fragment/1/v0/c"
  state[key] = state[key].copy()
  state[key].flat[1] += np.float32(1.0)
  ck.close()
  shutil.rmtree(tmp_path / "ck" / "2")
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  ck.save(2, state)
  ck.wait()
  restarted = _core()
  with caplog.at_level(logging.WARNING, logger=ckpt_lib.__name__):
    info = ckpt_lib.restore_core(restarted, ck, journal_path)
  ck.close()
  version = 2 if where == "newest_version" else 0
  fragment = 0 if where == "newest_version" else 1
  assert f"syncer checkpoint 2 is unusable: fragment {fragment} version {version} has digest" in (
    caplog.text
  )
  assert (info.step, info.unusable_steps) == (1, (2,))
  _assert_never_behind(restarted, published)
  assert [restarted.state(p).digest for p in (0, 1)] == [published[(0, 1)], published[(1, 0)]]


def test_no_intact_checkpoint_with_served_versions_is_a_clear_error(tmp_path):
  _, journal_path, _ = _two_checkpoints(tmp_path)
  for step in ("1", "2"):
    _garble_meta(tmp_path / "ck" / step)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  restarted = _core()
  with pytest.raises(
    ckpt_lib.RestoreError, match=r"No intact syncer checkpoint .*\(steps 2, 1 unusable"
  ) as e:
    ckpt_lib.restore_core(restarted, ck, journal_path)
  assert "\n" not in str(e.value)
  assert ck.all_steps() == [1, 2]  # Nothing set aside: the operator decides.
  assert restarted.version(0) == 0  # Untouched.
  ck.close()
  # With an empty journal nothing was ever served: a fresh start, the damaged steps set aside.
  os.remove(journal_path)
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  assert ckpt_lib.restore_core(restarted, ck, journal_path) is None
  assert ck.all_steps() == []
  ck.close()


def test_republish_validates_and_trims_history():
  core = _core(keep_versions=2)
  _merge_once(core, 0, 0.125)
  with pytest.raises(ValueError, match="needs a version > 1"):
    core.republish(0, 1)
  core.republish(0, 9)
  assert core.version(0) == 9
  assert core.kept(0, 9) and core.kept(0, 1) and not core.kept(0, 0)


def _with_open_rounds() -> tuple[SyncerCore, list[RoundRequest]]:
  """Fragment 0 merged once (round 10); round (0, 20) open with an answer (an outer gradient, as
  learners send them), (1, 30) open with none."""
  core = _core()
  _merge_once(core, 0, 0.125)
  requests = [core.open_round(0, 20), core.open_round(1, 30)]
  assert requests == [RoundRequest(0, 20, 1), RoundRequest(1, 30, 0)]
  core.fetch(1, 0)
  delta = {k: np.full_like(v, -0.25) for k, v in core.state(0).values.items()}  # θ = Θ + 0.25.
  assert _answer(core, 1, requests[0], values=delta, delta=True).status == "accepted"
  return core, requests


def test_open_rounds_survive_a_state_dict_round_trip():
  core, requests = _with_open_rounds()
  state = core.state_dict()
  assert (state["fragment/0/round/step"], state["fragment/0/round/base_version"]) == (20, 1)
  assert (state["fragment/1/round/step"], state["fragment/1/round/base_version"]) == (30, 0)
  assert (state["fragment/0/round/last_step"], state["fragment/1/round/last_step"]) == (20, 30)
  assert state["fragment/0/round/1/round_step"] == 20
  assert state["fragment/0/round/1/outer_gradient"] == 1
  fresh = _core()
  fresh.load_state_dict(state)
  _equal_states(fresh.state_dict(), state)
  assert fresh.rounds.open_requests() == core.rounds.open_requests() == requests
  # Both continue alike: learner 0 answers both rounds, they merge to the same bits.
  for c in (core, fresh):
    for r in requests:
      values = {k: v - np.float32(0.125) for k, v in c.state(r.fragment).values.items()}
      assert _answer(c, 0, r, values=values).status == "accepted"
  events, restored_events = core.closer.poll(), fresh.closer.poll()
  assert [(e.fragment, e.version, e.contributors) for e in events] == [
    (0, 2, (0, 1)),
    (1, 1, (0,)),
  ]
  assert [(e.version, e.digest) for e in events] == [(e.version, e.digest) for e in restored_events]
  # Each fragment's newest round step survives too: round 10 of p0 is closed, 20 cannot reopen.
  late = _answer(fresh, 0, RoundRequest(0, 10, 0))
  assert (late.status, late.reason) == ("late", "round (0, 10) is closed")
  with pytest.raises(ValueError, match=r"not after its newest round \(20\)"):
    fresh.open_round(0, 20)


def test_a_checkpoint_without_round_ids_loads_and_drops_its_open_rounds():
  """Checkpoints from before syncer-paced rounds: their open rounds cannot be answered."""
  core, requests = _with_open_rounds()
  answer = Report(
    learner_id=0,
    fragment=1,
    values={k: v + np.float32(0.5) for k, v in core.state(1).values.items()},
    tokens=64,
    steps=4,
    anchor_version=0,
    step=31,
    new_tokens=64,
    round_step=requests[1].round_step,
  )
  assert core.report(answer).status == "accepted"
  state = core.state_dict()
  new_keys = [
    k
    for k in state
    if k.endswith(("/round/step", "/round/base_version", "/round/last_step", "/round_step"))
    or k in ("stats/rounds_opened", "stats/overrun_rounds")
  ]
  assert len(new_keys) == 2 * 3 + 2 + 2  # Per fragment 3, one per filed answer, 2 counters.
  old = {k: v for k, v in state.items() if k not in new_keys}
  fresh = _core()
  fresh.load_state_dict(old)
  assert fresh.rounds.open_requests() == []
  stats = fresh.stats()
  assert (stats["open_rounds"], stats["rounds_opened"], stats["overrun_rounds"]) == (0, 0, 0)
  assert (stats["versions"], stats["merges"]) == ([1, 0], 1)
  assert [fresh.state(p).digest for p in (0, 1)] == [core.state(p).digest for p in (0, 1)]
  assert fresh.closer.poll() == [] and fresh.closer.next_deadline() is None
  # Rounds start afresh: any step opens one, against the restored version.
  assert fresh.open_round(0, 1) == RoundRequest(0, 1, 1)
  # The dropped rounds' answers (learner 0's carries 64 ledger tokens) are booked as dropped: the
  # ledger balances.
  ledger, before = fresh.ledger(), core.ledger()
  assert ledger["received"] == ledger["merged"] + ledger["dropped"] + ledger["pending"]
  assert ledger["pending"] == 0 and before["pending"] == 64
  assert ledger["dropped"] == before["dropped"] + 64
  assert ledger["learners"][0]["dropped"] == before["learners"][0]["dropped"] + 64


def test_republish_moves_an_open_round_to_the_republished_version():
  """A restore that republishes p keeps its open round answerable: learners fetch the republished
  version and answer against it, and the round merges (it would otherwise never reach K)."""
  core, requests = _with_open_rounds()
  core.republish(1, 5)
  assert core.rounds.open_requests() == [requests[0], RoundRequest(1, 30, 5)]
  for i in (0, 1):
    core.fetch(i, 1)
  values = {k: v - np.float32(0.125) for k, v in core.state(1).values.items()}
  result = _answer(core, 0, RoundRequest(1, 30, 5), values=values)
  assert (result.status, result.weight > 0) == ("accepted", True)
  (event,) = [e for e in core.closer.poll() if e.fragment == 1]
  assert (event.version, event.contributors) == (6, (0,))


def test_config_validation():
  with pytest.raises(ValueError, match="every_s"):
    ckpt_lib.SyncerCheckpointConfig(every_s=0)
  with pytest.raises(ValueError, match="max_to_keep"):
    ckpt_lib.SyncerCheckpointConfig(max_to_keep=0)
  with pytest.raises(ValueError, match="relative"):
    ckpt_lib.SyncerCheckpointConfig(subdir=os.path.join("..", "x"))


# -- the version log (checkpoint/version_log.py) -------------------------------------------


def _killed_after_checkpoint(tmp_path, *, logged: bool):
  """Fragment 0 merges twice, a checkpoint is saved, fragment 0 merges three more times (each
  version logged if `logged`, then journaled), and the process dies. Returns the journal path,
  the checkpointer and fragment 0's newest state."""
  core = _core()
  journal = ckpt_lib.MergeJournal(str(tmp_path / ckpt_lib.JOURNAL_NAME))
  log = VersionLog(str(tmp_path / ckpt_lib.VERSION_LOG_DIR))

  def publish(event):
    if logged:
      state = core.state(event.fragment)
      log.write(event.fragment, event.version, state.values, state.digest)
    journal.append(event)

  for shift in (0.125, 0.25):
    publish(_merge_once(core, 0, shift))
  publish(_merge_once(core, 1, 0.5))
  ck = ckpt_lib.SyncerCheckpointer(str(tmp_path / "ck"))
  ck.save(3, core.state_dict())
  ck.wait()
  for shift in (0.375, 0.5, 0.625):
    publish(_merge_once(core, 0, shift))
  journal.close()
  return journal.path, ck, core.state(0)


def test_restore_takes_the_newest_version_back_from_the_log(tmp_path):
  path, ck, newest = _killed_after_checkpoint(tmp_path, logged=True)
  restarted = _core()
  log = VersionLog(str(tmp_path / ckpt_lib.VERSION_LOG_DIR))
  info = ckpt_lib.restore_core(restarted, ck, path, defer=True, version_log=log)
  ck.close()
  assert info.step == 3
  assert info.from_log == {0: (2, 5, 3)}  # Checkpoint version 2, journal 5, 3 merges since.
  assert info.lost_merges == 0 and info.republished == {} and info.to_recover == {}
  assert info.versions == (5, 1)
  state = restarted.state(0)
  assert (state.version, state.digest) == (5, newest.digest)
  for k, v in newest.values.items():
    np.testing.assert_array_equal(state.values[k], v)
  # Versions go on from there: the next merge of fragment 0 publishes 6.
  restarted.register(0)
  restarted.fetch(0, 0)
  assert _merge_once(restarted, 0, 0.75).version == 6


@pytest.mark.parametrize("defer", [True, False])
def test_without_a_usable_log_the_restore_falls_back(tmp_path, defer):
  path, ck, newest = _killed_after_checkpoint(tmp_path, logged=True)
  (tmp_path / ckpt_lib.VERSION_LOG_DIR / "0-5.npz").write_bytes(b"torn")  # Damaged newest.
  restarted = _core()
  log = VersionLog(str(tmp_path / ckpt_lib.VERSION_LOG_DIR))
  info = ckpt_lib.restore_core(restarted, ck, path, defer=defer, version_log=log)
  ck.close()
  assert info.from_log == {} and info.lost_merges == 3
  if defer:  # The learners are asked for version 5 first.
    assert info.to_recover == {0: (5, newest.digest, 2, 3)}
    assert restarted.version(0) == 2
  else:  # Republished past the journal from the checkpoint's values, and that version logged.
    assert info.republished == {0: (2, 5, 6)}
    assert log.versions(0)[-1] == 6
    assert log.read(0, 6, restarted.state(0).digest) is not None


def test_an_unlogged_run_restores_as_before(tmp_path):
  path, ck, _ = _killed_after_checkpoint(tmp_path, logged=False)
  restarted = _core()
  log = VersionLog(str(tmp_path / ckpt_lib.VERSION_LOG_DIR))
  info = ckpt_lib.restore_core(restarted, ck, path, version_log=log)
  ck.close()
  assert info.from_log == {} and info.republished == {0: (2, 5, 6)} and info.lost_merges == 3
