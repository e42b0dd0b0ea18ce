"""One round merged both ways by a `SyncerCore`, for tests of merge rules (docs/algorithm.md §4.5).

`merge_round` files the same answers in two cores, one merging in the fused XLA program
(`outer.OuterStep.merge_and_step`) and one in numpy block by block (`merge.merge_reports`), and
reads each merged outer gradient back exactly: Θ_p starts at zeros and the outer step is SGD with
learning rate 1, so Θ_new = 0 − 1 · merge is the merge itself, negated, with no rounding of its own
(for float32 tensors; other dtypes are rounded by the cast back to them). A rule's test compares
both with a reference formula of its own.

`weighted_mean`, `rda` and `merge_outer_gradients` are the plain references: outer gradients given
whole, merged by `merge.merge_reports` (the syncer's blockwise merge, reading each as it is) and
returned in their own dtype.
"""

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import optax

from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import Report
from ddiloco.syncer import merge
from ddiloco.syncer.core import SyncerConfig, SyncerCore
from ddiloco.syncer.merge_rules import EPS, RDA, MergeRule, WeightedMean

_DEFAULT_RULE = WeightedMean()  # That of `merge_outer_gradients`, as SyncerConfig's.
_ROUND = 1  # The schedule step of the round the answers answer.
FUSED, BLOCKWISE = 0, 1 << 62  # `SyncerConfig.fused_merge_bytes`: every fragment fused, or none.


@dataclasses.dataclass(frozen=True)
class Answer:
  """One learner's answer to the round.

  Attributes:
    values: {key: array}: its outer gradient v_m (with `outer_gradient`), or its θ_m, merged as
      v_m = 0 − θ_m against the zero base.
    tokens: tokens since it applied the base.
    steps: inner steps since then.
    outer_gradient: whether `values` is v_m itself (as learners send it) or θ_m.
  """

  values: Mapping[str, np.ndarray]
  tokens: int
  steps: int
  outer_gradient: bool = True


class Merged(NamedTuple):
  """The round's merged outer gradient by each path, and the weights the answers were filed with."""

  fused: dict[str, np.ndarray]
  blockwise: dict[str, np.ndarray]
  weights: tuple[float, ...]


def _merge(
  rule: MergeRule,
  answers: Sequence[Answer],
  fused_bytes: int,
  embedding_keys: Collection[str],
  schedule: FragmentSchedule,
) -> tuple[dict[str, np.ndarray], tuple[float, ...]]:
  first = answers[0].values
  core = SyncerCore(
    fragment_keys=[sorted(first)],
    init_values={k: np.zeros(v.shape, v.dtype) for k, v in first.items()},
    config=SyncerConfig(
      merge_rule=rule,
      use_grace=False,
      fused_merge_bytes=fused_bytes,
      outer_optimizer=lambda: optax.sgd(1.0),
      max_update_ratio=0.0,
    ),
    clock=lambda: 0.0,
    embedding_keys=embedding_keys,
    schedule=schedule,
  )
  weights = []
  if core.open_round(0, _ROUND) is None:
    raise RuntimeError("The round did not open.")
  for i, a in enumerate(answers):
    core.register(i)
    core.fetch(i, 0)
    result = core.report(
      Report(
        learner_id=i,
        fragment=0,
        values={k: np.array(v) for k, v in a.values.items()},
        tokens=a.tokens,
        steps=a.steps,
        anchor_version=0,
        step=_ROUND,
        round_step=_ROUND,
        outer_gradient=a.outer_gradient,
      )
    )
    if result.status != "accepted":
      raise ValueError(f"Answer {i} was not filed: {result}")
    weights.append(result.weight)
  events = core.closer.flush()
  if len(events) != 1 or events[0].weights != tuple(w for w in weights if w > 0):
    raise RuntimeError(f"Expected one merge of the answers of weight > 0, got {events}.")
  return {k: -v for k, v in core.state(0).values.items()}, tuple(weights)


def merge_round(
  rule: MergeRule,
  answers: Sequence[Answer],
  *,
  embedding_keys: Collection[str] = (),
  schedule: FragmentSchedule | None = None,
) -> Merged:
  """Merges one round of `answers` by `rule` through the fused and the blockwise path.

  Args:
    rule: the merge rule.
    answers: one per learner, all with the same keys, shapes and dtypes; at least one of weight
      > 0 under `rule`.
    embedding_keys: keys merged with the weighted mean whatever the rule.
    schedule: the schedule the rule's weights see (`MergeRule.weight`); default P = 1, H = 4,
      τ = 1.

  Returns:
    Each path's merged outer gradient (in the tensors' dtypes) and the answers' weights.

  Raises:
    ValueError: if an answer is not filed (refused by the syncer's door).
    RuntimeError: if the round does not merge once, or the rule's weights differ between paths.
  """
  if schedule is None:
    schedule = FragmentSchedule(num_fragments=1, period=4, overlap=1)
  fused, weights = _merge(rule, answers, FUSED, embedding_keys, schedule)
  blockwise, again = _merge(rule, answers, BLOCKWISE, embedding_keys, schedule)
  if weights != again:
    raise RuntimeError(f"The rule weighed the same answers {weights}, then {again}.")
  return Merged(fused, blockwise, weights)


def merge_outer_gradients(
  grads: Sequence[Mapping[str, np.ndarray]],
  weights: Sequence[float],
  *,
  rule: MergeRule = _DEFAULT_RULE,
  embedding_keys: Collection[str] = (),
  eps: float = EPS,
) -> dict[str, np.ndarray]:
  """Merges per-learner outer gradients of one fragment, tensor by tensor (docs/algorithm.md §4.5).

  Args:
    grads: one {key: outer gradient} per learner, all with the same keys.
    weights: one weight per learner (see `MergeRule.weight`).
    rule: the merge rule of non-embedding tensors (default the weighted mean, as SyncerConfig's).
    embedding_keys: keys that always use the weighted mean; absent keys are ignored.
    eps: the rescale's guard (`merge.merge_reports`).

  Returns:
    {key: merged outer gradient}, keys in sorted order, each with its inputs' dtype.

  Raises:
    ValueError: as `merge.merge_reports`.
  """
  merged = merge.merge_reports(
    [None] * len(grads), grads, weights, rule=rule, embedding_keys=embedding_keys, eps=eps
  )
  return {k: v.astype(np.asarray(grads[0][k]).dtype, copy=False) for k, v in merged.items()}


def weighted_mean(vs: Sequence[np.ndarray], ws: Sequence[float]) -> np.ndarray:
  """Σ w v / Σ w of one tensor, accumulated in at least float32 (docs/algorithm.md §4.5)."""
  return merge_outer_gradients([{"v": v} for v in vs], ws, rule=WeightedMean(), eps=0.0)["v"]


def rda(vs: Sequence[np.ndarray], ws: Sequence[float], eps: float = EPS) -> np.ndarray:
  """Radial-Directional Averaging of one tensor (docs/algorithm.md §4.5, `merge_rules.RDA`):
  the weighted mean of the norms times the normalised weighted mean of the directions."""
  return merge_outer_gradients([{"v": v} for v in vs], ws, rule=RDA(eps=eps), eps=eps)["v"]
