"""Merging learners' outer gradients with a merge rule, block by block (docs/algorithm.md §4.4–4.5).

A rule (`merge_rules.py`: RDA, the weighted mean, ...) gives each tensor's coefficients c_m and,
optionally, a radius; this module forms Σ_m c_m · v_m from the answers, and rescales it to the
radius. Pure numpy (and scipy's BLAS), no JAX: the syncer is a CPU service and these functions must
be easy to check by hand. Decisions (scripts/bench_merge.py):

- Precision: values are accumulated in their own precision, at least float32 (float32 for float32,
  bfloat16 and float16 inputs; float64 for float64). Squared norms are summed in float64 from
  per-block dot products. Against a float64 computation the float32 merge differs by a few float32
  ulps times the number of contributions (tests/syncer/merge_test.py states and checks the bound);
  the float32 outer step that follows rounds to float32 anyway (docs/algorithm.md §4.6).
- Speed: no full-size temporaries. Each tensor is processed in blocks of `BLOCK_VALUES` values
  that stay in cache (the kernel is in `blockwise.py`): per block, every contribution's v_m is formed in one scratch buffer and used
  at once (its squared norm, or `out += c_m · v_m` with BLAS axpy). A rule that reads the norms
  (`MergeRule.needs_norms`, RDA) needs two passes over the contributions (the norms must be known
  before the direction is summed); the weighted mean one.
- `merge_reports` takes the anchors and the learners' values and forms v_m = Θ^(a_m) − θ_m block by
  block, so the core never materialises the outer gradients (docs/algorithm.md §4.3); an outer
  gradient that arrived as such (a learner's δ, with no anchor) is read as it is. Its outputs are 64-byte
  aligned, which lets `jax.device_put` use them without a copy on the CPU backend, and may be
  written into a reused `OutputBuffer` (fresh memory costs page faults and zeroing).
- The norms' pass can move out of the merge: `finite_sq_norm` sums ‖v_m‖² in the same pass as a
  NaN/Inf check of θ_m, so the core does it when it files a report and passes the norms to
  `merge_reports` (`sq_norms=`), whose merge then takes one pass, with the same bits.
"""

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ddiloco.syncer.blockwise import BLOCK_VALUES, Diffs, OutputBuffer, aligned_empties
from ddiloco.syncer.merge_rules import (
  EMBEDDING_RULE,
  EPS,
  Coefficients,
  MergeRule,
  WeightedMean,
  check_rule,
)

_DEFAULT_RULE = WeightedMean()


def _check_inputs(
  vs: Sequence[np.ndarray], ws: Sequence[float]
) -> tuple[list[np.ndarray], np.ndarray]:
  """Validates a (values, weights) pair and returns them as arrays; weights as float64.

  The values may differ in dtype where they are merged in the same one (`Diffs.dtype`): an
  outer gradient kept as the bf16 uplink sent it (bfloat16, `protocol.holds_values_of`) beside
  float32 ones (a restored round's), each widened exactly as it is read.
  """
  if len(vs) != len(ws):
    raise ValueError(f"Got {len(vs)} values but {len(ws)} weights.")
  if not vs:
    raise ValueError("Nothing to merge: no values given.")
  arrays = [np.asarray(v) for v in vs]
  shape, dtype = arrays[0].shape, arrays[0].dtype
  acc = np.promote_types(dtype, np.float32)
  for i, a in enumerate(arrays):
    if a.shape != shape:
      raise ValueError(f"Shape mismatch: values[0] has {shape}, values[{i}] has {a.shape}.")
    if a.dtype != dtype and np.promote_types(a.dtype, np.float32) != acc:
      raise ValueError(f"Dtype mismatch: values[0] is {dtype}, values[{i}] is {a.dtype}.")
  w = np.asarray(ws, dtype=np.float64)
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"Weights must be finite and >= 0, got {list(ws)}.")
  if w.sum() <= 0:
    raise ValueError(f"Weights must have a positive sum, got {list(ws)}.")
  return arrays, w


def _combine(diffs: Diffs, c: Coefficients, eps: float) -> tuple[np.ndarray, float]:
  """(Σ c.coefs[m] · v_m, scale): the merge is the sum times the scale (see `Coefficients`)."""
  if not c.coefs:
    out = diffs.output()
    out[...] = 0
    return out, 0.0
  total, sq = diffs.combine(c.coefs)
  if c.radius is None:
    return total, 1.0
  # Rescaled to the radius: radius · total / ‖total‖ (RDA: the direction to the mean norm).
  norm = sq**0.5
  if norm <= eps:
    total[...] = 0
    return total, 0.0
  return total, c.radius / norm


