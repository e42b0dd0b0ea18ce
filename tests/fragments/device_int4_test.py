"""The int4 encoding of δ on the devices (`device_int4`) against the numpy codec, bit for bit."""

import jax
import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments import device_int4
from ddiloco.testing.codecs import int4_delta_bytes

_TINY = np.finfo(np.float32).tiny


def _device(anchors, thetas, bs=64):
  enc = device_int4.encode_delta(anchors, [jax.device_put(t) for t in thetas], block_size=bs)
  return enc.to_host()


def _check_same(anchor, theta, bs=64):
  exact, [(payload, scales)] = _device([anchor], [theta], bs)
  assert exact
  want_payload, want_scales = int4_delta_bytes(anchor, theta, bs)
  assert payload.tobytes() == want_payload
  assert scales.tobytes() == want_scales


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 1000, 65536 + 129])
@pytest.mark.parametrize("bs", [64, 7])
def test_random_deltas_match_the_numpy_codec(n, bs):
  rng = np.random.default_rng(n * 31 + bs)
  theta = rng.standard_normal(n).astype(np.float32)
  anchor = theta + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
  _check_same(anchor, theta, bs)


def test_a_million_values_with_their_rare_ties():
  """Ties of δ / s (2^-20 or so of random values) round to even only with a true division: XLA's
  product with a reciprocal rounded 3 of these 2^20 codes the other way."""
  rng = np.random.default_rng(5)
  theta = rng.standard_normal(1 << 20).astype(np.float32)
  anchor = theta + rng.standard_normal(theta.size).astype(np.float32) * np.float32(1e-3)
  _check_same(anchor, theta)


def test_shapes_scales_spanning_many_magnitudes_and_ties():
  rng = np.random.default_rng(0)
  theta = rng.standard_normal((37, 19)).astype(np.float32)
  # Per-value magnitudes over 60 binades, and exact ties (x / s = k + 0.5) that round to even.
  mags = np.float32(2.0) ** rng.integers(-60, 10, theta.shape).astype(np.float32)
  anchor = (theta + rng.standard_normal(theta.shape).astype(np.float32) * mags).astype(np.float32)
  _check_same(anchor, theta)
  ties = np.tile(np.array([7, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 6.5], np.float32), 16)
  _check_same(ties, np.zeros_like(ties))


def test_zero_blocks_equal_values_and_negative_zero():
  theta = np.linspace(-1, 1, 300, dtype=np.float32)
  _check_same(theta.copy(), theta)  # δ = 0 everywhere: scale 0, codes 8.
  anchor = theta.copy()
  anchor[:64] = -0.0
  theta2 = theta.copy()
  theta2[:64] = 0.0
  _check_same(anchor, theta2)  # -0 − 0 = -0.


def test_several_tensors_and_bf16_parameters_in_one_program():
  rng = np.random.default_rng(1)
  thetas = [rng.standard_normal(s).astype(np.float32) for s in [(5, 3), (129,), (2, 2, 2)]]
  thetas.append(rng.standard_normal(33).astype(ml_dtypes.bfloat16))
  anchors = [(t.astype(np.float32) + np.float32(0.01)).astype(t.dtype) for t in thetas]
  exact, pairs = _device(anchors, thetas)
  assert exact
  for (payload, scales), a, t in zip(pairs, anchors, thetas):
    want_payload, want_scales = int4_delta_bytes(a, t, 64)
    assert payload.tobytes() == want_payload
    assert scales.tobytes() == want_scales


@pytest.mark.parametrize(
  "anchor, theta",
  [
    ([np.nan, 1.0], [0.0, 0.0]),  # NaN: the numpy codec refuses it.
    ([np.inf, 1.0], [0.0, 0.0]),
    ([3e38, 1.0], [-3e38, 0.0]),  # δ overflows to Inf.
    ([_TINY / 4, 1.0], [0.0, 0.0]),  # A subnormal input.
    ([1.5 * _TINY, 1.0], [1.25 * _TINY, 1.0]),  # A subnormal δ of normal inputs.
    ([3 * _TINY, 2 * _TINY], [0.0, 0.0]),  # A subnormal scale (absmax / 7).
  ],
)
def test_cases_numpy_must_encode_are_flagged_not_guessed(anchor, theta):
  anchor, theta = np.array(anchor, np.float32), np.array(theta, np.float32)
  exact, _ = _device([anchor], [theta])
  assert not exact


def test_normal_values_near_the_subnormal_edge_are_exact():
  theta = np.zeros(128, np.float32)
  anchor = np.full(128, 16 * _TINY, np.float32) * np.arange(1, 129, dtype=np.float32)
  _check_same(anchor, theta)


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="anchors for"):
    device_int4.encode_delta([np.zeros(2, np.float32)], [])
  with pytest.raises(ValueError, match="shape"):
    device_int4.encode_delta([np.zeros(2, np.float32)], [jax.numpy.zeros(3)])
  with pytest.raises(ValueError, match="block_size"):
    device_int4.encode_delta([np.zeros(2, np.float32)], [jax.numpy.zeros(2)], block_size=0)
