"""Tests for ddiloco.goodput.bandwidth: docs/algorithm.md §7's figures, derived by hand."""

import numpy as np
import pytest

from ddiloco.goodput import bandwidth

# A 5B-parameter model at a 1 s step, between two sites (docs/algorithm.md §7).
_PARAMS = 5e9
_INT4 = bandwidth.Wire(bits_per_value=4, block_size=128, scale_bits=16)


def test_wire_bits_include_the_scales_share():
  assert bandwidth.Wire().bits == 16.0  # bf16, no scales
  assert _INT4.bits == 4.125  # 4 + 16 / 128
  assert bandwidth.Wire(bits_per_value=8, block_size=64, scale_bits=32).bits == 8.5


def test_data_parallel_needs_104_gbps_for_90_percent():
  link = bandwidth.DataParallelLink(params=_PARAMS)
  # Ring between 2 sites: each sends 2 * (1/2) * 5e9 * 16 = 80 Gbit per step.
  assert link.bits_per_step == 80e9
  # Hidden behind the backward pass (2/3 s), plus at most 10 % of the step exposed (the
  # paper's criterion): 80 / (2/3 + 0.1) = 104.35 Gbit/s.
  assert link.required_gbps(0.9) == pytest.approx(80 / (2 / 3 + 0.1))
  assert round(link.required_gbps(0.9)) == 104


def test_data_parallel_exact_utilization():
  link = bandwidth.DataParallelLink(params=_PARAMS)
  # compute / (compute + exposed) = 0.9 leaves 1/9 s exposed: 80 / (2/3 + 1/9) = 102.86.
  assert link.exact_required_gbps(0.9) == pytest.approx(80 / (2 / 3 + 1 / 9))
  assert link.utilization(link.exact_required_gbps(0.9)) == pytest.approx(0.9)
  # The paper's criterion (0.1 s exposed) reaches 1 / 1.1.
  assert link.utilization(link.required_gbps(0.9)) == pytest.approx(1 / 1.1)
  # 80 Gbit/s: the all-reduce takes 1 s, 1/3 s of it exposed: 1 / (4/3).
  assert link.utilization(80.0) == pytest.approx(0.75)
  # Fast enough to hide entirely behind the backward pass: 80 / (2/3) = 120 Gbit/s.
  np.testing.assert_allclose(link.utilization(np.array([120.0, 1e6])), [1.0, 1.0])
  # 1 Gbit/s: 80 s of communication, 79.33 s exposed per 1 s step.
  assert link.utilization(1.0) == pytest.approx(1 / (1 + 80 - 2 / 3))


def test_data_parallel_more_sites_send_more():
  # 8 sites: 2 * 7/8 * 80 = 140 Gbit per step per site.
  link = bandwidth.DataParallelLink(params=_PARAMS, sites=8)
  assert link.bits_per_step == pytest.approx(140e9)


def test_diloco_deadline_figures_match_the_paper():
  bf16 = bandwidth.DiLoCoLink(params=_PARAMS)
  int4 = bandwidth.DiLoCoLink(params=_PARAMS, wire=_INT4)
  # One fragment of 80 Gbit / 24 with tau = 2 s to cross: 80 / 24 / 2 = 1.667 Gbit/s.
  assert bf16.fragment_bits == pytest.approx(80e9 / 24)
  assert bf16.deadline_gbps == pytest.approx(80 / 24 / 2)
  assert round(bf16.deadline_gbps, 1) == 1.7
  # int4 with a bf16 scale per 128 values: 5e9 * 4.125 / 24 / 2 = 0.4297 Gbit/s.
  assert int4.deadline_gbps == pytest.approx(5 * 4.125 / 48)
  assert round(int4.deadline_gbps, 2) == 0.43


def test_diloco_with_one_fragment_per_step_needs_the_sustained_rate():
  # P = H = 24 (docs/algorithm.md §2): a fragment is due every step, so the link must carry 80/24
  # Gbit per second even though each fragment has two steps.
  link = bandwidth.DiLoCoLink(params=_PARAMS, fragments=24, inner_steps=24)
  assert link.sustained_gbps == pytest.approx(80 / 24)
  assert link.required_gbps() == pytest.approx(80 / 24)
  # A fragment every tau = 2 steps (H = 48): the deadline figure is enough.
  every_other = bandwidth.DiLoCoLink(params=_PARAMS, fragments=24, inner_steps=48)
  assert every_other.required_gbps() == pytest.approx(80 / 48)


def test_int4_needs_242_times_less_than_data_parallel():
  dp = bandwidth.DataParallelLink(params=_PARAMS).required_gbps(0.9)
  diloco = bandwidth.DiLoCoLink(params=_PARAMS, inner_steps=48, wire=_INT4).required_gbps()
  # 104.35 / 0.4297 = 242.8 (paper: 242x).
  assert bandwidth.reduction_factor(dp, diloco) == pytest.approx(
    (80 / (2 / 3 + 0.1)) / (5 * 4.125 / 48)
  )
  assert int(bandwidth.reduction_factor(dp, diloco)) == 242


def test_diloco_utilization_is_link_limited_below_the_requirement():
  link = bandwidth.DiLoCoLink(params=_PARAMS, inner_steps=48)
  need = link.required_gbps()
  np.testing.assert_allclose(link.utilization([need / 2, need, 10 * need]), [0.5, 1.0, 1.0])
  np.testing.assert_allclose(link.link_load([need / 2, need, 10 * need]), [2.0, 1.0, 0.1])
  # A Decoupled learner never waits: the link costs it merged answers, not steps.
  np.testing.assert_allclose(link.learner_utilization([need / 2, need]), [1.0, 1.0])


@pytest.mark.parametrize(
  "make",
  [
    lambda: bandwidth.Wire(bits_per_value=0),
    lambda: bandwidth.Wire(block_size=-1),
    lambda: bandwidth.DataParallelLink(params=0),
    lambda: bandwidth.DataParallelLink(params=1e9, sites=1),
    lambda: bandwidth.DataParallelLink(params=1e9, overlap_fraction=1.5),
    lambda: bandwidth.DiLoCoLink(params=1e9, fragments=24, inner_steps=12),
    lambda: bandwidth.DiLoCoLink(params=1e9, overlap_steps=0),
  ],
)
def test_invalid_configs_raise(make):
  with pytest.raises(ValueError):
    make()


@pytest.mark.parametrize("utilization", [0.0, 1.5, float("nan")])
def test_invalid_utilization_raises(utilization):
  with pytest.raises(ValueError, match="utilization"):
    bandwidth.DataParallelLink(params=1e9).required_gbps(utilization)
