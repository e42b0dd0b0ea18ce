"""Tests of ddiloco.syncer.merge_rules: token weights, the `MergeRule` interface, RDA and the weighted
mean, and both merge paths (fused and blockwise) against a reference (docs/algorithm.md §4.4-4.5)."""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import pytest

from ddiloco.syncer import merge
from ddiloco.syncer.merge_rules import (
  RDA,
  Coefficients,
  MergeRule,
  WeightedMean,
  check_rule,
  mean_coefficients,
  rda_coefficients,
  token_weight,
)
from ddiloco.syncer.types import SyncerConfig
from ddiloco.testing.merges import Answer, merge_round

U32 = 2.0**-24  # float32 unit roundoff.
EMB = "emb"  # The embedding tensor of `_answers`: the weighted mean whatever the rule.


def test_token_weight_examples():
  # 100 tokens over 4 steps: 100**2 / 4 = 2500.
  assert token_weight(100, 4) == 2500.0
  # Same steps, twice the tokens (twice the batch): 4x the weight, 200**2 / 4 = 10000.
  assert token_weight(200, 4) == 10000.0
  # Same tokens over twice the steps (half the batch): half the weight, 100**2 / 8 = 1250.
  assert token_weight(100, 8) == 1250.0
  assert token_weight(0, 5) == 0.0
  assert token_weight(5, 0) == 0.0
  with pytest.raises(ValueError, match="Counters"):
    token_weight(-1, 3)


def test_coefficients_by_hand():
  # Weights 1, 0, 3: the mean's coefficients 1/4 and 3/4; the weight-0 answer is not read.
  assert mean_coefficients([1.0, 0.0, 3.0]) == {0: 0.25, 2: 0.75}
  assert WeightedMean().coefficients([1.0, 0.0, 3.0], None) == Coefficients(
    {0: 0.25, 2: 0.75}, None
  )
  # RDA with norms 2 and 4: c_m = w_m / ‖v_m‖ / Σ w = 1/2/4 and 3/4/4; radius (1*2 + 3*4) / 4.
  coefs, radius = rda_coefficients([1.0, 3.0], {0: 4.0, 1: 16.0}, 1e-12)
  assert coefs == {0: 0.125, 1: 0.1875} and radius == 3.5
  assert RDA().coefficients([1.0, 3.0], {0: 4.0, 1: 16.0}) == Coefficients(coefs, radius)
  # A zero norm adds no direction and no radius, but its weight counts in Σ w.
  assert rda_coefficients([1.0, 1.0], {0: 25.0, 1: 0.0}, 1e-12) == ({0: 0.1}, 2.5)
  assert rda_coefficients([1.0, 1.0], {0: 0.0, 1: 0.0}, 1e-12) == ({}, 0.0)
  # The eps guard is RDA's setting: norms at or below it count as zero.
  assert RDA(eps=5.0).coefficients([1.0, 1.0], {0: 25.0, 1: 16.0}) == Coefficients({}, 0.0)


def test_what_each_rule_needs_and_refuses():
  assert RDA.needs_norms and not WeightedMean.needs_norms
  with pytest.raises(ValueError, match="RDA needs the answers' squared norms"):
    RDA().coefficients([1.0], None)
  for eps in (-1.0, math.nan, math.inf):
    with pytest.raises(ValueError, match=r"RDA\.eps must be finite and >= 0"):
      RDA(eps=eps)
  with pytest.raises(TypeError, match="abstract"):
    MergeRule()  # The interface alone merges nothing.


@pytest.mark.parametrize(
  ("value", "match"),
  [
    (
      "rda",
      r"must be a MergeRule .* got 'rda': in gin, e.g. @WeightedMean\(\) \(the default\) or @RDA\(\)",
    ),
    (None, "must be a MergeRule"),
    (
      RDA,
      r"must be a MergeRule instance, got the class RDA: write @RDA\(\) in gin \(with parentheses\)",
    ),
  ],
)
def test_a_bad_merge_rule_is_refused_with_what_to_write(value, match):
  with pytest.raises(ValueError, match="SyncerConfig.merge_rule " + match):
    SyncerConfig(merge_rule=value)
  with pytest.raises(ValueError, match="rule " + match):
    check_rule(value, "rule")


def test_configs_with_equal_rules_are_equal():
  # gin builds a new rule object per parse: configs still compare by what they say.
  assert SyncerConfig(merge_rule=WeightedMean()) == SyncerConfig()
  assert SyncerConfig(merge_rule=RDA()) != SyncerConfig()
  assert SyncerConfig(merge_rule=RDA()) == SyncerConfig(merge_rule=RDA())
  assert SyncerConfig(merge_rule=RDA(eps=1e-9)) != SyncerConfig(merge_rule=RDA())


def _answers(seed: int, n: int = 3, size: int = 300) -> list[Answer]:
  """n answers with unequal tokens and steps: learner 1 sends θ (merged against the zero base),
  the others δ; two tensors, one of them the embedding."""
  rng = np.random.default_rng(seed)
  out = []
  for m in range(n):
    values = {k: (0.05 * rng.standard_normal(size)).astype(np.float32) for k in ("w", EMB)}
    theta = m == 1
    if theta:
      values = {k: -v for k, v in values.items()}  # θ_m = 0 − v_m: its v_m is as drawn.
    out.append(Answer(values, tokens=64 * (m + 1), steps=4 + m, outer_gradient=not theta))
  return out


def _v64(a: Answer, key: str) -> np.ndarray:
  """v_m in float64: δ as sent, or 0 − θ."""
  v = a.values[key].astype(np.float64)
  return v if a.outer_gradient else -v


