"""Tests for the lossy downlink's adoption (ddiloco.service.downlink, docs/algorithm.md §5).

The adopter forms what a learner decodes in the encoding pass itself (`FragmentEncoder(received=)`)
instead of decoding its own bytes; it must hold exactly what a learner's `read_layout` makes of the
same bytes, bit for bit, and the bytes must be those `serialize_chunks` sends without it.
"""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.service.downlink import DownlinkAdopter
from ddiloco.transport import state_messages
from ddiloco.transport.fragment_encoder import serialize_chunks
from ddiloco.transport.fragment_reader import read_layout


def _fragment(dtype, seed: int) -> tuple[dict, dict]:
  """(new, prev): tensors of odd and block-straddling sizes. Where prev is -0.0 the first values
  get a tiny negative delta beside a large one (q rounds to -0.0, and -0.0 + -0.0 differs from
  -0.0 + +0.0); then a block with a zero delta, and one of subnormal deltas."""
  rng = np.random.default_rng(seed)
  shapes = {"a": (3, 67), "b": (1,), "c": (1000,), "d": (2, 2, 65), "e": (0, 4)}
  prev, new = {}, {}
  for k, shape in shapes.items():
    p = rng.standard_normal(shape).astype(np.float32)
    delta = rng.standard_normal(shape).astype(np.float32) * np.float32(1e-3)
    flat_p, flat_d = p.reshape(-1), delta.reshape(-1)
    flat_p[:64:3] = -0.0
    flat_d[:64:3] = np.float32(-1e-9)
    flat_d[1:64:3] = np.float32(0.5)
    flat_d[64:128] = 0.0
    flat_d[128:192] = np.float32(1e-42)
    prev[k] = p.astype(dtype)
    new[k] = (prev[k].astype(np.float32) + delta).astype(dtype)
  return new, prev


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("block_size", [64, 5])
# One thread; the fragment cut into 2 or 3 parts on threads (split_values=1: however small).
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_adopted_values_are_what_a_learner_decodes(codec, dtype, block_size, workers):
  new, prev = _fragment(dtype, seed=block_size)
  adopter = DownlinkAdopter(
    codec, block_size=block_size, chunk_size=1000, workers=workers, split_values=1
  )
  adopted = adopter(0, new, prev)
  adopter.published(0, 1, "digest")
  want_pieces = list(
    serialize_chunks(new, codec, block_size=block_size, base=prev, chunk_size=1000)
  )
  layout = {k: (v.shape, v.dtype) for k, v in new.items()}
  learner = read_layout(
    want_pieces, layout, codec_name=codec, max_bytes=sum(map(len, want_pieces)), base=prev
  )
  assert sorted(adopted) == sorted(learner)
  for k, v in learner.items():
    assert adopted[k].dtype == v.dtype and adopted[k].shape == v.shape
    np.testing.assert_array_equal(adopted[k].view(np.uint8), v.view(np.uint8), err_msg=k)
  # The adopter's bytes are the sender's, untouched by what it formed beside them.
  want = state_messages.encoded_state_messages(
    want_pieces, fragment=0, version=1, digest="digest", codec=codec, base_version=0
  )
  assert adopter.delta_chunks(0, 1) == want


def test_exact_codec_refused():
  with pytest.raises(ValueError, match="needs no adoption"):
    DownlinkAdopter("fp32", block_size=64, chunk_size=1000)


@pytest.mark.parametrize("codec", ["int4", "bf16"])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("where", [0, 150, 1461])  # In the first, a middle and the last part.
def test_non_finite_refused_as_one_encoding_refuses_it(codec, workers, where):
  new, prev = _fragment(np.float32, seed=0)
  keys = sorted(new)
  at = where
  for k in keys:  # The value `where` of the fragment, in key order.
    if at < new[k].size:
      new[k].reshape(-1)[at] = np.nan
      break
    at -= new[k].size
  with pytest.raises(ValueError) as want:
    list(serialize_chunks(new, codec, block_size=64, base=prev, chunk_size=1000))
  adopter = DownlinkAdopter(codec, block_size=64, chunk_size=1000, workers=workers, split_values=1)
  with pytest.raises(ValueError) as got:
    adopter(0, new, prev)
  assert str(got.value) == str(want.value)
  assert "Refusing to encode 1 non-finite value(s)" in str(got.value)


def test_workers_checked():
  with pytest.raises(ValueError, match="workers"):
    DownlinkAdopter("int4", block_size=64, chunk_size=1000, workers=0)


def test_adopted_values_reuse_the_memory_of_versions_no_longer_held():
  new, prev = _fragment(np.float32, seed=3)
  adopter = DownlinkAdopter("int4", block_size=64, chunk_size=1000, workers=1)
  first = adopter(0, new, prev)
  want = {k: v.copy() for k, v in first.items()}
  view = first["c"][5:]  # A view keeps the whole allocation in use.
  del first
  second = adopter(0, new, prev)
  assert not np.shares_memory(second["c"], view)  # Still held: fresh memory.
  del view
  third = adopter(0, new, prev)  # The first version's memory, back once nothing held it.
  assert adopter._pool.reused == 1
  for k, v in want.items():  # The same bits, wherever they are written.
    np.testing.assert_array_equal(third[k].view(np.uint8), v.view(np.uint8))
    np.testing.assert_array_equal(second[k].view(np.uint8), v.view(np.uint8))
