"""Tests of ddiloco.syncer.grace: the EMA and the adaptive grace window (docs/algorithm.md §4.2)."""

import pytest

from ddiloco.syncer.grace import Ema, GraceModel


def test_ema_by_hand():
  ema = Ema(0.5)
  assert ema.value is None
  assert ema.count == 0
  assert ema.update(4.0) == 4.0  # the first sample sets the value
  assert ema.update(2.0) == 3.0  # 0.5*4 + 0.5*2
  assert ema.update(0.0) == 1.5  # 0.5*3 + 0.5*0
  assert ema.count == 3
  ema8 = Ema(0.8)
  ema8.update(10.0)
  assert ema8.update(0.0) == pytest.approx(8.0)  # 0.8*10 + 0.2*0


def test_ema_rejects():
  with pytest.raises(ValueError, match="decay"):
    Ema(1.0)
  with pytest.raises(ValueError, match="finite"):
    Ema(0.5).update(float("nan"))


def test_window_paper_example():
  g = GraceModel(gamma=0.8, grace_max_s=10.0, overlap=2, decay=0.9)
  g.observe_step_time(1.0)
  g.observe_quorum_wait(0.2)
  g.observe_sync_time(0.1)
  # 0.8 * (2*1.0 - 0.2 - 0.1) = 0.8 * 1.7 = 1.36.
  assert g.window() == pytest.approx(1.36, abs=1e-12)


def test_window_unknown_emas_count_as_zero():
  g = GraceModel(gamma=0.8, grace_max_s=10.0, overlap=2)
  assert g.window() == 0.0  # no step time known: no slack to spend
  g.observe_step_time(1.5)
  assert g.window() == pytest.approx(0.8 * 2 * 1.5)  # 2.4


def test_window_follows_the_emas():
  g = GraceModel(gamma=0.5, grace_max_s=10.0, overlap=3, decay=0.5)
  g.observe_step_time(1.0)
  g.observe_step_time(2.0)  # ξ_step = 0.5*1 + 0.5*2 = 1.5
  g.observe_sync_time(0.5)
  # 0.5 * (3*1.5 - 0 - 0.5) = 0.5 * 4.0 = 2.0.
  assert g.window() == pytest.approx(2.0)


def test_window_clamps_at_zero_and_max():
  g = GraceModel(gamma=0.8, grace_max_s=3.0, overlap=2)
  g.observe_step_time(1.0)
  g.observe_quorum_wait(5.0)  # 0.8 * (2 - 5) < 0
  assert g.window() == 0.0
  big = GraceModel(gamma=0.8, grace_max_s=3.0, overlap=2)
  big.observe_step_time(100.0)  # 0.8 * 200 = 160 > 3
  assert big.window() == 3.0


def test_grace_model_rejects():
  with pytest.raises(ValueError, match="gamma"):
    GraceModel(gamma=1.5)
  with pytest.raises(ValueError, match="grace_max_s"):
    GraceModel(grace_max_s=-1.0)
  with pytest.raises(ValueError, match="step time"):
    GraceModel().observe_step_time(-0.1)


def test_state_dict_round_trip():
  g = GraceModel(decay=0.7)
  g.observe_step_time(0.3)
  g.observe_step_time(0.7)
  g.observe_sync_time(0.05)
  h = GraceModel(decay=0.7)
  h.load_state_dict(g.state_dict())
  assert {k: v for k, v in h.state_dict().items() if k != "delays"} == {
    k: v for k, v in g.state_dict().items() if k != "delays"
  }
  assert h.quorum.value is None  # never observed stays unknown
  assert h.window() == g.window()


def test_the_spread_counts_from_eight_answers_and_is_capped_by_the_slack():
  g = GraceModel(gamma=0.8, grace_max_s=10.0, overlap=2)
  g.observe_step_time(1.0)
  g.observe_sync_time(0.25)  # slack = 2 - 0 - 0.25 = 1.75; γ · slack = 1.4.
  for _ in range(7):
    g.observe_answer_delay(1.5)
  assert g.spread() == 0.0 and g.window() == pytest.approx(1.4)  # Too few answers yet.
  g.observe_answer_delay(1.5)
  assert g.spread() == pytest.approx(1.5)
  assert g.window() == pytest.approx(1.5)  # Covers them.
  for _ in range(50):
    g.observe_answer_delay(4.0)
  assert g.window() == pytest.approx(1.75)  # Never past the slack.
  off = GraceModel(gamma=0.8, grace_max_s=10.0, overlap=2, spread_cover=False)
  off.load_state_dict(g.state_dict())
  assert off.window() == pytest.approx(1.4)


def test_the_spread_is_the_98th_percentile_of_the_last_256_delays():
  g = GraceModel()
  for k in range(100):
    g.observe_answer_delay(0.01 * k)  # 0.00 .. 0.99
  assert g.spread() == pytest.approx(0.9702)  # numpy's linear interpolation at 0.98.
  for _ in range(256):
    g.observe_answer_delay(0.5)  # The old delays fall out of the window.
  assert g.spread() == pytest.approx(0.5)
  with pytest.raises(ValueError, match="answer delay"):
    g.observe_answer_delay(-1.0)


def test_a_state_without_the_delays_loads_with_none():
  g = GraceModel()
  g.observe_step_time(0.3)
  for _ in range(10):
    g.observe_answer_delay(0.2)
  h = GraceModel()
  h.load_state_dict(g.state_dict())
  assert list(h.delays) == [0.2] * 10 and h.spread() == g.spread()
  old = {k: v for k, v in g.state_dict().items() if k != "delays"}
  h.load_state_dict(old)
  assert len(h.delays) == 0 and h.spread() == 0.0
  assert h.step.value == g.step.value
  with pytest.raises(ValueError, match="delays"):
    h.load_state_dict({**old, "delays": [0.1, float("nan")]})
