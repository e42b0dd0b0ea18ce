"""Merging learners' outer gradients: token weights, weighted mean and RDA (SPEC §4.4–4.5).

Pure numpy, no JAX: the syncer is a CPU service and these functions must be easy to check by hand.
Every function accumulates in float64 and returns the dtype of its inputs.
"""

from collections.abc import Collection, Mapping, Sequence

import numpy as np

MERGE_METHODS = ("rda", "mean")


def token_weight(tokens: int, steps: int) -> float:
  """Token weight ("quantity x quality") of one report, SPEC §4.4: tokens² / steps.

  `tokens / steps` is the learner's batch size (quality: a learner that lost chips runs a smaller batch)
  and `tokens` is how much it trained since it last received the fragment (quantity).

  Args:
    tokens: tokens consumed since the learner last received the fragment.
    steps: inner steps over which they were consumed.

  Returns:
    tokens**2 / steps, or 0.0 when either counter is 0 (an absent learner weighs 0).

  Raises:
    ValueError: if a counter is negative.
  """
  if tokens < 0 or steps < 0:
    raise ValueError(f"Counters must be >= 0, got tokens={tokens}, steps={steps}.")
  if tokens == 0 or steps == 0:
    return 0.0
  # Python ints: tokens**2 is exact before the single rounding of the division.
  return float(int(tokens) ** 2 / int(steps))


def _check_inputs(
  vs: Sequence[np.ndarray], ws: Sequence[float]
) -> tuple[list[np.ndarray], np.ndarray]:
  """Validates a (values, weights) pair and returns them as arrays; weights as float64."""
  if len(vs) != len(ws):
    raise ValueError(f"Got {len(vs)} values but {len(ws)} weights.")
  if not vs:
    raise ValueError("Nothing to merge: no values given.")
  arrays = [np.asarray(v) for v in vs]
  shape, dtype = arrays[0].shape, arrays[0].dtype
  for i, a in enumerate(arrays):
    if a.shape != shape:
      raise ValueError(f"Shape mismatch: values[0] has {shape}, values[{i}] has {a.shape}.")
    if a.dtype != dtype:
      raise ValueError(f"Dtype mismatch: values[0] is {dtype}, values[{i}] is {a.dtype}.")
  w = np.asarray(ws, dtype=np.float64)
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"Weights must be finite and >= 0, got {list(ws)}.")
  if w.sum() <= 0:
    raise ValueError(f"Weights must have a positive sum, got {list(ws)}.")
  return arrays, w


def weighted_mean(vs: Sequence[np.ndarray], ws: Sequence[float]) -> np.ndarray:
  """Σ w v / Σ w, accumulated in float64 and cast back to the inputs' dtype (SPEC §4.5, embeddings).

  Args:
    vs: arrays of one shape and dtype.
    ws: one non-negative weight per array.

  Returns:
    The weighted mean, with the shape and dtype of the inputs.

  Raises:
    ValueError: on mismatched lengths, shapes or dtypes, negative weights, or Σ w <= 0.
  """
  arrays, w = _check_inputs(vs, ws)
  acc = np.zeros(arrays[0].shape, np.float64)
  for wi, a in zip(w, arrays):
    if wi > 0:
      acc += wi * a.astype(np.float64)
  return (acc / w.sum()).astype(arrays[0].dtype)


def rda(vs: Sequence[np.ndarray], ws: Sequence[float], eps: float = 1e-12) -> np.ndarray:
  """Radial-Directional Averaging of one tensor, SPEC §4.5.

  `(Σ w‖v‖ / Σ w) · unit(Σ w unit(v) / Σ w)`: the radius is the weighted mean of the norms and the
  direction the normalised weighted mean of the directions, so near-orthogonal updates do not shrink
  like 1/√M as they do under a plain mean.

  Zero norms are guarded: a v with ‖v‖ <= eps adds 0 to the radius sum and no direction (its weight still
  counts in Σ w); if the directions cancel (‖Σ w unit(v)‖ / Σ w <= eps) the result is zeros.

  Args:
    vs: arrays of one shape and dtype (outer gradients of one tensor).
    ws: one non-negative weight per array.
    eps: norms at or below this are treated as zero.

  Returns:
    The RDA merge, with the shape and dtype of the inputs.

  Raises:
    ValueError: on mismatched lengths, shapes or dtypes, negative weights, or Σ w <= 0.
  """
  arrays, w = _check_inputs(vs, ws)
  total = w.sum()
  radius = 0.0
  direction = np.zeros(arrays[0].shape, np.float64)
  for wi, a in zip(w, arrays):
    if wi == 0:
      continue
    a64 = a.astype(np.float64)
    norm = float(np.linalg.norm(a64.ravel()))
    if norm <= eps:
      continue
    radius += wi * norm
    direction += (wi / norm) * a64
  radius /= total
  direction /= total
  dir_norm = float(np.linalg.norm(direction.ravel()))
  if dir_norm <= eps or radius <= eps:
    return np.zeros(arrays[0].shape, arrays[0].dtype)
  return (direction * (radius / dir_norm)).astype(arrays[0].dtype)


def merge_outer_gradients(
  grads: Sequence[Mapping[str, np.ndarray]],
  weights: Sequence[float],
  *,
  method: str = "rda",
  embedding_keys: Collection[str] = (),
) -> dict[str, np.ndarray]:
  """Merges per-learner outer gradients of one fragment, tensor by tensor (SPEC §4.5).

  Args:
    grads: one {key: outer gradient} per learner, all with the same keys.
    weights: one token weight per learner (see `token_weight`).
    method: "rda" (default, SPEC §4.5) or "mean" (the ablation) for non-embedding tensors.
    embedding_keys: keys that always use the weighted mean (input embedding and unembedding: decision,
      SPEC §4.5). Keys not present in `grads` are ignored, so the full model's set may be passed.

  Returns:
    {key: merged outer gradient}, keys in sorted order.

  Raises:
    ValueError: on an unknown method, mismatched key sets or lengths, or invalid weights.
  """
  if method not in MERGE_METHODS:
    raise ValueError(f"Unknown merge method {method!r}; expected one of {MERGE_METHODS}.")
  if len(grads) != len(weights):
    raise ValueError(f"Got {len(grads)} gradients but {len(weights)} weights.")
  if not grads:
    raise ValueError("Nothing to merge: no gradients given.")
  keys = sorted(grads[0])
  for i, g in enumerate(grads):
    if sorted(g) != keys:
      raise ValueError(f"grads[{i}] has keys {sorted(g)}, grads[0] has {keys}.")
  out = {}
  for key in keys:
    vs = [g[key] for g in grads]
    if key in embedding_keys or method == "mean":
      out[key] = weighted_mean(vs, weights)
    else:
      out[key] = rda(vs, weights)
  return out