def _merge_one(
  pairs: Sequence[tuple[np.ndarray, np.ndarray | None]],
  w: np.ndarray,
  rule: MergeRule,
  eps: float,
  *,
  known: Mapping[int, float] | None = None,
  out: np.ndarray | None = None,
  defer_scale: bool = False,
) -> tuple[np.ndarray, float]:
  """One tensor's merge by `rule`, into `out` (flat, the accumulation dtype) if given, and its scale.

  The merge is `values · scale`; the scale is applied here (and 1.0 returned) unless
  `defer_scale`. The product is rounded once, in the accumulation dtype, either way.
  """
  diffs = Diffs(pairs, BLOCK_VALUES, out)
  sq = None
  if rule.needs_norms:
    known = known or {}
    members = [m for m, wm in enumerate(w) if wm > 0]
    computed = diffs.sq_norms([m for m in members if m not in known])  # The first of two passes.
    sq = {m: known[m] if m in known else computed[m] for m in members}  # In order: same sums.
  out, scale = _combine(diffs, rule.coefficients(w, sq), eps)
  if not defer_scale and scale != 1.0:
    out *= diffs.dtype.type(scale)
    scale = 1.0
  return out.reshape(np.shape(pairs[0][0])), scale


def outer_sq_norms(
  anchor: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]
) -> dict[str, float]:
  """{key: ‖anchor[key] − values[key]‖²}, computed exactly as `merge_reports` computes them.

  RDA needs every contribution's norm before it can sum the directions, hence its second pass
  over the contributions. A caller that knows a report's anchor when the report arrives (the
  syncer core does) can compute them then, off the merge's critical path, and hand them to
  `merge_reports`, whose result is then bit-identical and takes one pass.

  Raises:
    ValueError: if the keys, shapes or dtypes differ.
  """
  keys = _check_keys([values, anchor], "values and anchor")
  out = {}
  for key in keys:
    (a, v), _ = _check_inputs([anchor[key], values[key]], [1.0, 1.0])
    out[key] = Diffs([(a, v)], BLOCK_VALUES).sq_norms([0])[0]
  return out


def finite_sq_norm(anchor: np.ndarray | None, value: np.ndarray) -> float | None:
  """‖anchor − value‖² (‖value‖² for a None anchor: `value` is then the outer gradient itself)
  exactly as `merge_reports` computes it, or None if `value` has a NaN/Inf.

  The door's finiteness check and RDA's first pass in one pass over `value`: per block,
  v = anchor − value and its dot product. A finite dot product proves the block of `value` finite
  (a NaN or ±Inf in `value` makes v, then v·v, NaN or Inf, whatever `anchor` holds); a non-finite
  one (also an overflow of finite values) is settled by checking that block of `value` itself. So
  None means exactly "`value` has a non-finite value", as `all_finite` would say.

  Args:
    anchor: Θ^(anchor) of one tensor, or None.
    value: θ_m of the same tensor, with the same shape and dtype (or δ_m).

  Returns:
    The squared norm (a float, bit-equal to `merge_reports`'s), or None.

  Raises:
    ValueError: if the shapes or dtypes differ.
  """
  if anchor is None:
    (v,), _ = _check_inputs([value], [1.0])
    diffs = Diffs([(v, None)], BLOCK_VALUES)
    flat = diffs.a[0]
  else:
    (a, v), _ = _check_inputs([anchor, value], [1.0, 1.0])
    diffs = Diffs([(a, v)], BLOCK_VALUES)
    flat = diffs.b[0]
  sq = 0.0
  with np.errstate(invalid="ignore", over="ignore"):  # Bad input is an answer here, not a warning.
    for start in range(0, diffs.size, BLOCK_VALUES):
      stop = min(start + BLOCK_VALUES, diffs.size)
      block = diffs.block(0, start, stop)
      dot = float(np.dot(block, block))
      if not math.isfinite(dot) and not np.isfinite(flat[start:stop]).all():
        return None
      sq += dot  # As `Diffs.sq_norms` sums: the same blocks, in the same order.
  return sq


def _check_counts(rule: MergeRule, n: int, weights: Sequence[float], what: str) -> None:
  check_rule(rule, "rule")
  if n != len(weights):
    raise ValueError(f"Got {n} {what} but {len(weights)} weights.")
  if not n:
    raise ValueError(f"Nothing to merge: no {what} given.")


