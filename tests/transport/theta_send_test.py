"""An fp32 answer sent as θ (a learner that holds no anchor, a recovery): the sender hands out θ's
own bytes, each run checked for NaN/Inf in place, with no copy (`FragmentEncoder.pieces`)."""

import numpy as np
import pytest

from ddiloco.syncer import blockwise
from ddiloco.transport.fragment_encoder import FragmentEncoder

B = blockwise.BLOCK_VALUES
SHAPES = {"a": (3 * B + 17,), "b": (B,), "c": (5, 7), "d": (2 * B - 1,)}
KEYS = sorted(SHAPES)
ANCHOR = {
  k: np.random.default_rng(i).standard_normal(s, dtype=np.float32)
  for i, (k, s) in enumerate(SHAPES.items())
}


def _theta(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(100 + seed)
  return {
    k: a - np.float32(1e-2) * rng.standard_normal(a.shape, dtype=np.float32)
    for k, a in ANCHOR.items()
  }


@pytest.mark.parametrize("run", [None, 1000, 1 << 18])
def test_theta_is_sent_as_its_own_bytes(run):
  theta = _theta(0)
  checked = b"".join(map(bytes, FragmentEncoder(theta, "fp32").pieces(run)))
  vouched = b"".join(map(bytes, FragmentEncoder(theta, "fp32", finite=True).pieces()))
  assert checked == vouched
  for k in KEYS:
    assert theta[k].tobytes() in checked


@pytest.mark.parametrize("at", [0, B + 5, 3 * B + 15])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_theta_is_refused_before_its_run_is_sent(at, bad):
  theta = _theta(1)
  first = at // 2
  theta["a"][[first, at + 1]] = bad
  pieces = []
  with pytest.raises(ValueError, match=r"'a': Refusing to encode 2 non-finite value\(s\)"):
    for piece in FragmentEncoder(theta, "fp32").pieces(1000):
      pieces.append(memoryview(piece).nbytes)
  # The file header, the entry's head, then the runs before the first bad one: no more.
  assert sum(pieces[2:]) == first // 1000 * 1000 * 4


def test_finite_values_whose_dot_overflows_are_sent():
  big = {"w": np.full(4096, 3e30, np.float32)}  # Σ x² overflows float32; every value is finite.
  data = b"".join(map(bytes, FragmentEncoder(big, "fp32").pieces()))
  assert big["w"].tobytes() in data


def test_other_arrays_still_go_through_the_codec():
  theta = {"w": np.arange(12, dtype=np.float32).reshape(3, 4).T}  # Not C-contiguous.
  data = b"".join(map(bytes, FragmentEncoder(theta, "fp32").pieces()))
  assert np.ascontiguousarray(theta["w"]).tobytes() in data
  theta["w"][1, 1] = np.nan
  with pytest.raises(ValueError, match="'w': Refusing to encode 1 non-finite"):
    b"".join(map(bytes, FragmentEncoder(theta, "fp32").pieces()))
