"""Tests of ddiloco.syncer.staleness_rule: its weights by hand, both merge paths against a reference,
its answers in the core, and a short simulated run merged with it (docs/algorithm.md §4.5)."""

import json

import numpy as np
import pytest

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import configurables
from ddiloco.metrics.writer import read_events
from ddiloco.protocol import Report
from ddiloco.syncer.core import SyncerConfig, SyncerCore
from ddiloco.syncer.staleness_rule import StalenessDiscountedMean, staleness
from ddiloco.testing import runs
from ddiloco.testing.merges import Answer, merge_round

H4 = FragmentSchedule(num_fragments=1, period=4, overlap=1)  # H = 4.
U32 = 2.0**-24  # float32 unit roundoff.


def _report(tokens: int, steps: int) -> Report:
  return Report(
    learner_id=0, fragment=0, values={}, tokens=tokens, steps=steps, anchor_version=0, step=1
  )


def test_staleness_in_periods_by_hand():
  assert [staleness(s, 4) for s in (0, 3, 4, 5, 6, 8, 12)] == [0, 0, 0, 0.25, 0.5, 1.0, 2.0]


def test_weights_by_hand():
  rule = StalenessDiscountedMean(gamma=0.5)
  # A batch of 16 tokens: tokens² / steps = 256 · steps before the discount.
  assert rule.weight(_report(48, 3), H4) == 768.0  # H − τ steps: on time, not discounted.
  assert rule.weight(_report(64, 4), H4) == 1024.0  # A whole period: not discounted either.
  assert rule.weight(_report(128, 8), H4) == 2048.0 * 0.5  # One period beyond H: γ.
  assert rule.weight(_report(192, 12), H4) == 3072.0 * 0.25  # Two: γ².
  assert rule.weight(_report(96, 6), H4) == pytest.approx(1536.0 * 0.5**0.5, rel=1e-15)  # Half: √γ.
  assert rule.weight(_report(0, 8), H4) == 0.0  # No tokens: weight 0, as under every rule.
  # γ = 1 is the token weight; γ = 0 gives a stale answer weight 0 and an on-time one its own.
  assert StalenessDiscountedMean(gamma=1.0).weight(_report(128, 8), H4) == 2048.0
  assert StalenessDiscountedMean(gamma=0.0).weight(_report(128, 8), H4) == 0.0
  assert StalenessDiscountedMean(gamma=0.0).weight(_report(64, 4), H4) == 1024.0
  assert not StalenessDiscountedMean.needs_norms


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan"), "0.5"])
def test_gamma_out_of_range_is_refused(gamma):
  with pytest.raises(ValueError, match=r"StalenessDiscountedMean.gamma must be in \[0, 1\]"):
    StalenessDiscountedMean(gamma=gamma)


def test_where_the_arithmetic_is_exact_the_paths_are_bit_equal():
  """Steps 4 and 8 at H = 4: token weights 1024 and 2048, discounted to 1024 and 1024, so the
  coefficients are 1/2 and 1/2 (the token weights alone would give 1/3 and 2/3). With dyadic values
  every product and sum is exact in float32: both paths and the reference give the same bits."""
  v0 = np.array([1.0, -2.0, 0.5, 8.0], np.float32)
  v1 = np.array([4.0, 0.25, -1.0, 0.0], np.float32)
  answers = [Answer({"w": v0}, tokens=64, steps=4), Answer({"w": v1}, tokens=128, steps=8)]
  got = merge_round(StalenessDiscountedMean(gamma=0.5), answers, schedule=H4)
  assert got.weights == (1024.0, 1024.0)
  want = (v0 + v1) / 2
  for path in (got.fused["w"], got.blockwise["w"]):
    np.testing.assert_array_equal(path, want)


def test_both_paths_merge_as_the_reference():
  rng = np.random.default_rng(0)
  steps = (3, 4, 6, 12)  # On time, a period, half a period beyond, two periods beyond.
  answers = [
    Answer(
      {k: (0.05 * rng.standard_normal(300)).astype(np.float32) for k in ("w", "emb")},
      tokens=16 * s,
      steps=s,
      outer_gradient=m != 1,  # Learner 1 sends θ = 0 − v (the base is zeros).
    )
    for m, s in enumerate(steps)
  ]
  got = merge_round(
    StalenessDiscountedMean(gamma=0.5), answers, embedding_keys=("emb",), schedule=H4
  )
  # The reference: w_m = tokens² / steps · γ^(max(0, steps − H) / H), then Σ w v / Σ w in float64.
  ws = [(16 * s) ** 2 / s * 0.5 ** (max(s - 4, 0) / 4) for s in steps]
  np.testing.assert_allclose(got.weights, ws, rtol=1e-15)
  for key in ("w", "emb"):
    vs = [a.values[key].astype(np.float64) * (1 if a.outer_gradient else -1) for a in answers]
    want = sum(w * v for w, v in zip(ws, vs)) / sum(ws)
    # To float32 rounding, not bit for bit: the fused path sums the float32 terms in XLA's order,
    # the blockwise one in its own (tests/syncer/merge_rules_test.py). First order: the
    # coefficients' rounding (u), n = 4 products and sums (4u), the final rounding (u).
    for path in (got.fused[key], got.blockwise[key]):
      assert np.max(np.abs(path - want)) <= 6 * U32 * np.max(np.abs(want)), key


