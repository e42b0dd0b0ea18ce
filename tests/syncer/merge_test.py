"""Tests of ddiloco.syncer.merge: the blockwise merge by a rule, weighted mean and RDA (docs/algorithm.md §4.5)."""

import math

import ml_dtypes
import numpy as np
import pytest

from ddiloco.syncer import blockwise, merge
from ddiloco.syncer.merge_rules import RDA, WeightedMean
from ddiloco.testing import merges as reference

RULES = {"rda": RDA(), "mean": WeightedMean()}


def test_weighted_mean_by_hand():
  vs = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
  out = reference.weighted_mean(vs, [1.0, 3.0])
  # (1*[1, 2] + 3*[3, 4]) / 4 = [10, 14] / 4 = [2.5, 3.5].
  np.testing.assert_array_equal(out, np.array([2.5, 3.5], np.float32))
  assert out.dtype == np.float32


def test_weighted_mean_zero_weight_is_ignored():
  vs = [np.array([1.0]), np.array([1e30])]
  np.testing.assert_array_equal(reference.weighted_mean(vs, [2.0, 0.0]), [1.0])


@pytest.mark.parametrize(
  ("vs", "ws", "match"),
  [
    ([np.zeros(2), np.zeros(2)], [0.0, 0.0], "positive sum"),
    ([np.zeros(2), np.zeros(3)], [1.0, 1.0], "Shape mismatch"),
    ([np.zeros(2, np.float32), np.zeros(2)], [1.0, 1.0], "Dtype mismatch"),
    ([np.zeros(2), np.zeros(2)], [1.0, -1.0], ">= 0"),
    ([np.zeros(2)], [1.0, 1.0], "1 reports but 2 weights"),
    ([], [], "Nothing to merge"),
  ],
)
def test_weighted_mean_rejects(vs, ws, match):
  with pytest.raises(ValueError, match=match):
    reference.weighted_mean(vs, ws)


def test_rda_equals_mean_for_identical_inputs():
  v = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
  # Same norm and direction for everyone: radius ‖v‖, direction unit(v), so RDA = v = the mean.
  out = reference.rda([v, v, v], [1.0, 2.0, 5.0])
  np.testing.assert_allclose(out, v, rtol=1e-6)
  np.testing.assert_allclose(out, reference.weighted_mean([v, v, v], [1.0, 2.0, 5.0]), rtol=1e-6)


