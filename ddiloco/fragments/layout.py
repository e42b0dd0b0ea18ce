"""Fragment layouts: which parameter tensors (or pieces of them) travel together (docs/algorithm.md §2).

A layout partitions the flat parameter dict ({"block_0/attn/query/kernel": array, ...}, see tree.py)
into P fragments. It is a pure function of the leaves' names, shapes and dtypes, so every learner and
the syncer derive the same layout independently; its digest is compared at registration to reject
learners whose model differs.

Keys. A layout key is either a leaf path, or, for a leaf cut along axis 0 (`split_large=True`), a piece
key "path@start:stop" (rows [start, stop) of the leaf). `split`/`select` cut leaves into pieces and
`join`/`assign` put them back, so callers only ever handle full leaves. "@" is therefore reserved and
may not appear in leaf paths.

Strategies (`make_layout`):
  * "balanced": LPT greedy bin packing by bytes (docs/algorithm.md §2): items sorted by size descending, ties by
    key, each put into the currently smallest fragment, ties by lowest index. The peak fragment is
    within 4/3 of the optimal peak.
  * "layer": strided blocks as Streaming DiLoCo. A leaf whose path has a component "block_<i>" (the
    first such component counts) goes to fragment i % P; every other leaf (embeddings, final norm, ...)
    is then placed by the same LPT rule, starting from the byte loads the blocks left.
  * "tensor": one whole leaf per fragment, in sorted path order. `num_fragments` must equal the leaf
    count, or be 0 meaning "one fragment per leaf". `split_large` is rejected here.

Slices (`slices` = S > 1, a syncer of S shards; docs/architecture.md, "The sharded syncer"). The
strategy's P fragments become P groups, each cut into S slices balanced by bytes: the group's items
are placed by the LPT rule into S slices, after an item larger than the group's bytes / S is cut
along axis 0 into ceil(bytes·S / group bytes) pieces, and, while the group has fewer items than S,
its largest item with two rows or more is halved. Slice s of group p is fragment p·S + s, so shard
s of S (fragment f to shard f mod S) owns slice s of every group. With S = 1 the layout is the
strategy's, digest included.
"""

import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers "bfloat16" etc. with np.dtype, needed by from_json)
import numpy as np

STRATEGIES = ("balanced", "layer", "tensor")
PIECE_SEPARATOR = "@"
_PIECE_RE = re.compile(r"^(?P<leaf>.+)@(?P<start>\d+):(?P<stop>\d+)$")
_BLOCK_RE = re.compile(r"^block_(\d+)$")


def _nbytes(shape: Sequence[int], dtype: str) -> int:
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def parse_key(key: str) -> tuple[str, int | None, int | None]:
  """Splits a layout key into (leaf path, start, stop); start/stop are None for a whole leaf."""
  m = _PIECE_RE.match(key)
  if m is None:
    return key, None, None
  return m["leaf"], int(m["start"]), int(m["stop"])