def _reference_mean(vs: Sequence[np.ndarray], ws: Sequence[float]) -> np.ndarray:
  return sum(w * v for w, v in zip(ws, vs)) / sum(ws)


def _reference_rda(vs: Sequence[np.ndarray], ws: Sequence[float]) -> np.ndarray:
  norms = [np.linalg.norm(v) for v in vs]
  radius = sum(w * n for w, n in zip(ws, norms)) / sum(ws)
  direction = sum(w / n * v for w, n, v in zip(ws, norms, vs)) / sum(ws)
  return direction * (radius / np.linalg.norm(direction))


@pytest.mark.parametrize(
  ("rule", "reference"),
  [(RDA(), _reference_rda), (WeightedMean(), _reference_mean)],
  ids=["rda", "mean"],
)
def test_both_paths_merge_as_the_reference(rule, reference):
  answers = _answers(seed=1)
  got = merge_round(rule, answers, embedding_keys=(EMB,))
  # The shipped rules weigh by tokens² / steps: 64² / 4, 128² / 5, 192² / 6.
  ws = [token_weight(a.tokens, a.steps) for a in answers]
  assert got.weights == tuple(ws) == (1024.0, 3276.8, 6144.0)
  for key in ("w", EMB):
    want = (_reference_mean if key == EMB else reference)([_v64(a, key) for a in answers], ws)
    # The blockwise path is `merge.merge_reports` with the rule: the same arithmetic, the same
    # bits (the outer step's SGD at lr 1 from zeros adds no rounding).
    direct = merge.merge_reports(
      [None] * 3,
      [a.values if a.outer_gradient else {k: -v for k, v in a.values.items()} for a in answers],
      ws,
      rule=rule,
      embedding_keys=(EMB,),
    )[key]
    np.testing.assert_array_equal(got.blockwise[key], direct)
    # Not bit-equal otherwise: the fused path sums the same float32 terms in another order (XLA's,
    # which may also fuse a multiply and an add), and takes RDA's ‖direction‖ as a float32
    # reduction where the blockwise path sums float64 dot products of float32 blocks. Both agree
    # with the float64 reference to float32 rounding. Bound, to first order in u, of the largest
    # value, as tests/syncer/merge_test.py states it for the blockwise merge: the coefficients'
    # rounding to float32 (u), the products and sums of n = 3 answers (n u) and the final
    # rounding (u), plus RDA's scale from a norm (u) and a margin of u for the float32 norm's own
    # error: 6u. Measured over 30 seeds: at most 2.7u (RDA, fused), 1.6u (the mean).
    scale = np.max(np.abs(want))
    for path in (got.fused[key], got.blockwise[key]):
      assert path.dtype == np.float32
      assert np.max(np.abs(path - want)) <= 6 * U32 * scale, key
  # The embedding took the mean, the other tensor the rule: RDA's merge is longer than the mean's.
  if isinstance(rule, RDA):
    assert np.linalg.norm(got.fused["w"]) > 1.05 * np.linalg.norm(
      _reference_mean([_v64(a, "w") for a in answers], ws)
    )


def test_where_the_arithmetic_is_exact_the_paths_are_bit_equal():
  """The mean of dyadic values with weights 1 and 3 (coefficients 1/4 and 3/4): every product and
  sum is exact in float32, so both paths and the reference give the same bits."""
  v0 = np.array([1.0, -2.0, 0.5, 8.0], np.float32)
  v1 = np.array([4.0, 0.25, -1.0, 0.0], np.float32)
  answers = [Answer({"w": v0}, tokens=1, steps=1), Answer({"w": v1}, tokens=3, steps=3)]
  got = merge_round(WeightedMean(), answers)
  assert got.weights == (1.0, 3.0)
  want = np.array([3.25, -0.3125, -0.625, 2.0], np.float32)  # (1 * v0 + 3 * v1) / 4.
  for path in (got.fused["w"], got.blockwise["w"]):
    np.testing.assert_array_equal(path, want)


@dataclasses.dataclass(frozen=True)
class _UnitMean(MergeRule):
  """A rule of this test's own: the weighted mean rescaled to norm 1, and every answer weighing 1.
  It reads the norms only to check that the merge hands them over."""

  needs_norms: ClassVar[bool] = True

  def weight(self, report, schedule) -> float:
    del report, schedule
    return 1.0

  def coefficients(
    self, weights: Sequence[float], sq_norms: Mapping[int, float] | None
  ) -> Coefficients:
    assert sq_norms is not None and sorted(sq_norms) == list(range(len(weights)))
    return Coefficients(mean_coefficients(weights), 1.0)


def test_a_new_rule_runs_through_both_paths():
  answers = _answers(seed=2)
  got = merge_round(_UnitMean(), answers, embedding_keys=(EMB,))
  assert got.weights == (1.0, 1.0, 1.0)
  mean = _reference_mean([_v64(a, "w") for a in answers], [1.0] * 3)
  want = mean / np.linalg.norm(mean)
  for path in (got.fused["w"], got.blockwise["w"]):
    assert np.linalg.norm(path.astype(np.float64)) == pytest.approx(1.0, abs=4 * U32)
    np.testing.assert_allclose(path, want, rtol=0, atol=6 * U32 * np.max(np.abs(want)))
  # The embedding is not rescaled: the plain mean of the rule's (equal) weights.
  emb = _reference_mean([_v64(a, EMB) for a in answers], [1.0] * 3)
  np.testing.assert_allclose(got.fused[EMB], emb, rtol=0, atol=6 * U32 * np.max(np.abs(emb)))
