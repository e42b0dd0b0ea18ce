"""Flat views of parameter pytrees: leaf path strings <-> arrays.

Every component that exchanges parameters (fragment layout, syncer, transports) works on flat dicts keyed
by a deterministic path string, so none of them depends on the model's pytree structure.
"""

from collections.abc import Mapping
from typing import Any

import jax

from ddiloco.types import PyTree

SEPARATOR = "/"


def _key_name(key: Any) -> str:
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def path_str(path: tuple[Any, ...]) -> str:
  """Returns the "a/b/c" name of a key path from `jax.tree_util`."""
  return SEPARATOR.join(_key_name(k) for k in path)


def flatten(tree: PyTree) -> dict[str, Any]:
  """Flattens a pytree into {path: leaf}, ordered by path.

  Raises:
    ValueError: if two leaves map to the same path string.
  """
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = path_str(path)
    if name in out:
      raise ValueError(f"Two leaves share the path {name!r}.")
    out[name] = leaf
  return dict(sorted(out.items()))


def unflatten(flat: Mapping[str, Any], like: PyTree) -> PyTree:
  """Rebuilds a pytree with the structure of `like` from {path: leaf}.

  Raises:
    KeyError: if `flat` lacks a path of `like` (names the first missing one).
    ValueError: if `flat` has paths that `like` does not.
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
  names = [path_str(p) for p, _ in leaves_with_path]
  missing = [n for n in names if n not in flat]
  if missing:
    raise KeyError(f"Missing {len(missing)} leaves, first {missing[0]!r}.")
  extra = set(flat) - set(names)
  if extra:
    raise ValueError(f"Unknown leaves: {sorted(extra)[:3]}.")
  return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])
