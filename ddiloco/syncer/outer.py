"""The outer step, and the merge fused with it for large fragments (docs/algorithm.md §4.5-4.6).

A merge reads every answer's outer gradient once, combines them with the coefficients of the merge
rule (`merge_rules.py`: RDA, the weighted mean, ...) and hands the result to the optax outer
optimizer. Two ways, the same mathematics:

- `OuterStep.step`: the merge is done in numpy (`merge.merge_reports`, block by block into a
  reused buffer) and the jitted optax update reads its result. One compiled program per fragment.
- `OuterStep.merge_and_step`: one XLA program reads the answers, forms each outer gradient
  (δ_m as sent, or Θ^(base) − θ_m), combines them with the rule's coefficients, rescales the sum to
  the rule's radius where it gives one (RDA's direction to its radius) and applies the optax update, in one pass over the answers, without
  writing the merged gradient anywhere. Measured on 8 answers of 16 MiB
  (scripts/bench_merge.py): about 1.2x one read of the answers, against about 2.5x for the numpy
  merge followed by the step. Its program depends on the number of answers, so each new answer
  count costs a compile (~0.2 s): `SyncerCore` uses it for fragments of at least
  `SyncerConfig.fused_merge_bytes`, where a merge takes long enough that compiling pays back.

Both check their result: `ok` is False if a new value is non-finite or beyond its limit (a bound
that keeps the cast to the tensor's own dtype and the downlink codec's arithmetic finite), or the
new optimizer state has a non-finite value. The params, answers and state are not donated, so they
stay valid whatever `ok` says: the caller keeps the old state and discards the new values when it
is False (a merge is all or nothing). What is donated is `spare`: buffers nobody reads any more
(the previous merge's discarded outputs, the state a merge replaced), shaped like the new params
and the new state, which XLA writes the outputs into instead of fresh memory (fresh output memory
cost thousands of minor page faults per merge). The checks compare value by value, which catches
a NaN (NaN <= limit is False) whatever the backend's max does with one.
Float32 inputs reach XLA without a copy: 64-byte-aligned numpy arrays are passed to the jitted
program as they are (its C++ dispatch wraps them; a `jax.device_put` per array cost more).
"""

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.syncer.merge_rules import EPS

Arrays = Mapping[str, np.ndarray | jax.Array]


def _checked(limits, params, grads, opt_state, opt):
  updates, new_state = opt.update(grads, opt_state, params)
  new = optax.apply_updates(params, updates)
  ok = jnp.array(True)
  for k, v in new.items():
    ok &= _all_within(v, limits[k])
  for leaf in jax.tree_util.tree_leaves(new_state):
    if jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size:
      ok &= jnp.all(jnp.isfinite(leaf))
  return new, new_state, ok


def _all_within(v, limit):
  """Whether every |v| <= limit, False if v has a NaN: value by value (NaN <= limit is False).

  Not from `max |v|`: XLA's CPU backend reduces a max or min of 100K values or more in a library
  kernel that skips NaN (`jnp.max` of a large array holding one NaN is a number there), so a
  check on the max would let a NaN through (tests/syncer/outer_test.py)."""
  return jnp.all(jnp.abs(v) <= limit)


def _step(opt, limits, inputs, state, spare):
  """inputs: (params, grads, scales): the step on the gradients grads[k] · scales[k]."""
  del spare  # Donated: its buffers hold the outputs.
  params, grads, scales = inputs
  grads = {k: g * scales[k] for k, g in grads.items()}
  return _checked(limits, params, grads, state, opt)


def _merge_and_step(step, plan, inputs, state, spare):
  """step: (opt, limits).

  plan (static): (deltas, radius_keys, eps): `deltas[m]`, whether answers[m] is δ_m (else θ_m,
  against `base`); `radius_keys`, the keys whose sum is rescaled to a radius (RDA's; the others
  are the sum itself); `eps`, the rescale's zero-norm guard. inputs: (params, base, answers, coefs,
  radius): coefs[k], (M,) float32; radius[k], float32."""
  del spare  # Donated: its buffers hold the outputs.
  deltas, radius_keys, eps = plan
  params, base, answers, coefs, radius = inputs
  grads = {}
  for k, p in params.items():
    g = None
    for m, answer in enumerate(answers):
      v = answer[k].astype(jnp.float32)
      if not deltas[m]:
        v = base[k].astype(jnp.float32) - v
      term = coefs[k][m] * v
      g = term if g is None else g + term
    if k in radius_keys:
      norm = jnp.sqrt(jnp.vdot(g, g))
      g = jnp.where(norm > eps, g * (radius[k] / jnp.maximum(norm, eps)), jnp.zeros_like(g))
    grads[k] = g.reshape(p.shape)
  opt, limits = step
  return _checked(limits, params, grads, state, opt)


