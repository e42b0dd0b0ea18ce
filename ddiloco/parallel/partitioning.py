"""Logical axis names -> one learner's mesh axes, and sharded parameter creation (t5x style).

Models annotate every parameter with logical axis names (`nn.with_logical_partitioning`) and their
activations with `nn.with_logical_constraint`. One table, `LOGICAL_AXIS_RULES`, maps those names
onto the ("data", "model") mesh of `ddiloco.parallel.mesh`; `logical_axis_rules(expert_axis=...)`
builds the same table with the MoE "expert" axis on another mesh axis.

Known trap (flax 0.12 / jax 0.10): linen's boxed params apply their sharding only when a *global*
mesh is set (`jax.set_mesh`); outside one, `nn.unbox` and `nn.with_logical_constraint` silently
return the value unchanged and a jitted init puts every array whole on one device. So this module
never relies on the boxes: it reads the logical names with `jax.eval_shape`, turns them into
`NamedSharding`s with `nn.logical_to_mesh_sharding`, and creates the params with
`jax.jit(..., out_shardings=...)`. It also sets the mesh and rules while tracing
(`partitioning_context`), so that the activation constraints inside the model take effect too; a
train step should trace its forward/backward inside the same context.
"""

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ddiloco.fragments.tree import flatten
from ddiloco.types import (
  BATCH,
  DATA_AXIS,
  EMBED,
  EXPERT,
  HEADS,
  KV,
  LAYERS,
  LENGTH,
  MLP,
  MODEL_AXIS,
  VOCAB,
  PyTree,
)

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

EXPERT_AXES = (MODEL_AXIS, DATA_AXIS, None)


def logical_axis_rules(
  *, expert_axis: str | None = MODEL_AXIS
) -> tuple[tuple[str, str | None], ...]:
  """The rules table, with the MoE `expert` axis mapped to `expert_axis`.

  Order matters: flax assigns mesh axes by rule priority, and a mesh axis is used at most once per
  array. So a q/k/v kernel ("embed", "heads", "kv") shards "heads" (listed first) over "model" and
  leaves "kv" whole; "kv" is sharded only where "heads" is absent. "expert" comes first, so an MoE
  kernel ("expert", "embed", "mlp") is expert-parallel rather than tensor-parallel, and an expert
  buffer ("expert", "batch", ...) keeps its experts sharded even when they share the data axis.

  Args:
    expert_axis: "model" (default): experts spread over the model-parallel devices, as heads and
      MLP columns are (with model_parallelism 1 every device holds every expert, so every existing
      mesh works unchanged). "data": GShard-style expert parallelism, experts spread over the
      data-parallel devices; GSPMD turns the dispatch einsum into an all-to-all. None: experts
      replicated.

  Returns:
    (logical name, mesh axis or None) pairs for `nn.logical_axis_rules`.

  Raises:
    ValueError: for an expert_axis that is not a mesh axis or None.
  """
  if expert_axis not in EXPERT_AXES:
    raise ValueError(f"expert_axis must be one of {EXPERT_AXES}, got {expert_axis!r}.")
  return (
    (EXPERT, expert_axis),
    (BATCH, DATA_AXIS),
    (VOCAB, MODEL_AXIS),
    (HEADS, MODEL_AXIS),
    (MLP, MODEL_AXIS),
    (KV, MODEL_AXIS),
    (EMBED, None),
    (LENGTH, None),
    (LAYERS, None),
  )


LOGICAL_AXIS_RULES = logical_axis_rules()


