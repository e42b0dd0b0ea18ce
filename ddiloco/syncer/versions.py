"""The syncer's published versions of every fragment: current values, version numbers, digests and the
kept recent versions (docs/algorithm.md §4.3, §4.7)."""

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ddiloco.fragments.digest import values_digest
from ddiloco.syncer import blockwise
from ddiloco.syncer.types import FragmentState, readonly


def norm(values: Mapping[str, np.ndarray]) -> float:
  """‖values‖ over all tensors: float32 blocks (no full-size temporary), summed in float64."""
  sq = 0.0
  with np.errstate(over="ignore"):
    for v in values.values():
      flat = np.asarray(v).reshape(-1)
      for start in range(0, flat.size, blockwise.BLOCK_VALUES):
        block = flat[start : start + blockwise.BLOCK_VALUES].astype(np.float32, copy=False)
        sq += float(np.dot(block, block))
  return math.sqrt(sq)


def non_finite(key: str, v: np.ndarray) -> str:
  """The reason for refusing a tensor with NaN/Inf: counted on this failure path only."""
  bad = v.size - int(np.count_nonzero(np.isfinite(v)))
  return f"{key!r} has non-finite values ({bad} NaN/Inf of {v.size})"


class VersionStore:
  """Θ_p of every fragment at its current version, with the last `keep_versions` versions kept.

  Values are read-only arrays, shared by every reader and never mutated: a new version replaces a
  fragment's dict. Not thread-safe (the core's owner locks).

  A syncer shard's store owns only some fragments (`owned`, fragments/shards.py): it holds values
  only for those; every other fragment stays at version 0 with no values (empty dicts), so its
  memory scales with its share of the model. Fragment ids stay global.
  """

  def __init__(
    self,
    fragment_keys: Sequence[Sequence[str]],
    init_values: Mapping[str, np.ndarray],
    keep_versions: int,
    owned: Collection[int] | None = None,
  ):
    """Holds version 0 of every owned fragment: `init_values`, copied.

    Args:
      fragment_keys: per fragment (all of the layout's), its parameter keys.
      init_values: the initial value of every key of the owned fragments (keys of other fragments
        may be present: they are not read).
      keep_versions: versions kept per fragment.
      owned: the fragments this store holds (default: all).

    Raises:
      ValueError: if fragments are empty or overlap, keys and init_values disagree, a value is
        not a floating array, or `owned` names no fragment or an unknown one.
    """
    self._keys = tuple(tuple(ks) for ks in fragment_keys)
    if not self._keys or any(not ks for ks in self._keys):
      raise ValueError("Need at least one fragment, and every fragment needs at least one key.")
    all_keys = [k for ks in self._keys for k in ks]
    if len(set(all_keys)) != len(all_keys):
      raise ValueError("A key appears in more than one fragment (or twice in one).")
    num = len(self._keys)
    self._owned = frozenset(range(num)) if owned is None else frozenset(int(p) for p in owned)
    if not self._owned or not all(0 <= p < num for p in self._owned):
      raise ValueError(f"owned must name some of the fragments 0..{num - 1}, got {sorted(owned)}.")
    held_keys = {k for p in self._owned for k in self._keys[p]}
    if not held_keys <= set(init_values) or not set(init_values) <= set(all_keys):
      missing = sorted(held_keys - set(init_values))[:3]
      extra = sorted(set(init_values) - set(all_keys))[:3]
      raise ValueError(f"fragment_keys and init_values disagree: missing {missing}, extra {extra}.")
    self._keep = keep_versions
    self._global: list[dict[str, np.ndarray]] = []
    for p, ks in enumerate(self._keys):
      vals = {}
      for k in ks if p in self._owned else ():
        a = np.array(init_values[k], copy=True)
        if not jnp.issubdtype(a.dtype, jnp.floating):
          raise ValueError(f"{k!r} has dtype {a.dtype}; only floating parameters can be synced.")
        vals[k] = readonly(a)
      self._global.append(vals)
    self._version = [0] * num
    self._digest = [values_digest(v) for v in self._global]
    # ‖Θ_p‖ of each current version: the scale of the plausibility bound (`admission.py`).
    self._theta_norm = [norm(v) for v in self._global]
    self._history: list[dict[int, dict[str, np.ndarray]]] = [{0: v} for v in self._global]

  @property
  def num_fragments(self) -> int:
    return len(self._keys)

  @property
  def owned(self) -> frozenset[int]:
    """The fragments this store holds values of (all but on a syncer shard)."""
    return self._owned

  def keys(self, p: int) -> tuple[str, ...]:
    """The parameter keys of fragment p this store holds, in the layout's order (none if not owned)."""
    return self._keys[p] if p in self._owned else ()

  def version(self, p: int) -> int:
    return self._version[p]

  def versions(self) -> list[int]:
    """The current version of every fragment."""
    return list(self._version)

  def values(self, p: int) -> dict[str, np.ndarray]:
    """Θ_p's current values (read-only arrays; the store's own dict: not to be mutated)."""
    return self._global[p]

  def digest(self, p: int) -> str:
    return self._digest[p]

  def theta_norm(self, p: int) -> float:
    """‖Θ_p‖ of the current version."""
    return self._theta_norm[p]

  def kept(self, p: int, version: int) -> bool:
    return version in self._history[p]

  def kept_versions(self, p: int) -> dict[int, dict[str, np.ndarray]]:
    """{version: values} of fragment p's kept versions (a new dict of the shared values)."""
    return dict(self._history[p])

  def anchor(self, p: int, version: int) -> dict[str, np.ndarray]:
    """The kept `version` of Θ_p, as stored (KeyError if not kept)."""
    return self._history[p][version]

  def state(self, p: int) -> FragmentState:
    return FragmentState(p, self._version[p], dict(self._global[p]), self._digest[p])

  def state_at(self, p: int, version: int) -> FragmentState:
    """A kept version of Θ_p with its digest (KeyError if not kept)."""
    values = self.values_at(p, version)
    digest = self._digest[p] if version == self._version[p] else values_digest(values)
    return FragmentState(p, version, values, digest)

  def values_at(self, p: int, version: int) -> dict[str, np.ndarray]:
    """A kept version of Θ_p's values, unhashed (KeyError if not kept)."""
    if version not in self._history[p]:
      raise KeyError(f"Version {version} of fragment {p} is not kept ({sorted(self._history[p])}).")
    return dict(self._history[p][version])

  def publish(
    self, p: int, new: dict[str, np.ndarray], summary: blockwise.Summary | None = None
  ) -> None:
    """Makes `new` (read-only arrays) Θ_p at version + 1 (a merge).

    `summary`: `blockwise.summarize(new)` if the caller has it (its pass over `new` is then not
    made again); the digest and norm are the same bits either way.
    """
    if summary is None:
      summary = blockwise.Summary(values_digest(new), norm(new), ())
    self._global[p] = new
    self._theta_norm[p] = summary.norm
    self._version[p] += 1
    self._digest[p] = summary.digest
    self._history[p][self._version[p]] = new
    self._trim(p)

  def republish(self, p: int, version: int) -> None:
    """Θ_p's current values become `version` (the caller checked it is newer)."""
    self._version[p] = version
    self._history[p][version] = self._global[p]
    self._trim(p)

  def checked_copies(
    self, p: int, version: int, values: Mapping[str, np.ndarray], digest: str
  ) -> dict[str, np.ndarray]:
    """Read-only copies of `values` if they can become `version` of p with `digest` (`recover`).

    Raises:
      ValueError: if `version` is not newer than p's, the keys, shapes or dtypes differ, a value is
        not finite, or the values' digest is not `digest`.
    """
    if version <= self._version[p]:
      raise ValueError(f"Fragment {p} is at version {self._version[p]}; {version} is not newer.")
    expected = self._global[p]
    if set(values) != set(expected):
      raise ValueError(f"The keys of the recovered fragment {p} differ from the layout's.")
    copies = {}
    for k, ref in expected.items():
      v = np.asarray(values[k])
      if v.shape != ref.shape or v.dtype != ref.dtype:
        raise ValueError(
          f"{k!r} is {v.dtype}{list(v.shape)}, expected {ref.dtype}{list(ref.shape)}"
        )
      if not blockwise.all_finite(v):
        raise ValueError(non_finite(k, v))
      copies[k] = readonly(np.array(v, copy=True))
    got = values_digest(copies)
    if got != digest:
      raise ValueError(
        f"The recovered values of fragment {p} have digest {got}, not version {version}'s {digest}."
      )
    return copies

  def take_back(self, p: int, version: int, copies: dict[str, np.ndarray], digest: str) -> None:
    """Makes `copies` (from `checked_copies`) Θ_p at `version`."""
    self._global[p] = copies
    self._version[p] = version
    self._digest[p] = digest
    self._theta_norm[p] = norm(copies)
    self._history[p][version] = copies
    self._trim(p)

  def _trim(self, p: int) -> None:
    for v in sorted(self._history[p])[: -self._keep]:
      del self._history[p][v]

  # -- checkpoints (`checkpoint.py`) ---------------------------------------------------------------

  def fitting(self, a: Any, key: str, p: int) -> np.ndarray:
    """A copy of `a`, checked against the shape and dtype of key in fragment p."""
    ref = self._global[p][key]
    a = np.array(a, copy=True)
    if a.shape != ref.shape or a.dtype != ref.dtype:
      raise ValueError(
        f"Checkpoint has {key!r} as {a.dtype}{a.shape}, expected {ref.dtype}{ref.shape}."
      )
    return a

  def restore(self, history: list[dict[int, dict[str, np.ndarray]]], versions: list[int]) -> None:
    """Replaces every fragment's kept versions and current version (a checkpoint's, checked)."""
    self._history = history
    self._version = versions
    self._global = [history[p][v] for p, v in enumerate(self._version)]
    self._digest = [values_digest(v) for v in self._global]
    # The plausibility bound's scale is the restored Θ_p's, not the one the process started with.
    self._theta_norm = [norm(v) for v in self._global]

  def layout_fingerprint(self) -> str:
    """Hash of fragment keys, shapes and dtypes; guards `load_state_dict` against another layout."""
    h = hashlib.sha256()
    for p, vals in enumerate(self._global):
      for k in self._keys[p]:
        # A fragment another shard owns: its keys only (the same hash as before when all owned).
        h.update(
          (f"{p}|{k}|{vals[k].dtype}|{vals[k].shape};" if k in vals else f"{p}|{k}|-;").encode()
        )
    return h.hexdigest()[:32]
