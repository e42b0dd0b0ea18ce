"""δ encoded on the devices (`device_codec`), in every wire codec: a valid encoding within the
codec's error bound, the host codec's bytes on XLA's CPU backend for normal values, and the cases
the host must encode (and refuse) flagged, not guessed."""

import jax
import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments import device_codec
from ddiloco.testing.codecs import delta_bytes, delta_excess

_TINY = np.finfo(np.float32).tiny
CODECS = device_codec.CODECS


def _device(anchors, thetas, codec="int4", bs=64):
  enc = device_codec.encode_delta(
    anchors, [jax.device_put(t) for t in thetas], codec=codec, block_size=bs
  )
  return enc.to_host()


def _check_within_bound(codec, anchor, theta, payload, scales, *, bs):
  """The receiver's decode of the device bytes is δ within the codec's error bound."""
  excess = delta_excess(codec, anchor, theta, payload, scales, block_size=bs)
  assert excess <= 0, (codec, excess)


def _check_same(anchor, theta, codec="int4", bs=64):
  valid, [(payload, scales)] = _device([anchor], [theta], codec, bs)
  assert valid
  want_payload, want_scales = delta_bytes(codec, anchor, theta, bs)
  assert payload.tobytes() == want_payload
  assert scales.tobytes() == want_scales
  _check_within_bound(codec, anchor, theta, payload, scales, bs=bs)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 1000, 65536 + 129])
@pytest.mark.parametrize("bs", [64, 7])
def test_random_deltas_are_the_host_codecs_bytes(codec, n, bs):
  rng = np.random.default_rng(n * 31 + bs)
  theta = rng.standard_normal(n).astype(np.float32)
  anchor = theta + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
  _check_same(anchor, theta, codec, bs)


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_a_million_values_with_their_rare_ties(codec):
  """Ties of δ / s (2^-20 or so of random values) round to even only with a true division: XLA's
  product with a reciprocal rounded 3 of these 2^20 codes the other way."""
  rng = np.random.default_rng(5)
  theta = rng.standard_normal(1 << 20).astype(np.float32)
  anchor = theta + rng.standard_normal(theta.size).astype(np.float32) * np.float32(1e-3)
  _check_same(anchor, theta, codec)


@pytest.mark.parametrize("codec", CODECS)
def test_shapes_scales_spanning_many_magnitudes_and_ties(codec):
  rng = np.random.default_rng(0)
  theta = rng.standard_normal((37, 19)).astype(np.float32)
  # Per-value magnitudes over 60 binades, and exact ties (x / s = k + 0.5) that round to even.
  mags = np.float32(2.0) ** rng.integers(-60, 10, theta.shape).astype(np.float32)
  anchor = (theta + rng.standard_normal(theta.shape).astype(np.float32) * mags).astype(np.float32)
  _check_same(anchor, theta, codec)
  ties = np.tile(np.array([7, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 6.5], np.float32), 16)
  _check_same(ties, np.zeros_like(ties), codec)


@pytest.mark.parametrize("codec", CODECS)
def test_zero_blocks_equal_values_and_negative_zero(codec):
  theta = np.linspace(-1, 1, 300, dtype=np.float32)
  _check_same(theta.copy(), theta, codec)  # δ = 0 everywhere: scale 0, codes 0.
  anchor = theta.copy()
  anchor[:64] = -0.0
  theta2 = theta.copy()
  theta2[:64] = 0.0
  _check_same(anchor, theta2, codec)  # -0 − 0 = -0.


@pytest.mark.parametrize("codec", CODECS)
def test_several_tensors_and_bf16_parameters_in_one_program(codec):
  rng = np.random.default_rng(1)
  thetas = [rng.standard_normal(s).astype(np.float32) for s in [(5, 3), (129,), (2, 2, 2)]]
  thetas.append(rng.standard_normal(33).astype(ml_dtypes.bfloat16))
  anchors = [(t.astype(np.float32) + np.float32(0.01)).astype(t.dtype) for t in thetas]
  valid, pairs = _device(anchors, thetas, codec)
  assert valid and len(pairs) == len(thetas)
  for (payload, scales), a, t in zip(pairs, anchors, thetas):
    want_payload, want_scales = delta_bytes(codec, a, t, 64)
    assert payload.tobytes() == want_payload
    assert scales.tobytes() == want_scales