@contextlib.contextmanager
def partitioning_context(
  mesh: jax.sharding.Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES
) -> Iterator[None]:
  """Sets `mesh` as the global mesh and `rules` as flax's logical axis rules.

  Trace (jit/eval_shape) a model's init or apply inside this context for its
  `nn.with_logical_constraint` hints to become real sharding constraints.

  Args:
    mesh: the learner's mesh.
    rules: logical-name -> mesh-axis rules.

  Yields:
    Nothing.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding of a [batch, ...] input: the leading dim over "data", the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def _init_fn(
  model: nn.Module, batch_size: int, seq_len: int, inputs: jax.ShapeDtypeStruct | None = None
):
  def init(rng: jax.Array) -> PyTree:
    if inputs is None:
      dummy = jnp.zeros((batch_size, seq_len), jnp.int32)
    else:
      dummy = jnp.zeros(inputs.shape, inputs.dtype)
    return model.init({"params": rng}, dummy)["params"]

  return init


def _check_divisible(abstract: PyTree, shardings: PyTree, mesh: jax.sharding.Mesh) -> None:
  """Raises a ValueError naming the first parameter whose sharded dims do not divide evenly."""
  flat_abstract = flatten(abstract)
  flat_shardings = flatten(shardings)
  for path, leaf in flat_abstract.items():
    spec = flat_shardings[path].spec
    for dim, entry in enumerate(spec):
      if entry is None:
        continue
      axes = (entry,) if isinstance(entry, str) else tuple(entry)
      ways = math.prod(mesh.shape[a] for a in axes)
      if leaf.shape[dim] % ways:
        raise ValueError(
          f"Parameter {path!r} of shape {leaf.shape}: dim {dim} ({leaf.shape[dim]}) is sharded "
          f"over mesh axes {axes} of total size {ways} and does not divide evenly; change the "
          "model shape, the mesh (model_parallelism) or the logical axis rules."
        )


def abstract_params(
  model: nn.Module,
  mesh: jax.sharding.Mesh,
  *,
  batch_size: int = 1,
  seq_len: int = 8,
  rules: LogicalRules = LOGICAL_AXIS_RULES,
  inputs: jax.ShapeDtypeStruct | None = None,
) -> tuple[PyTree, PyTree]:
  """Shapes, dtypes and shardings of `model`'s params, without allocating them.

  Args:
    model: a linen module called as `model(tokens_BxL)` (or `model(inputs)`), every param
      annotated with logical axes.
    mesh: the learner's mesh.
    batch_size: batch size of the dummy int32 token input used to trace `init`.
    seq_len: sequence length of the dummy input.
    rules: logical-name -> mesh-axis rules.
    inputs: shape and dtype of the dummy input instead of [batch_size, seq_len] int32 tokens
      (e.g. images for a ViT; `ddiloco.tasks.Task.dummy_inputs`).

  Returns:
    (abstract, shardings): the unboxed params as `jax.ShapeDtypeStruct`s carrying
    `sharding=NamedSharding`, and the tree of those `NamedSharding`s (same structure).

  Raises:
    ValueError: if a parameter has no logical axis annotation, or a sharded dimension does not
      divide by its mesh axes.
  """
  with partitioning_context(mesh, rules):
    boxed = jax.eval_shape(_init_fn(model, batch_size, seq_len, inputs), jax.random.key(0))
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
  unannotated = [
    path
    for path, leaf in flatten(jax.tree_util.tree_map(is_box, boxed, is_leaf=is_box)).items()
    if not leaf
  ]
  if unannotated:
    raise ValueError(
      f"Parameters without logical axis names (wrap their initializer in "
      f"nn.with_logical_partitioning): {unannotated[:5]}"
    )
  logical_specs = nn.get_partition_spec(boxed)
  shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
  unboxed = nn.unbox(boxed)
  _check_divisible(unboxed, shardings, mesh)
  abstract = jax.tree_util.tree_map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), unboxed, shardings
  )
  return abstract, shardings


def init_params(
  model: nn.Module,
  mesh: jax.sharding.Mesh,
  rng: jax.Array,
  *,
  batch_size: int = 1,
  seq_len: int = 8,
  rules: LogicalRules = LOGICAL_AXIS_RULES,
  inputs: jax.ShapeDtypeStruct | None = None,
) -> tuple[PyTree, PyTree]:
  """Initialises `model`'s params directly in their shardings on `mesh`.

  The init is jitted with `out_shardings`, so XLA partitions the random number generation and no
  device ever holds a full copy of a sharded tensor.

  Args:
    model: a linen module called as `model(tokens_BxL)`.
    mesh: the learner's mesh.
    rng: a `jax.random` key (used as the "params" rng).
    batch_size: batch size of the dummy input used to trace `init`.
    seq_len: sequence length of the dummy input.
    rules: logical-name -> mesh-axis rules.
    inputs: the dummy input's shape and dtype, as in `abstract_params`.

  Returns:
    (params, shardings): a plain pytree of `jax.Array`s (no `LogicallyPartitioned` boxes), each
    placed with its `NamedSharding`, and the tree of those shardings.

  Raises:
    ValueError: as `abstract_params`.
  """
  _, shardings = abstract_params(
    model, mesh, batch_size=batch_size, seq_len=seq_len, rules=rules, inputs=inputs
  )
  init = _init_fn(model, batch_size, seq_len, inputs)

  def init_unboxed(rng: jax.Array) -> PyTree:
    return nn.unbox(init(rng))

  with partitioning_context(mesh, rules):
    params = jax.jit(init_unboxed, out_shardings=shardings)(rng)
  return params, shardings


def init_leaves(
  model: nn.Module,
  mesh: jax.sharding.Mesh,
  rng: jax.Array,
  paths: Iterable[str],
  *,
  rules: LogicalRules = LOGICAL_AXIS_RULES,
  inputs: jax.ShapeDtypeStruct | None = None,
) -> dict[str, jax.Array]:
  """Initialises only the params at `paths` ({leaf path: array}), as `init_params` would.

  The whole init is traced, but the jitted function returns only these leaves, so XLA drops the
  rest of the computation: a syncer shard that owns 1/S of the model allocates 1/S of it. The
  values are those of `init_params` with the same `rng` (each leaf's random stream is derived from
  its module path, not from what else is computed; tested bit for bit).

  Raises:
    KeyError: if a path is not a leaf of the model's params.
    ValueError: as `abstract_params`.
  """
  _, shardings = abstract_params(model, mesh, rules=rules, inputs=inputs)
  flat_shardings = flatten(shardings)
  wanted = sorted(set(paths))
  unknown = [p for p in wanted if p not in flat_shardings]
  if unknown:
    raise KeyError(f"Not a parameter of the model: {unknown[:3]}.")
  init = _init_fn(model, 1, 8, inputs)

  def init_some(rng: jax.Array) -> dict[str, jax.Array]:
    flat = flatten(nn.unbox(init(rng)))
    return {p: flat[p] for p in wanted}

  with partitioning_context(mesh, rules):
    return jax.jit(init_some, out_shardings={p: flat_shardings[p] for p in wanted})(rng)
