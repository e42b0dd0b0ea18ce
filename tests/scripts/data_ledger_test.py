"""The data ledger of a run folder (run_summary.data_segments, scripts/data_ledger.py): learner
summaries written by hand, no run."""

import json
import pathlib

import pytest

from ddiloco.data.token_shards import data_ledger
from ddiloco.launch.run_summary import data_segments


def _learner(workdir: pathlib.Path, i: int, start: int, end: int, *, slots: int, restored="fresh"):
  folder = workdir / f"learner_{i}"
  folder.mkdir()
  slot = i % slots
  data = {
    "start": {"position": start, "slot": slot, "slots": slots},
    "end": {"position": end, "slot": slot, "slots": slots},
  }
  (folder / "summary.json").write_text(json.dumps({"data": data, "restored_from": restored}))


def test_segments_of_a_run_with_a_join_a_leave_and_a_restart(tmp_path):
  # Learner 0 restarted from its own checkpoint at 12: it read its slot from 0 before.
  _learner(tmp_path, 0, 12, 30, slots=3, restored="own:4")
  _learner(tmp_path, 1, 1, 10, slots=3)
  _learner(tmp_path, 2, 2, 20, slots=3)
  (tmp_path / "syncer").mkdir()
  rows = data_segments(str(tmp_path))
  assert rows == [(0, 0, 3, 0, 30), (1, 1, 3, 1, 10), (2, 2, 3, 2, 20)]
  ledger = data_ledger([r[1:] for r in rows])
  assert (ledger.read, ledger.repeated, ledger.unread) == (10 + 3 + 6, 0, {1: 7, 2: 4})


def test_a_learner_without_positions_is_named(tmp_path):
  (tmp_path / "learner_0").mkdir()
  (tmp_path / "learner_0" / "summary.json").write_text(json.dumps({"data": {"start": None}}))
  with pytest.raises(ValueError, match="learner 0 has no data positions"):
    data_segments(str(tmp_path))


def test_segments_of_a_simulated_run_one_a_life(tmp_path):
  # Learner 1 crashed after position 13 and restarted there; learner 2 joined and read to 8.
  def data(slot, start, lives):
    where = {"slot": slot, "slots": 3}
    end = {"position": lives[-1][1], **where}
    return {"data": {"start": {"position": start, **where}, "end": end, "lives": lives}}

  learners = {
    "0": data(0, 0, [[0, 15]]),
    "1": data(1, 1, [[1, 13], [13, 19]]),
    "2": data(2, 2, [[2, 8]]),
  }
  (tmp_path / "summary.json").write_text(json.dumps({"learners": learners}))
  rows = data_segments(str(tmp_path))
  assert rows == [(0, 0, 3, 0, 15), (1, 1, 3, 1, 13), (1, 1, 3, 13, 19), (2, 2, 3, 2, 8)]
  ledger = data_ledger([r[1:] for r in rows])
  # Below 19: slot 0 read 0, 3, .., 12 (5; 15 and 18 unread), slot 1 all of 1, 4, .., 16 (6) and
  # slot 2 read 2 and 5 (8, 11, 14 and 17 unread).
  assert (ledger.read, ledger.repeated, ledger.unread) == (13, 0, {0: 2, 2: 4})


def test_a_simulated_run_without_positions_is_named(tmp_path):
  (tmp_path / "summary.json").write_text(json.dumps({"learners": {"0": {"data": None}}}))
  with pytest.raises(ValueError, match="learner 0 has no data positions"):
    data_segments(str(tmp_path))
  (tmp_path / "summary.json").unlink()
  with pytest.raises(ValueError, match=r"no learner_i folders and no summary\.json"):
    data_segments(str(tmp_path))


def test_a_killed_life_counts_its_repeats_from_the_learners_events(tmp_path):
  """Learner 0's first life read slot 0 to at least 18 (its last logged step) and was killed
  mid-line; restored from its checkpoint at position 9, its second life read 9 to 30 again."""
  _learner(tmp_path, 0, 9, 30, slots=3, restored="own:3")
  where = {"slot": 0, "slots": 3}
  events = [
    {"kind": "restore", "restored_from": "fresh", "data": {"position": 0, **where}},
    *({"kind": "train", "step": s, "data_position": 6 * s} for s in (1, 2, 3)),
    {"kind": "restore", "restored_from": "own:3", "data": {"position": 9, **where}},
    {"kind": "train", "step": 4, "data_position": 15},
  ]
  lines = [json.dumps(e) for e in events]
  lines.insert(4, '{"kind": "train", "ste')  # The killed life's half-written last line.
  (tmp_path / "learner_0" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  rows = data_segments(str(tmp_path))
  assert rows == [(0, 0, 3, 0, 18), (0, 0, 3, 9, 30)]
  ledger = data_ledger([r[1:] for r in rows])
  assert ledger.repeated == 3  # Positions 9, 12 and 15, read by both lives.