def test_the_core_files_answers_with_the_rules_weights():
  """A stale answer's weight reaches the learner and the merge event; with γ = 0 it weighs 0: it
  is accepted but neither counts toward the quorum nor merges, and the core says why."""
  init = {"w": np.zeros(4, np.float32)}
  for gamma, expected in ((0.5, 1024.0), (0.0, 0.0)):
    core = SyncerCore(
      fragment_keys=[["w"]],
      init_values=init,
      config=SyncerConfig(merge_rule=StalenessDiscountedMean(gamma=gamma), use_grace=False),
      clock=lambda: 0.0,
      schedule=H4,
    )
    core.open_round(0, 1)
    results = []
    for i, (tokens, steps) in enumerate(((64, 4), (128, 8))):
      core.register(i)
      core.fetch(i, 0)
      values = {"w": np.full(4, 0.25 * (i + 1), np.float32)}
      r = Report(
        learner_id=i,
        fragment=0,
        values=values,
        tokens=tokens,
        steps=steps,
        anchor_version=0,
        step=1,
        round_step=1,
        outer_gradient=True,
      )
      results.append(core.report(r))
    assert [(x.status, x.weight) for x in results] == [("accepted", 1024.0), ("accepted", expected)]
    (event,) = core.closer.flush()
    if gamma == 0.0:
      assert "StalenessDiscountedMean(gamma=0.0) gives it weight 0" in results[1].reason
      assert event.contributors == (0,) and core.stats()["zero_weight_reports"] == 1
    else:
      assert event.contributors == (0, 1) and event.weights == (1024.0, 1024.0)


def test_a_short_simulated_run_merges_with_it_and_learns(tmp_path):
  """sim_tiny with the rule bound in gin: 3 learners of 24 steps, P = 4, H = 8, τ = 1. Learners 1
  and 2 run at half speed, so the syncer's step clock (the median rate) runs at half learner 0's
  pace: it answers about 2 · 8 − 1 = 15 steps after each apply, beyond a period, and the rule
  discounts it (by γ^(7/8) at 15 steps)."""
  workdir = str(tmp_path / "sim")
  summary = configurables.simulate_files(
    [runs.config_path("sim_tiny.gin")],
    [
      "LEARNERS = 3",
      "STEPS = 24",
      "BATCH = 4",
      "SEQ_LEN = 32",
      "transformer_config.max_len = 32",
      "RunConfig.eval_every_s = 12.0",
      "RunConfig.eval_batches = 2",
      "InnerOptConfig.warmup_steps = 4",
      "FragmentSchedule.num_fragments = 4",
      "FragmentSchedule.period = 8",
      "FragmentSchedule.overlap = 1",
      "FAULTS = ('slow:1@0+1000x2.0', 'slow:2@0+1000x2.0')",
      "SyncerConfig.merge_rule = @StalenessDiscountedMean()",
      "StalenessDiscountedMean.gamma = 0.5",
    ],
    search_paths=[runs.CONFIGS],
    workdir=workdir,
    tensorboard=False,
  )
  assert summary["merges"] >= 8 and summary["digests_agree"] is True
  evals = read_events(workdir, "eval")
  assert evals[-1]["final"] and evals[-1]["loss"] == summary["final_eval_loss"]
  assert evals[-1]["loss"] < evals[0]["loss"] - 0.5  # Measured: 4.09 at t = 12 s, then 3.13.
  # Every learner's batch is 4 x 32 tokens: an answer's token weight is 128² · steps, a whole
  # multiple of 128²; a discounted one (by γ^s with 0 < s < 1) is not.
  weights = [w / 128**2 for m in read_events(workdir, "merge") for w in m["weights"]]
  discounted = [w for w in weights if abs(w - round(w)) > 1e-3]
  assert discounted, json.dumps(weights)