@pytest.mark.parametrize(
  "anchor, theta, codecs",
  [
    ([np.nan, 1.0], [0.0, 0.0], CODECS),  # NaN: the host codec refuses it by name.
    ([np.inf, 1.0], [0.0, 0.0], CODECS),
    ([3e38, 1.0], [-3e38, 0.0], CODECS),  # δ overflows float32.
    ([3.4e38, 1.0], [0.0, 0.0], ("bf16",)),  # δ is a float32 beyond bfloat16's range.
  ],
)
def test_values_the_host_codec_refuses_are_flagged_not_guessed(anchor, theta, codecs):
  anchor, theta = np.array(anchor, np.float32), np.array(theta, np.float32)
  for codec in codecs:
    valid, _ = _device([anchor], [theta], codec)
    assert not valid, codec
    with pytest.raises(ValueError):
      delta_bytes(codec, anchor, theta, 64)


@pytest.mark.parametrize("codec", CODECS)
def test_one_nan_in_a_large_tensor_is_flagged(codec):
  """2^18 values, one NaN: XLA's CPU backend reduces a max that large in a kernel that skips NaN,
  so a block's scale alone does not show it."""
  theta = np.zeros(1 << 18, np.float32)
  anchor = np.full(1 << 18, 0.25, np.float32)
  anchor[1000] = np.nan
  valid, _ = _device([anchor], [theta], codec)
  assert not valid
  anchor[1000] = 0.25
  valid, _ = _device([anchor], [theta], codec)
  assert valid


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_block_whose_scale_would_be_subnormal_is_left_to_the_host(codec):
  anchor, theta = np.array([3 * _TINY, 2 * _TINY], np.float32), np.zeros(2, np.float32)
  valid, _ = _device([anchor], [theta], codec)
  assert not valid
  delta_bytes(codec, anchor, theta, 64)  # The host codec encodes it.


@pytest.mark.parametrize("codec", CODECS)
def test_subnormals_are_encoded_within_the_bound(codec):
  """A backend may flush subnormal inputs and δ to zero: the encoding is then not the host's bytes
  but still within the codec's bound, and valid."""
  anchor = np.array([_TINY / 4, 1.5 * _TINY, 1.0, -0.5] * 16, np.float32)
  theta = np.array([0.0, 1.25 * _TINY, 0.25, 0.0] * 16, np.float32)
  valid, [(payload, scales)] = _device([anchor], [theta], codec)
  assert valid
  _check_within_bound(codec, anchor, theta, payload, scales, bs=64)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_normal_values_near_the_subnormal_edge_are_encoded_on_the_devices(codec):
  theta = np.zeros(128, np.float32)
  anchor = np.full(128, 256 * _TINY, np.float32) * np.arange(1, 129, dtype=np.float32)
  _check_same(anchor, theta, codec)


def test_an_encoding_one_ulp_off_is_decoded_within_the_bound():
  """What a GPU may produce (a block scale one ulp up or down, the codes of that scale) is a valid
  answer: the receiver decodes it within the bound."""
  rng = np.random.default_rng(3)
  theta = rng.standard_normal(4096).astype(np.float32)
  anchor = theta + rng.standard_normal(theta.size).astype(np.float32) * np.float32(1e-3)
  delta = anchor - theta
  for codec, qmax in (("int8", 127), ("int4", 7)):
    blocks = delta.reshape(-1, 64)
    scales = np.abs(blocks).max(axis=1) / np.float32(qmax)
    scales = np.nextafter(scales, np.where(rng.random(scales.size) < 0.5, 0, 1).astype(np.float32))
    q = np.clip(np.rint(blocks / scales[:, None]), -qmax, qmax).reshape(-1)

    def packed(q, codec=codec):
      if codec == "int8":
        return q.astype(np.int8).view(np.uint8)
      codes = (q + 8).astype(np.uint8).reshape(-1, 2)
      return codes[:, 0] | (codes[:, 1] << 4)

    _check_within_bound(codec, anchor, theta, packed(q), scales.astype(np.float32), bs=64)
    off = q.copy()
    off[np.argmax(np.abs(off) < qmax)] += 1  # One code a step away: beyond the bound.
    assert (
      delta_excess(codec, anchor, theta, packed(off), scales.astype(np.float32), block_size=64) > 0
    )


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="anchors for"):
    device_codec.encode_delta([np.zeros(2, np.float32)], [])
  with pytest.raises(ValueError, match="shape"):
    device_codec.encode_delta([np.zeros(2, np.float32)], [jax.numpy.zeros(3)])
  with pytest.raises(ValueError, match="block_size"):
    device_codec.encode_delta([np.zeros(2, np.float32)], [jax.numpy.zeros(2)], block_size=0)
  with pytest.raises(ValueError, match="No device program"):
    device_codec.encode_delta([np.zeros(2, np.float32)], [jax.numpy.zeros(2)], codec="fp8")