def _check_keys(maps: Sequence[Mapping[str, np.ndarray]], what: str) -> list[str]:
  keys = sorted(maps[0])
  for i, g in enumerate(maps):
    if sorted(g) != keys:
      raise ValueError(f"{what}[{i}] has keys {sorted(g)}, {what}[0] has {keys}.")
  return keys


def merge_reports(
  anchors: Sequence[Mapping[str, np.ndarray] | None],
  values: Sequence[Mapping[str, np.ndarray]],
  weights: Sequence[float],
  *,
  rule: MergeRule = _DEFAULT_RULE,
  embedding_keys: Collection[str] = (),
  eps: float = EPS,
  sq_norms: Sequence[Mapping[str, float] | None] | None = None,
  out: OutputBuffer | None = None,
  scales: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
  """Merges the outer gradients v_m = anchors[m] − values[m] without forming them (docs/algorithm.md §4.3–4.5).

  v_m is formed block by block as it is used, with the differences taken in the accumulation
  dtype, so no outer gradient is ever held whole (see the module docstring). Reports that share an anchor
  may pass the same mapping. A None anchor means values[m] is the outer gradient itself (as a
  learner sends it, δ = Θ^(anchor) − θ); it is read as it is.

  Args:
    anchors: per learner, Θ^(anchor) of the fragment, {key: array}, or None.
    values: per learner, its θ_m (or its δ_m, for a None anchor) with the same keys, shapes and
      dtypes.
    weights: one weight per learner (`MergeRule.weight`); learners of weight 0 are not read.
    rule: the merge rule of non-embedding tensors (default the weighted mean, as SyncerConfig's).
    embedding_keys: keys merged with the weighted mean (docs/algorithm.md §4.5); absent keys are ignored.
    eps: the rescale's guard: a sum whose norm is at or below it merges to zeros when the rule
      gives a radius (`Coefficients`).
    sq_norms: per learner, `outer_sq_norms(anchors[m], values[m])` if already known, or None.
      A rule that reads the norms then skips its first pass for those learners; the result is the
      same bits.
    out: where the results are written (their memory is reused by the next merge into `out`);
      None: fresh memory.
    scales: if given, the rescale to the rule's radius (RDA's last step, scaling the summed
      direction to the radius) is left to the caller: the returned arrays are unscaled and
      `scales[key]` receives each tensor's factor (1.0 without a radius). A caller that reads
      the results once anyway (the outer step) saves a pass over them.

  Returns:
    {key: merged outer gradient}, keys in sorted order, in the accumulation dtype (float32 for
    float32/bfloat16/float16 values), 64-byte aligned.

  Raises:
    ValueError: on a rule that is not a `MergeRule`, mismatched keys, lengths, shapes or dtypes,
      or invalid weights.
  """
  _check_counts(rule, len(values), weights, "reports")
  if len(anchors) != len(values):
    raise ValueError(f"Got {len(anchors)} anchors but {len(values)} reports.")
  if sq_norms is None:
    sq_norms = [None] * len(values)
  if len(sq_norms) != len(values):
    raise ValueError(f"Got {len(sq_norms)} sq_norms but {len(values)} reports.")
  keys = _check_keys(list(values) + [a for a in anchors if a is not None], "values and anchors")
  inputs = {}
  for key in keys:
    vs, w = _check_inputs([v[key] for v in values], weights)
    pairs = []
    for anchor, v in zip(anchors, vs):
      if anchor is None:
        pairs.append((v, None))  # v_m as given.
        continue
      a = np.asarray(anchor[key])
      if a.shape != v.shape or a.dtype != v.dtype:
        raise ValueError(
          f"{key!r}: anchors are {a.dtype}{list(a.shape)}, values {v.dtype}{list(v.shape)}."
        )
      pairs.append((a, v))
    inputs[key] = (pairs, w)
  # The first pair's array (either element: their sizes and dtypes are checked equal).
  firsts = [p[0][0] for p, _ in inputs.values()]
  specs = [(a.size, np.promote_types(a.dtype, np.float32)) for a in firsts]
  flats = aligned_empties(specs) if out is None else out.arrays(specs)
  merged = {}
  for (key, (pairs, w)), flat in zip(inputs.items(), flats):
    use = EMBEDDING_RULE if key in embedding_keys else rule
    known = {m: float(sq[key]) for m, sq in enumerate(sq_norms) if sq is not None and key in sq}
    merged[key], scale = _merge_one(
      pairs, w, use, eps, known=known, out=flat, defer_scale=scales is not None
    )
    if scales is not None:
      scales[key] = scale
  return merged