def _digest(
  fragments: tuple[tuple[str, ...], ...],
  shapes: Mapping[str, tuple[int, ...]],
  dtypes: Mapping[str, str],
) -> str:
  # Canonical JSON of names, shapes, dtypes and assignment (docs/algorithm.md §2). The strategy name is left out on
  # purpose: two layouts with the same assignment are interchangeable on the wire.
  doc = {
    "fragments": [list(f) for f in fragments],
    "shapes": {k: list(shapes[k]) for k in sorted(shapes)},
    "dtypes": {k: dtypes[k] for k in sorted(dtypes)},
  }
  text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FragmentLayout:
  """An assignment of parameter keys to P fragments, with the shapes and dtypes it was built for.

  Attributes:
    num_fragments: P.
    strategy: the strategy that produced it (informational; not part of the digest).
    fragments: the sorted keys of each fragment; every key is in exactly one fragment.
    shapes: key -> shape (a piece's own shape for piece keys).
    dtypes: key -> numpy dtype name ("float32", "bfloat16", ...).
    digest: hash of names, shapes, dtypes and assignment. Computed when left empty; checked otherwise.
  """

  num_fragments: int
  strategy: str
  fragments: tuple[tuple[str, ...], ...]
  shapes: Mapping[str, tuple[int, ...]]
  dtypes: Mapping[str, str]
  digest: str = ""
  # leaf path -> ((start, stop, key), ...) sorted by start, or ((None, None, leaf),) for whole leaves.
  _pieces: Mapping[str, tuple[tuple[Any, Any, str], ...]] = dataclasses.field(
    init=False, repr=False, compare=False
  )
  _owner: Mapping[str, int] = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    fragments = tuple(tuple(sorted(f)) for f in self.fragments)
    shapes = {k: tuple(int(d) for d in s) for k, s in sorted(self.shapes.items())}
    dtypes = {k: np.dtype(d).name for k, d in sorted(self.dtypes.items())}
    if self.num_fragments < 1 or len(fragments) != self.num_fragments:
      raise ValueError(
        f"num_fragments={self.num_fragments} but {len(fragments)} fragments given (need >= 1)."
      )
    owner: dict[str, int] = {}
    for p, keys in enumerate(fragments):
      if not keys:
        raise ValueError(
          f"Fragment {p} is empty; empty fragments are not allowed (docs/algorithm.md §2)."
        )
      for k in keys:
        if k in owner:
          raise ValueError(f"Key {k!r} is in fragments {owner[k]} and {p}.")
        owner[k] = p
    if set(shapes) != set(owner) or set(dtypes) != set(owner):
      raise ValueError(
        "shapes/dtypes must have exactly the fragments' keys; differences: "
        f"{sorted(set(shapes) ^ set(owner))[:3]} / {sorted(set(dtypes) ^ set(owner))[:3]}."
      )
    object.__setattr__(self, "fragments", fragments)
    object.__setattr__(self, "shapes", types.MappingProxyType(shapes))
    object.__setattr__(self, "dtypes", types.MappingProxyType(dtypes))
    object.__setattr__(self, "_owner", types.MappingProxyType(owner))
    object.__setattr__(self, "_pieces", types.MappingProxyType(self._index_pieces()))
    expected = _digest(fragments, shapes, dtypes)
    if not self.digest:
      object.__setattr__(self, "digest", expected)
    elif self.digest != expected:
      raise ValueError(f"Layout digest {self.digest!r} does not match its contents ({expected!r}).")

  def __hash__(self) -> int:
    return hash(self.digest)

  def __reduce__(self):
    # MappingProxyType does not pickle; layouts travel to subprocesses as their JSON form.
    return (type(self).from_json, (self.to_json(),))

  def _index_pieces(self) -> dict[str, tuple[tuple[Any, Any, str], ...]]:
    """Groups keys by leaf and checks that the pieces of each leaf tile its axis 0 exactly."""
    by_leaf: dict[str, list[tuple[Any, Any, str]]] = {}
    for key in self.shapes:
      leaf, start, stop = parse_key(key)
      by_leaf.setdefault(leaf, []).append((start, stop, key))
    for leaf, pieces in by_leaf.items():
      if len(pieces) == 1 and pieces[0][0] is None:
        continue
      if any(start is None for start, _, _ in pieces):
        raise ValueError(f"Leaf {leaf!r} appears both whole and as pieces.")
      pieces.sort()
      end = 0
      for start, stop, key in pieces:
        shape = self.shapes[key]
        if start != end or not shape or shape[0] != stop - start or stop <= start:
          raise ValueError(f"Pieces of {leaf!r} do not tile axis 0 (at {key!r}, shape {shape}).")
        if (
          shape[1:] != self.shapes[pieces[0][2]][1:]
          or self.dtypes[key] != self.dtypes[pieces[0][2]]
        ):
          raise ValueError(f"Pieces of {leaf!r} disagree on trailing shape or dtype.")
        end = stop
    return {leaf: tuple(p) for leaf, p in sorted(by_leaf.items())}

  @functools.cached_property
  def leaf_shapes(self) -> Mapping[str, tuple[int, ...]]:
    """Full leaf path -> full leaf shape (pieces reassembled)."""
    out = {}
    for leaf, pieces in self._pieces.items():
      first = self.shapes[pieces[0][2]]
      out[leaf] = first if pieces[0][0] is None else (pieces[-1][1], *first[1:])
    return types.MappingProxyType(out)

  def fragment_of(self, key: str) -> int:
    """Returns the fragment holding layout key `key` (a leaf path or a piece key).

    Raises:
      ValueError: if `key` is not a key of this layout (a split leaf's own path is not).
    """
    if key not in self._owner:
      raise ValueError(f"{key!r} is not a key of this layout.")
    return self._owner[key]

  def fragment_bytes(self, p: int) -> int:
    """Bytes of fragment `p` at the layout's dtypes."""
    self._check_index(p)
    return sum(_nbytes(self.shapes[k], self.dtypes[k]) for k in self.fragments[p])

  def total_bytes(self) -> int:
    """Bytes of all fragments together."""
    return sum(_nbytes(self.shapes[k], self.dtypes[k]) for k in self.shapes)

  def _check_index(self, p: int) -> None:
    if not 0 <= p < self.num_fragments:
      raise ValueError(f"Fragment index {p} out of range [0, {self.num_fragments}).")

  def _leaf_value(self, flat: Mapping[str, Any], leaf: str) -> Any:
    if leaf not in flat:
      raise ValueError(f"Missing leaf {leaf!r}.")
    value = flat[leaf]
    if tuple(value.shape) != self.leaf_shapes[leaf]:
      raise ValueError(
        f"Leaf {leaf!r} has shape {tuple(value.shape)}, layout expects {self.leaf_shapes[leaf]}."
      )
    return value

  def select(self, flat: Mapping[str, Any], p: int) -> dict[str, Any]:
    """Returns fragment `p`'s values {key: array} cut from full leaves `flat` (extra leaves ignored).

    Raises:
      ValueError: if `p` is out of range, or a leaf of fragment `p` is missing or mis-shaped.
    """
    self._check_index(p)
    out = {}
    for key in self.fragments[p]:
      leaf, start, stop = parse_key(key)
      value = self._leaf_value(flat, leaf)
      out[key] = value if start is None else value[start:stop]
    return out

  def split(self, flat: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Splits full leaves into one {key: array} dict per fragment.

    Raises:
      ValueError: if `flat` does not have exactly the layout's leaves, or a shape differs.
    """
    unknown = sorted(set(flat) - set(self._pieces))
    if unknown:
      raise ValueError(f"Unknown leaves {unknown[:3]} ({len(unknown)} in all).")
    return [self.select(flat, p) for p in range(self.num_fragments)]

  def join(self, fragments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Inverse of `split`: one dict of full leaves (pieces concatenated along axis 0), by path.

    Raises:
      ValueError: if there are not P fragments, or a fragment's keys or shapes are wrong.
    """
    if len(fragments) != self.num_fragments:
      raise ValueError(f"Expected {self.num_fragments} fragments, got {len(fragments)}.")
    values: dict[str, Any] = {}
    for p, frag in enumerate(fragments):
      self._check_keys(p, frag)
      self._check_shapes(p, frag)
      values.update(frag)
    out = {}
    for leaf, pieces in self._pieces.items():
      if pieces[0][0] is None:
        out[leaf] = values[leaf]
        continue
      parts = [values[key] for _, _, key in pieces]
      xp = np if all(isinstance(x, np.ndarray) for x in parts) else jnp
      out[leaf] = xp.concatenate(parts, axis=0)
    return out

  def assign(self, flat: Mapping[str, Any], p: int, values: Mapping[str, Any]) -> dict[str, Any]:
    """Returns a copy of `flat` (full leaves) with fragment `p` replaced by `values` (docs/algorithm.md §3 overwrite).

    Pieces are written into their rows of the full leaf (numpy arrays are copied, never mutated).

    Raises:
      ValueError: as `validate`, or if a leaf of fragment `p` is missing from `flat`.
    """
    self.validate(p, values)
    out = dict(flat)
    for key in self.fragments[p]:
      leaf, start, stop = parse_key(key)
      if start is None:
        out[leaf] = values[key]
        continue
      full = self._leaf_value(out, leaf)
      if isinstance(full, jax.Array):
        out[leaf] = full.at[start:stop].set(values[key])
      else:
        full = np.array(full, copy=True)
        full[start:stop] = values[key]
        out[leaf] = full
    return out

  def _check_keys(self, p: int, values: Mapping[str, Any]) -> None:
    expected = set(self.fragments[p])
    unknown, missing = sorted(set(values) - expected), sorted(expected - set(values))
    if unknown:
      raise ValueError(f"Fragment {p}: unknown keys {unknown[:3]} ({len(unknown)} in all).")
    if missing:
      raise ValueError(f"Fragment {p}: missing keys {missing[:3]} ({len(missing)} in all).")

  def _check_shapes(self, p: int, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
      if tuple(value.shape) != self.shapes[key]:
        raise ValueError(
          f"Fragment {p}: {key!r} has shape {tuple(value.shape)}, expected {self.shapes[key]}."
        )

  def validate(self, p: int, values: Mapping[str, Any]) -> None:
    """Checks that `values` is exactly fragment `p`: same keys, shapes and dtypes.

    Raises:
      ValueError: naming the first offending key (unknown, missing, wrong shape or wrong dtype).
    """
    self._check_index(p)
    self._check_keys(p, values)
    self._check_shapes(p, values)
    for key, value in values.items():
      if np.dtype(value.dtype).name != self.dtypes[key]:
        raise ValueError(
          f"Fragment {p}: {key!r} has dtype {np.dtype(value.dtype).name}, "
          f"expected {self.dtypes[key]}."
        )

  def to_json(self) -> str:
    """Serializes the layout (digest included) to a JSON string."""
    return json.dumps(
      {
        "num_fragments": self.num_fragments,
        "strategy": self.strategy,
        "fragments": [list(f) for f in self.fragments],
        "shapes": {k: list(s) for k, s in self.shapes.items()},
        "dtypes": dict(self.dtypes),
        "digest": self.digest,
      },
      sort_keys=True,
    )

  @classmethod
  def from_json(cls, text: str) -> "FragmentLayout":
    """Parses `to_json` output.

    Raises:
      ValueError: if the JSON is malformed or the digest does not match the contents.
    """
    try:
      doc = json.loads(text)
      return cls(
        num_fragments=int(doc["num_fragments"]),
        strategy=str(doc["strategy"]),
        fragments=tuple(tuple(f) for f in doc["fragments"]),
        shapes={k: tuple(s) for k, s in doc["shapes"].items()},
        dtypes=dict(doc["dtypes"]),
        digest=str(doc["digest"]),
      )
    except (KeyError, TypeError, json.JSONDecodeError) as e:
      raise ValueError(f"Malformed layout JSON: {e!r}") from e


def _lpt(items: Sequence[tuple[str, int]], loads: list[int], assignment: list[list[str]]) -> None:
  """LPT: largest item first (ties by key) into the least-loaded fragment (ties by lowest index)."""
  heap = [(load, p) for p, load in enumerate(loads)]
  heapq.heapify(heap)
  for key, size in sorted(items, key=lambda kv: (-kv[1], kv[0])):
    load, p = heapq.heappop(heap)
    assignment[p].append(key)
    loads[p] = load + size
    heapq.heappush(heap, (loads[p], p))


def _block_index(key: str) -> int | None:
  for part in parse_key(key)[0].split("/"):
    m = _BLOCK_RE.match(part)
    if m:
      return int(m[1])
  return None


def make_layout(
  shapes: Mapping[str, Any],
  *,
  num_fragments: int,
  strategy: str = "balanced",
  split_large: bool = False,
  slices: int = 1,
) -> FragmentLayout:
  """Builds a deterministic fragment layout from leaf shapes and dtypes alone (docs/algorithm.md §2).

  Args:
    shapes: leaf path -> anything with `.shape` and `.dtype` (np/jax arrays, jax.ShapeDtypeStruct).
    num_fragments: P >= 1; for "tensor", 0 means one fragment per leaf.
    strategy: "balanced", "layer" or "tensor" (see the module docstring).
    split_large: cut every leaf larger than total/P bytes along axis 0 into ceil(bytes·P/total)
      near-equal pieces (at most one per row) before assigning (docs/algorithm.md §2 decision: off by default).
    slices: S >= 1: cut each of the P fragments into S byte-balanced slices, fragment p·S + s
      being slice s of fragment p (the module docstring); the layout then has P·S fragments.

  Returns:
    The layout.

  Raises:
    ValueError: on an unknown strategy, no leaves, a "@" in a leaf path, P < 1, P larger than the
      number of items (leaves or pieces), a "tensor" P that is not the leaf count, `split_large`
      with "tensor", an empty fragment, S < 1 or a fragment too small for S slices.
  """
  if slices < 1:
    raise ValueError(f"slices must be >= 1, got {slices}.")
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown strategy {strategy!r}; expected one of {STRATEGIES}.")
  if not shapes:
    raise ValueError("No leaves to fragment.")
  bad = [k for k in shapes if PIECE_SEPARATOR in k]
  if bad:
    raise ValueError(f"Leaf paths may not contain {PIECE_SEPARATOR!r}: {sorted(bad)[:3]}.")
  leaf_shapes = {k: tuple(int(d) for d in v.shape) for k, v in shapes.items()}
  dtypes = {k: np.dtype(v.dtype).name for k, v in shapes.items()}
  if strategy == "tensor":
    if split_large:
      raise ValueError("split_large does not apply to the 'tensor' strategy (one whole leaf each).")
    if num_fragments == 0:
      num_fragments = len(shapes)
  if num_fragments < 1:
    raise ValueError(f"num_fragments must be >= 1 (0 only for 'tensor'), got {num_fragments}.")

  item_shapes, item_dtypes = dict(leaf_shapes), dict(dtypes)
  if split_large:
    total = sum(_nbytes(s, dtypes[k]) for k, s in leaf_shapes.items())
    for leaf, shape in leaf_shapes.items():
      size = _nbytes(shape, dtypes[leaf])
      if not shape or shape[0] < 2 or size * num_fragments <= total:
        continue
      num_pieces = min(-(-size * num_fragments // total), shape[0])
      # Near-equal pieces: the first (rows % k) pieces get one extra row (as np.array_split).
      base, extra = divmod(shape[0], num_pieces)
      sizes = [base + (i < extra) for i in range(num_pieces)]
      del item_shapes[leaf], item_dtypes[leaf]
      for start, stop in itertools.pairwise(itertools.accumulate(sizes, initial=0)):
        key = f"{leaf}{PIECE_SEPARATOR}{start}:{stop}"
        item_shapes[key] = (stop - start, *shape[1:])
        item_dtypes[key] = dtypes[leaf]

  keys = sorted(item_shapes)
  if num_fragments > len(keys):
    raise ValueError(f"num_fragments={num_fragments} exceeds the number of items ({len(keys)}).")
  sizes = [(k, _nbytes(item_shapes[k], item_dtypes[k])) for k in keys]
  assignment: list[list[str]] = [[] for _ in range(num_fragments)]
  if strategy == "balanced":
    _lpt(sizes, [0] * num_fragments, assignment)
  elif strategy == "layer":
    loads = [0] * num_fragments
    rest = []
    for key, size in sizes:
      block = _block_index(key)
      if block is None:
        rest.append((key, size))
      else:
        assignment[block % num_fragments].append(key)
        loads[block % num_fragments] += size
    _lpt(rest, loads, assignment)
  else:  # "tensor"
    if num_fragments != len(keys):
      raise ValueError(
        f"'tensor' needs num_fragments == number of items ({len(keys)}) or 0; got {num_fragments}."
      )
    assignment = [[k] for k in keys]
  if slices > 1:
    from ddiloco.fragments import slicing  # It builds on this module's helpers.

    assignment = [
      sliced
      for p, group in enumerate(assignment)
      for sliced in slicing.slice_group(p, group, item_shapes, item_dtypes, slices)
    ]
    num_fragments *= slices
  return FragmentLayout(
    num_fragments=num_fragments,
    strategy=strategy,
    fragments=tuple(tuple(a) for a in assignment),
    shapes=item_shapes,
    dtypes=item_dtypes,
  )
