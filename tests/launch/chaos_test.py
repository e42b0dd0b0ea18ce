"""Tests for launch/chaos.py's progress line (the driver itself runs in tests/integration)."""

from ddiloco.launch import chaos


def test_status_line_says_what_the_syncer_and_each_learner_do():
  line = chaos.status_line(12.34, syncer="down", num_learners=4, down={1}, done={3})
  assert line == "t=  12.3s syncer down | learners up [0, 2] down [1] done [3]"
  line = chaos.status_line(0.0, syncer="starting", num_learners=2, down=set(), done={})
  assert "syncer starting" in line and "up [0, 1] down [] done []" in line
