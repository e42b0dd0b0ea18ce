"""Turning a round's answers into Θ_p's next values: the merge, the outer step and the per-fragment outer
optimizer states (docs/algorithm.md §4.3-4.6)."""

from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.syncer import blockwise
from ddiloco.syncer import merge as merge_lib
from ddiloco.syncer.merge_rules import EMBEDDING_RULE, MergeRule
from ddiloco.syncer.outer import OuterStep
from ddiloco.syncer.types import RoundEntry, SyncerConfig, readonly
from ddiloco.syncer.versions import VersionStore


def _value_limit(dtype: np.dtype) -> float:
  """The largest magnitude a merged value of `dtype` may take: a quarter of the dtype's range,
  so that casting it, and the downlink's Θ_new − Θ_old and its decoding, cannot overflow."""
  return float(jnp.finfo(dtype).max) / 4


class Update(NamedTuple):
  """A merge's result (`FragmentUpdater.updated`), not yet committed nor published."""

  values: dict[str, np.ndarray]  # Θ_p's next values, read-only.
  opt_state: optax.OptState  # The next optimizer state (`FragmentUpdater.commit`).
  summary: blockwise.Summary  # Their digest and norm (`VersionStore.publish`).


class FragmentUpdater:
  """One optax state per fragment and the programs that merge a round and step Θ_p with it.

  Reads Θ_p from the `VersionStore`; publishing the result is the caller's (`SyncerCore`).
  """

  def __init__(
    self,
    *,
    config: SyncerConfig,
    versions: VersionStore,
    optimizer: optax.GradientTransformation,
    embedding_keys: Collection[str],
    adopt: Callable[[int, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], dict] | None,
  ):
    self._config = config
    self._rule = config.merge_rule
    self._versions = versions
    self._embedding_keys = frozenset(embedding_keys)
    self._adopt = adopt
    self._opt = optimizer
    # The params and the optimizer state are not donated to the outer step (`outer.py`): float32
    # params go in as views of the global values (`_params32`), and the old optimizer state stays
    # valid until the step succeeded. Measured on 16 MiB: 8.5 ms against 12.1 ms for a donated
    # copy of the params and a donated state gated by `where` (a third pass over the state to undo
    # a failed step). What is donated is a spare set of output buffers per fragment (`_spare`):
    # the state a commit replaced, and XLA's new params once nothing reads them (adopted or cast
    # values are copies; float32 values published as they are stay XLA's, so no params part then).
    self._merge_out = blockwise.OutputBuffer()  # The merged outer gradients, every merge's.
    num = versions.num_fragments
    values = [versions.values(p) for p in range(num)]
    limits = {k: _value_limit(v.dtype) for vals in values for k, v in vals.items()}
    self._outer = OuterStep(self._opt, limits)
    # Fragments whose merge is fused with the outer step (`outer.py`): the large ones.
    self._fused = [
      sum(v.size for v in vals.values()) * 4 >= config.fused_merge_bytes for vals in values
    ]
    self._opt_state = [self._outer.init(self._params32(p)) for p in range(num)]
    # Per fragment: whether XLA's new params are free once `updated` returns (see above).
    self._reuse_params = [
      adopt is not None or all(v.dtype != np.float32 for v in vals.values()) for vals in values
    ]
    self._spare_params: list[dict | None] = [None] * num
    self._spare_state: list[optax.OptState | None] = [None] * num

  def updated(
    self, p: int, entries: list[RoundEntry], weights: tuple[float, ...], base: dict
  ) -> "Update":
    """Θ_p's next values (read-only arrays), the next optimizer state and the values' digest and
    norm (`Update`); changes nothing.

    Raises:
      FloatingPointError: if the outer step would produce a non-finite or out-of-range value, or
        the adopted values are not finite; or whatever the merge raises.
    """
    theta = self._versions.values(p)
    if self._fused[p]:
      new32, new_state, ok = self._merge_and_step(p, entries, weights, base)
    else:
      new32, new_state, ok = self._merge_then_step(p, entries, weights, base)
    if not bool(ok):
      self._spare_params[p], self._spare_state[p] = new32, new_state  # Read by nobody.
      raise FloatingPointError("the outer step produced a non-finite or out-of-range value")
    # A view of XLA's output for float32 (no copy); other dtypes are cast. Within the limits
    # checked by the step, the cast is finite.
    views = {k: np.asarray(new32[k], dtype=theta[k].dtype) for k in theta}
    new = views
    if self._adopt is not None:
      new = self._adopt(p, new, theta)
      new = {k: np.asarray(new[k], dtype=theta[k].dtype) for k in theta}
    # XLA's new params become the next spare only if no value kept from here is a view of them
    # (checked, not assumed: an adopter may return its input). A view held elsewhere would not be
    # overwritten either: jax does not donate a buffer with a live numpy view (it writes the
    # output into fresh memory instead), so donation can cost a fault, never a value.
    free = self._reuse_params[p] and not any(np.may_share_memory(new[k], views[k]) for k in theta)
    del views
    self._spare_params[p] = new32 if free else None
    # The digest and norm that publishing needs, and the adopted values' check, in one pass.
    summary = blockwise.summarize(new)
    if summary.non_finite:
      raise FloatingPointError(
        f"the published values of {list(summary.non_finite[:3])} are not finite"
      )
    return Update({k: readonly(v) for k, v in new.items()}, new_state, summary)

  def commit(self, p: int, new_state: optax.OptState) -> None:
    """Makes `new_state` (from `updated`) p's optimizer state; the state it replaces is read by
    nobody from here on and becomes the next merge's spare output memory (`outer.py`)."""
    self._spare_state[p], self._opt_state[p] = self._opt_state[p], new_state

  def _spare(self, p: int) -> tuple:
    """p's spare output buffers for the outer step (donated: taken from here), fresh if none."""
    params, state = self._spare_params[p], self._spare_state[p]
    self._spare_params[p] = self._spare_state[p] = None
    if not self._reuse_params[p]:
      params = None
    elif params is None:
      params = self._outer.spare(self._params32(p), None)[0]
    if state is None:
      state = self._outer.spare(None, self._opt_state[p])[1]
    return params, state

  def _merge_then_step(
    self, p: int, entries: list[RoundEntry], weights: tuple[float, ...], base: dict
  ) -> tuple:
    """The merge in numpy, then the outer step: (new params, new state, ok)."""
    # merge_reports forms each v_m block by block as it merges (no outer gradient is held whole)
    # and returns 64-byte-aligned arrays, which device_put hands to XLA without a copy.
    scales: dict[str, float] = {}
    merged = merge_lib.merge_reports(
      [None if e.report.outer_gradient else base for e in entries],
      [e.report.values for e in entries],
      weights,
      rule=self._rule,
      embedding_keys=self._embedding_keys,
      sq_norms=[e.sq_norms for e in entries],  # From filing: the norms' pass is done.
      out=self._merge_out,  # Reused: the outer step below is done with it when _merge returns.
      scales=scales,  # The rescale to the rule's radius: done by the outer step as it reads them.
    )
    return self._outer.step(self._params32(p), merged, scales, self._opt_state[p], self._spare(p))

  def _merge_and_step(
    self, p: int, entries: list[RoundEntry], weights: tuple[float, ...], base: dict
  ) -> tuple:
    """The merge and the outer step in one program (`outer.py`): (new params, new state, ok)."""
    coefs, radius = {}, {}
    for k, v in base.items():
      rule = self._rule_of(k)
      sq = None
      if rule.needs_norms:
        sq = {}
        for m, e in enumerate(entries):
          known = e.sq_norms.get(k) if e.sq_norms is not None else None
          if known is None:  # Not kept (a restored round): computed as filing does.
            anchor = None if e.report.outer_gradient else v
            known = merge_lib.finite_sq_norm(anchor, np.asarray(e.report.values[k]))
            if known is None:
              raise FloatingPointError(f"answer {m} to fragment {p} has a non-finite {k!r}")
          sq[m] = known
      coefs[k], radius[k] = rule.coefficients(weights, sq)
    return self._outer.merge_and_step(
      self._params32(p),
      base=base,
      answers=[e.report.values for e in entries],
      deltas=[e.report.outer_gradient for e in entries],
      coefs=coefs,
      radius=radius,
      opt_state=self._opt_state[p],
      spare=self._spare(p),
    )

  def warm_up(self, p: int, answers: int = 1, *, sent_as: np.dtype | None = None) -> None:
    """Compiles fragment p's outer step now, so that its first merge does not.

    A merge runs under the service's lock: a first merge that compiles holds every push, pull and
    heartbeat for the compile's time (0.1 s idle, seconds beside starting learners, for each of the
    P fragments). For a fragment merged inside its outer step (`SyncerConfig.fused_merge_bytes`)
    the program depends on the number of answers: `answers` δ answers are compiled for (the
    fleet's size is the common case; other counts compile at their first merge). The step runs
    once on the current values and zero outer gradients, and its results are discarded (only the
    spare output buffers are donated, and its outputs are the next spare): nothing else changes.
    Safe to call from several threads for different fragments, not beside a merge of p.

    `sent_as`: the dtype δ answers of float32 tensors arrive in, where the transport keeps them
    as sent (bf16: bfloat16, `transport.messages.kept_dtype`); the program depends on it. None:
    the tensors' own dtypes.

    Raises:
      ValueError: if answers < 1.
    """
    if answers < 1:
      raise ValueError(f"answers must be >= 1, got {answers}.")
    params = self._params32(p)
    zeros = {k: jnp.zeros(v.shape, jnp.float32) for k, v in params.items()}
    if not self._fused[p]:
      ones = {k: 1.0 for k in params}
      out = self._outer.step(params, zeros, ones, self._opt_state[p], self._spare(p))
      self._spare_params[p], self._spare_state[p] = out[0], out[1]  # Discarded: spare again.
      jax.block_until_ready(out)
      return
    values = {
      k: np.zeros(v.shape, sent_as if sent_as is not None and v.dtype == np.float32 else v.dtype)
      for k, v in self._versions.values(p).items()
    }
    # The program depends on which tensors the rules give a radius, not on the coefficients'
    # values: unit weights and norms stand in for the answers'.
    ones = (1.0,) * answers
    coefs, radius = {}, {}
    for k in params:
      rule = self._rule_of(k)
      coefs[k], radius[k] = rule.coefficients(
        ones, dict.fromkeys(range(answers), 1.0) if rule.needs_norms else None
      )
    out = self._outer.merge_and_step(
      params,
      base=None,
      answers=[values] * answers,
      deltas=[True] * answers,
      coefs=coefs,
      radius=radius,
      opt_state=self._opt_state[p],
      spare=self._spare(p),
    )
    self._spare_params[p], self._spare_state[p] = out[0], out[1]  # Discarded: spare again.
    jax.block_until_ready(out)

  def _rule_of(self, key: str) -> MergeRule:
    """The rule that merges tensor `key`: the weighted mean for embeddings (docs/algorithm.md
    §4.5), the configured rule otherwise."""
    return EMBEDDING_RULE if key in self._embedding_keys else self._rule

  def _params32(self, p: int) -> dict[str, np.ndarray | jax.Array]:
    """Θ_p in float32 for the outer step: float32 values as they are (numpy arrays; jit hands an
    aligned array to XLA without a copy, and they are not donated, so XLA never writes into them);
    other dtypes cast."""
    return {
      k: v if v.dtype == np.float32 else jnp.asarray(v, jnp.float32)
      for k, v in self._versions.values(p).items()
    }

  # -- checkpoints (`checkpoint.py`) ---------------------------------------------------------------

  def state_leaves(self, p: int) -> list:
    """The leaves of p's optimizer state, flattened."""
    return jax.tree_util.tree_leaves(self._opt_state[p])

  def state_from_leaves(
    self, p: int, num_leaves: int, leaf_at: Callable[[int], Any]
  ) -> optax.OptState:
    """p's optimizer state from a checkpoint's `num_leaves` leaves (`state_leaves`; leaf i is
    `leaf_at(i)`, read once the count fits), checked against the outer optimizer.

    Raises:
      ValueError: if the leaves do not fit the outer optimizer's state for p.
    """
    template, treedef = jax.tree_util.tree_flatten(self._opt.init(self._params32(p)))
    if num_leaves != len(template):
      raise ValueError(f"Optimizer state of fragment {p} does not match the outer optimizer.")
    out = []
    for i, t in enumerate(template):
      leaf = np.asarray(leaf_at(i))
      if leaf.shape != t.shape or leaf.dtype != t.dtype:
        raise ValueError(f"Optimizer leaf {i} of fragment {p} is {leaf.dtype}{leaf.shape}.")
      out.append(jnp.asarray(leaf))
    return jax.tree_util.tree_unflatten(treedef, out)

  def restore(self, opt_state: list[optax.OptState]) -> None:
    """Replaces every fragment's optimizer state (from `state_from_leaves`)."""
    self._opt_state = opt_state
    self._spare_state = [None] * len(opt_state)