def test_rda_of_orthogonal_unit_vectors_keeps_norm_one():
  e1, e2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
  out = reference.rda([e1, e2], [1.0, 1.0])
  # Radius (1 + 1) / 2 = 1; direction unit([0.5, 0.5]) = [1, 1]/√2.
  np.testing.assert_allclose(out, [1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-12)
  assert np.linalg.norm(out) == pytest.approx(1.0, rel=1e-12)
  # The plain mean [0.5, 0.5] has norm 1/√2: the shrinkage RDA avoids.
  assert np.linalg.norm(reference.weighted_mean([e1, e2], [1.0, 1.0])) == pytest.approx(
    1 / math.sqrt(2)
  )


def test_rda_unequal_norms_and_weights_by_hand():
  v1, v2 = np.array([2.0, 0.0]), np.array([0.0, 4.0])
  out = reference.rda([v1, v2], [1.0, 3.0])
  # Radius (1*2 + 3*4) / 4 = 3.5; direction (1*[1, 0] + 3*[0, 1]) / 4 = [0.25, 0.75] -> [1, 3]/√10.
  np.testing.assert_allclose(out, 3.5 / math.sqrt(10) * np.array([1.0, 3.0]), rtol=1e-12)


def test_rda_with_a_zero_vector():
  v, z = np.array([3.0, 4.0], np.float32), np.zeros(2, np.float32)
  out = reference.rda([v, z], [1.0, 1.0])
  # The zero vector adds 0 radius and no direction, but its weight counts: radius (5 + 0) / 2 = 2.5,
  # direction unit([3, 4]) = [0.6, 0.8] -> [1.5, 2.0].
  np.testing.assert_allclose(out, [1.5, 2.0], rtol=1e-6)
  assert out.dtype == np.float32
  np.testing.assert_array_equal(reference.rda([z, z], [1.0, 1.0]), [0.0, 0.0])


def test_rda_cancelling_directions_give_zeros():
  v = np.array([1.0, -2.0])
  np.testing.assert_array_equal(reference.rda([v, -v], [1.0, 1.0]), [0.0, 0.0])


def test_merge_outer_gradients_embeddings_use_the_mean():
  e1, e2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
  grads = [{"emb": e1, "w": e1}, {"emb": e2, "w": e2}]
  out = reference.merge_outer_gradients(
    grads, [1.0, 1.0], rule=RDA(), embedding_keys={"emb", "not_here"}
  )
  assert list(out) == ["emb", "w"]
  np.testing.assert_allclose(out["emb"], [0.5, 0.5])  # mean
  np.testing.assert_allclose(np.linalg.norm(out["w"]), 1.0)  # RDA
  out_mean = reference.merge_outer_gradients(grads, [1.0, 1.0])  # The default rule.
  np.testing.assert_allclose(out_mean["w"], [0.5, 0.5])


def test_merge_outer_gradients_rejects():
  with pytest.raises(ValueError, match="rule must be a MergeRule"):
    reference.merge_outer_gradients([{"a": np.zeros(1)}], [1.0], rule="median")
  with pytest.raises(ValueError, match="keys"):
    reference.merge_outer_gradients([{"a": np.zeros(1)}, {"b": np.zeros(1)}], [1.0, 1.0])


# -- merge_reports: the fused float32 merge the core calls ------------------------------------------

U32 = 2.0**-24  # float32 unit roundoff.


def _ref64(anchors, thetas, ws, method):
  """The merge in float64 from explicit outer gradients v_m = a_m − θ_m (docs/algorithm.md §4.5)."""
  vs = [a.astype(np.float64) - t.astype(np.float64) for a, t in zip(anchors, thetas)]
  total = sum(ws)
  if method == "mean":
    return sum(w * v for w, v in zip(ws, vs)) / total
  norms = [np.linalg.norm(v) for v in vs]
  radius = sum(w * n for w, n in zip(ws, norms)) / total
  direction = sum(w / n * v for w, n, v in zip(ws, norms, vs)) / total
  return direction * (radius / np.linalg.norm(direction))


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("num", [2, 8])
def test_float32_merge_matches_float64_within_a_few_ulps(monkeypatch, method, num):
  # Blocks of 1000 values over 10007 (11 blocks, a short last one), so the blockwise sums are hit.
  monkeypatch.setattr(merge, "BLOCK_VALUES", 1000)
  rng = np.random.default_rng(num)
  anchor = rng.standard_normal(10007).astype(np.float32)
  thetas = [anchor - np.float32(1e-2) * rng.standard_normal(10007, np.float32) for _ in range(num)]
  ws = [float(m + 1) for m in range(num)]
  got = merge.merge_reports(
    [{"k": anchor}] * num, [{"k": t} for t in thetas], ws, rule=RULES[method]
  )
  want = _ref64([anchor] * num, thetas, ws, method)
  assert got["k"].dtype == np.float32
  # Bound, to first order in u = 2^-24: v_m's rounding (u), the num − 1 accumulations ((num − 1)u),
  # the scale from the float64-summed norms (u) and the final rounding (u): (num + 2)u, relative
  # to the largest value. Measured: 1.0-1.8u.
  err = np.max(np.abs(got["k"] - want)) / np.max(np.abs(want))
  assert err <= (num + 2) * U32
  assert np.linalg.norm(got["k"] - want) / np.linalg.norm(want) <= (num + 2) * U32


def test_merge_reports_with_stale_anchors_bf16_and_a_zero_weight():
  rng = np.random.default_rng(3)
  a0 = rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
  a1 = (a0.astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16)  # An older version (re-anchoring).
  t0 = (a0.astype(np.float32) - 0.25).astype(ml_dtypes.bfloat16)
  t1 = rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
  t2 = np.full((4, 6), np.nan, ml_dtypes.bfloat16)  # Weight 0: never read, so NaN cannot leak.
  for method in ("rda", "mean"):
    got = merge.merge_reports(
      [{"w": a0}, {"w": a1}, {"w": a0}],
      [{"w": t0}, {"w": t1}, {"w": t2}],
      [2.0, 1.0, 0.0],
      rule=RULES[method],
    )["w"]
    # Differences of bfloat16 values are taken in float32 (the core's float32 outer gradients).
    grads = [
      a0.astype(np.float32) - t0.astype(np.float32),
      a1.astype(np.float32) - t1.astype(np.float32),
    ]
    want = (reference.rda if method == "rda" else reference.weighted_mean)(grads, [2.0, 1.0])
    assert got.dtype == np.float32 and got.shape == (4, 6)
    np.testing.assert_allclose(got, want, rtol=4 * U32, atol=4 * U32 * np.max(np.abs(want)))


def test_merge_reports_embeddings_use_the_mean_and_outputs_are_aligned():
  e1, e2 = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
  zero = np.zeros(2, np.float32)
  got = merge.merge_reports(
    [{"emb": e1, "w": e1}] * 2,
    [{"emb": zero, "w": zero}] * 2,
    [1.0, 1.0],
    rule=RDA(),
    embedding_keys={"emb"},
  )
  # v = [e1, e1] for both keys: mean and RDA agree on identical inputs ...
  np.testing.assert_allclose(got["emb"], e1)
  got = merge.merge_reports(
    [{"emb": e1, "w": e1}, {"emb": e2, "w": e2}],
    [{"emb": zero, "w": zero}] * 2,
    [1.0, 1.0],
    rule=RDA(),
    embedding_keys={"emb"},
  )
  # ... and differ on orthogonal ones: mean [0.5, 0.5], RDA [1, 1]/√2 (norm 1).
  np.testing.assert_allclose(got["emb"], [0.5, 0.5])
  np.testing.assert_allclose(got["w"], [1 / math.sqrt(2)] * 2, rtol=2 * U32)
  assert all(v.ctypes.data % 64 == 0 for v in got.values())  # device_put can alias them.


def test_merge_reports_rejects():
  a = {"k": np.zeros(3, np.float32)}
  with pytest.raises(ValueError, match="2 anchors but 1 reports"):
    merge.merge_reports([a, a], [a], [1.0])
  with pytest.raises(ValueError, match="keys"):
    merge.merge_reports([a], [{"j": np.zeros(3, np.float32)}], [1.0])
  with pytest.raises(ValueError, match=r"'k': anchors are float32\[3\], values float64\[3\]"):
    merge.merge_reports([a], [{"k": np.zeros(3)}], [1.0])
  with pytest.raises(ValueError, match="rule must be a MergeRule"):
    merge.merge_reports([a], [a], [1.0], rule="median")
  with pytest.raises(ValueError, match="positive sum"):
    merge.merge_reports([a], [a], [0.0])


def test_norms_known_in_advance_give_the_same_bits(monkeypatch):
  monkeypatch.setattr(merge, "BLOCK_VALUES", 64)  # 4 blocks of 64 values and one of 44.
  rng = np.random.default_rng(5)
  anchors = [{"k": rng.standard_normal(300).astype(np.float32)} for _ in range(3)]
  values = [{"k": a["k"] - rng.standard_normal(300).astype(np.float32)} for a in anchors]
  ws = [1.0, 2.0, 3.0]
  norms = [merge.outer_sq_norms(a, v) for a, v in zip(anchors, values)]
  v64 = values[1]["k"].astype(np.float64) - anchors[1]["k"].astype(np.float64)
  assert norms[1]["k"] == pytest.approx(float(v64 @ v64), rel=300 * U32)
  plain = merge.merge_reports(anchors, values, ws, rule=RDA())["k"]
  for given in (norms, [norms[0], None, norms[2]]):  # All known, or some.
    got = merge.merge_reports(anchors, values, ws, rule=RDA(), sq_norms=given)["k"]
    assert got.tobytes() == plain.tobytes()
  # The norms are used, not recomputed: doubling learner 0's changes the result.
  wrong = [{"k": 4 * norms[0]["k"]}, norms[1], norms[2]]
  assert not np.allclose(
    merge.merge_reports(anchors, values, ws, rule=RDA(), sq_norms=wrong)["k"], plain
  )
  with pytest.raises(ValueError, match="2 sq_norms but 3 reports"):
    merge.merge_reports(anchors, values, ws, rule=RDA(), sq_norms=norms[:2])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_finite_sq_norm_equals_outer_sq_norms_bit_for_bit(monkeypatch, dtype):
  monkeypatch.setattr(merge, "BLOCK_VALUES", 64)  # 300 values: 4 blocks of 64 and one of 44.
  rng = np.random.default_rng(7)
  a = rng.standard_normal((3, 100)).astype(dtype)
  v = (a.astype(np.float64) - rng.standard_normal((3, 100))).astype(dtype)
  got = merge.finite_sq_norm(a, v)
  assert type(got) is float
  assert got == merge.outer_sq_norms({"k": a}, {"k": v})["k"]  # Same blocks, same order.
  with pytest.raises(ValueError, match="Shape mismatch"):
    merge.finite_sq_norm(a, v[:2])


@pytest.mark.parametrize("at", [0, 63, 64, 299])  # First/last value of a block, the partial block.
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_finite_sq_norm_is_none_iff_the_value_is_not_finite(monkeypatch, at, bad):
  monkeypatch.setattr(merge, "BLOCK_VALUES", 64)
  a = np.ones(300, np.float32)
  v = np.zeros(300, np.float32)
  assert merge.finite_sq_norm(a, v) == 300.0  # 300 × (1 − 0)².
  v[at] = bad
  assert merge.finite_sq_norm(a, v) is None
  # An anchor holding the same Inf: Inf − Inf is NaN, still caught.
  a[at] = bad
  assert merge.finite_sq_norm(a, v) is None


def test_finite_sq_norm_overflow_of_finite_values_is_not_a_rejection(monkeypatch):
  monkeypatch.setattr(merge, "BLOCK_VALUES", 2)
  huge = np.full(4, 3e38, np.float32)
  # v = 0 − 3e38 is finite, v·v overflows float32 to Inf: the block itself is checked, and passes.
  assert merge.finite_sq_norm(np.zeros(4, np.float32), huge) == np.inf
  # v = Inf − 3e38 = Inf comes from the anchor, not the value: the value is finite.
  anchor = np.array([np.inf, 0.0, 0.0, 0.0], np.float32)
  assert merge.finite_sq_norm(anchor, np.zeros(4, np.float32)) == np.inf
  assert merge.finite_sq_norm(np.zeros(0, np.float32), np.zeros(0, np.float32)) == 0.0


def test_output_buffer_is_reused_and_gives_the_same_bits():
  rng = np.random.default_rng(11)
  anchors = [{"k": rng.standard_normal(300).astype(np.float32)} for _ in range(2)]
  values = [{"k": a["k"] - rng.standard_normal(300).astype(np.float32)} for a in anchors]
  buf = blockwise.OutputBuffer()
  first = merge.merge_reports(anchors, values, [1.0, 3.0], out=buf)["k"]
  assert first.tobytes() == merge.merge_reports(anchors, values, [1.0, 3.0])["k"].tobytes()
  assert first.ctypes.data % 64 == 0 and buf.nbytes == 1216 + 64  # 1200 bytes to 64s, + align.
  kept = first.copy()
  # The next merge writes over the same memory; a larger one grows the buffer.
  second = merge.merge_reports(anchors, values, [2.0, 1.0], rule=WeightedMean(), out=buf)["k"]
  assert np.shares_memory(first, second) and not np.array_equal(first, kept)
  fresh = merge.merge_reports(anchors, values, [2.0, 1.0], rule=WeightedMean())["k"]
  assert second.tobytes() == fresh.tobytes()
  big = {"k": np.zeros(400, np.float32)}
  merge.merge_reports([big], [big], [1.0], out=buf)
  assert buf.nbytes == 1600 + 64
