"""Tests of ddiloco.syncer.merge: token weights, weighted mean and RDA (SPEC §4.4-4.5)."""

import math

import numpy as np
import pytest

from ddiloco.syncer import merge


def test_token_weight_examples():
  # 100 tokens over 4 steps: 100**2 / 4 = 2500.
  assert merge.token_weight(100, 4) == 2500.0
  # Same steps, twice the tokens (twice the batch): 4x the weight, 200**2 / 4 = 10000.
  assert merge.token_weight(200, 4) == 10000.0
  # Same tokens over twice the steps (half the batch): half the weight, 100**2 / 8 = 1250.
  assert merge.token_weight(100, 8) == 1250.0
  assert merge.token_weight(0, 5) == 0.0
  assert merge.token_weight(5, 0) == 0.0
  with pytest.raises(ValueError, match="Counters"):
    merge.token_weight(-1, 3)


def test_weighted_mean_by_hand():
  vs = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
  out = merge.weighted_mean(vs, [1.0, 3.0])
  # (1*[1, 2] + 3*[3, 4]) / 4 = [10, 14] / 4 = [2.5, 3.5].
  np.testing.assert_array_equal(out, np.array([2.5, 3.5], np.float32))
  assert out.dtype == np.float32


def test_weighted_mean_zero_weight_is_ignored():
  vs = [np.array([1.0]), np.array([1e30])]
  np.testing.assert_array_equal(merge.weighted_mean(vs, [2.0, 0.0]), [1.0])


@pytest.mark.parametrize(
  ("vs", "ws", "match"),
  [
    ([np.zeros(2), np.zeros(2)], [0.0, 0.0], "positive sum"),
    ([np.zeros(2), np.zeros(3)], [1.0, 1.0], "Shape mismatch"),
    ([np.zeros(2, np.float32), np.zeros(2)], [1.0, 1.0], "Dtype mismatch"),
    ([np.zeros(2), np.zeros(2)], [1.0, -1.0], ">= 0"),
    ([np.zeros(2)], [1.0, 1.0], "1 values but 2 weights"),
    ([], [], "Nothing to merge"),
  ],
)
def test_weighted_mean_rejects(vs, ws, match):
  with pytest.raises(ValueError, match=match):
    merge.weighted_mean(vs, ws)


def test_rda_equals_mean_for_identical_inputs():
  v = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
  # Same norm and direction for everyone: radius ‖v‖, direction unit(v), so RDA = v = the mean.
  out = merge.rda([v, v, v], [1.0, 2.0, 5.0])
  np.testing.assert_allclose(out, v, rtol=1e-6)
  np.testing.assert_allclose(out, merge.weighted_mean([v, v, v], [1.0, 2.0, 5.0]), rtol=1e-6)


def test_rda_of_orthogonal_unit_vectors_keeps_norm_one():
  e1, e2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
  out = merge.rda([e1, e2], [1.0, 1.0])
  # Radius (1 + 1) / 2 = 1; direction unit([0.5, 0.5]) = [1, 1]/√2.
  np.testing.assert_allclose(out, [1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-12)
  assert np.linalg.norm(out) == pytest.approx(1.0, rel=1e-12)
  # The plain mean [0.5, 0.5] has norm 1/√2: the shrinkage RDA avoids.
  assert np.linalg.norm(merge.weighted_mean([e1, e2], [1.0, 1.0])) == pytest.approx(
    1 / math.sqrt(2)
  )


def test_rda_unequal_norms_and_weights_by_hand():
  v1, v2 = np.array([2.0, 0.0]), np.array([0.0, 4.0])
  out = merge.rda([v1, v2], [1.0, 3.0])
  # Radius (1*2 + 3*4) / 4 = 3.5; direction (1*[1, 0] + 3*[0, 1]) / 4 = [0.25, 0.75] -> [1, 3]/√10.
  np.testing.assert_allclose(out, 3.5 / math.sqrt(10) * np.array([1.0, 3.0]), rtol=1e-12)


def test_rda_with_a_zero_vector():
  v, z = np.array([3.0, 4.0], np.float32), np.zeros(2, np.float32)
  out = merge.rda([v, z], [1.0, 1.0])
  # The zero vector adds 0 radius and no direction, but its weight counts: radius (5 + 0) / 2 = 2.5,
  # direction unit([3, 4]) = [0.6, 0.8] -> [1.5, 2.0].
  np.testing.assert_allclose(out, [1.5, 2.0], rtol=1e-6)
  assert out.dtype == np.float32
  np.testing.assert_array_equal(merge.rda([z, z], [1.0, 1.0]), [0.0, 0.0])


def test_rda_cancelling_directions_give_zeros():
  v = np.array([1.0, -2.0])
  np.testing.assert_array_equal(merge.rda([v, -v], [1.0, 1.0]), [0.0, 0.0])


def test_merge_outer_gradients_embeddings_use_the_mean():
  e1, e2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
  grads = [{"emb": e1, "w": e1}, {"emb": e2, "w": e2}]
  out = merge.merge_outer_gradients(grads, [1.0, 1.0], embedding_keys={"emb", "not_here"})
  assert list(out) == ["emb", "w"]
  np.testing.assert_allclose(out["emb"], [0.5, 0.5])  # mean
  np.testing.assert_allclose(np.linalg.norm(out["w"]), 1.0)  # RDA
  out_mean = merge.merge_outer_gradients(grads, [1.0, 1.0], method="mean")
  np.testing.assert_allclose(out_mean["w"], [0.5, 0.5])


def test_merge_outer_gradients_rejects():
  with pytest.raises(ValueError, match="Unknown merge method"):
    merge.merge_outer_gradients([{"a": np.zeros(1)}], [1.0], method="median")
  with pytest.raises(ValueError, match="keys"):
    merge.merge_outer_gradients([{"a": np.zeros(1)}, {"b": np.zeros(1)}], [1.0, 1.0])