class OuterStep:
  """One syncer's outer step (see the module docstring): optax `optimizer`, per-key value limits."""

  def __init__(
    self,
    optimizer: optax.GradientTransformation,
    limits: Mapping[str, float],
    *,
    eps: float = EPS,
  ):
    self._opt = optimizer
    self._eps = float(eps)
    limits = dict(limits)
    # keep_unused: `spare` is not read, and an unused argument would be dropped with its donation.
    self._step = jax.jit(
      functools.partial(_step, optimizer, limits), donate_argnums=2, keep_unused=True
    )
    self._fused = jax.jit(
      functools.partial(_merge_and_step, (optimizer, limits)),
      static_argnums=0,
      donate_argnums=3,
      keep_unused=True,
    )

  def init(self, params32: Arrays):
    """The optimizer state for float32 params."""
    return self._opt.init(params32)

  def spare(self, params32: Arrays | None, opt_state):
    """Fresh `spare` buffers: zeros shaped like `params32` (None: no params part) and the state."""

    def zeros(tree):
      return jax.tree_util.tree_map(lambda v: jnp.zeros(v.shape, v.dtype), tree)

    return (None if params32 is None else zeros(dict(params32)), zeros(opt_state))

  def step(
    self,
    params32: Arrays,
    grads: Arrays,
    scales: Mapping[str, float],
    opt_state,
    spare: tuple | None = None,
  ):
    """(new params, new state, ok) for the merged outer gradients `grads[k] · scales[k]`.

    `scales` are RDA's last factor (`merge.merge_reports(scales=...)`), applied here as the
    step reads the gradients rather than in a pass of their own. `spare` (donated: invalid
    afterwards) is (params-shaped float32 arrays or None, a state's arrays), see the module
    docstring; None: fresh ones (`spare()`).
    """
    if spare is None:
      spare = self.spare(params32, opt_state)
    scales32 = {k: np.float32(f) for k, f in scales.items()}
    return self._step((params32, dict(grads), scales32), opt_state, spare)

  def merge_and_step(
    self,
    params32: Arrays,
    *,
    base: Arrays | None,
    answers: Sequence[Arrays],
    deltas: Sequence[bool],
    coefs: Mapping[str, Mapping[int, float]],
    radius: Mapping[str, float | None],
    opt_state,
    spare: tuple | None = None,
  ):
    """(new params, new state, ok): merges the answers and applies the step in one program.

    Args:
      params32: Θ_p in float32.
      base: Θ^(base) in the tensors' dtypes, needed if an answer is θ (not δ).
      answers: per answer, its values ({key: array}, the tensors' dtypes).
      deltas: per answer, whether it is δ_m (else θ_m).
      coefs: per key, {answer index: coefficient} (`MergeRule.coefficients`); absent answers
        weigh 0.
      radius: per key, the radius the sum is rescaled to (RDA's), or None: the sum as it is.
      opt_state: the optimizer state.
      spare: donated buffers for the outputs, as in `step` (None: fresh ones).
    """
    n = len(answers)
    if len(deltas) != n or not n:
      raise ValueError(f"Got {n} answers and {len(deltas)} kinds; need one kind per answer, >= 1.")
    c = {k: np.array([coefs[k].get(m, 0.0) for m in range(n)], np.float32) for k in params32}
    radius_keys = frozenset(k for k in params32 if radius[k] is not None)
    r = {k: np.float32(radius[k] or 0.0) for k in params32}
    if base is None and not all(deltas):
      raise ValueError("An answer of θ (not δ) needs the base values.")
    # numpy arrays go to the program as they are: jit hands an aligned array to XLA without a
    # copy, in its C++ dispatch (a `jax.device_put` per answer cost ~0.1 ms per array in Python).
    base = dict(base) if base is not None and not all(deltas) else None
    answers = tuple(dict(a) for a in answers)
    plan = (tuple(bool(d) for d in deltas), radius_keys, self._eps)
    if spare is None:
      spare = self.spare(params32, opt_state)
    return self._fused(plan, (params32, base, answers, c, r), opt_state, spare)
