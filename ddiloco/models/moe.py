"""A mixture-of-experts feed-forward block (GShard / Switch style) with an `expert` logical axis.

Routing ("tokens choose experts", per group of tokens):
- Router logits [G, S, E] in float32; softmax gates; each token picks its `top_k` experts. With
  top_k > 1 the chosen gates are renormalised to sum to 1 (GShard top-2, Mixtral); with top_k = 1 the
  gate is the raw probability (Switch), so the task loss still trains the router.
- Capacity: each expert takes at most C = min(ceil(top_k * S * capacity_factor / E), S) tokens per
  group. Buffer slots go first to every token's first choice in token order, then to second
  choices, and so on (GShard's priority): an overflowing expert drops the *latest* tokens, and a
  token's second choice never displaces another token's first. A dropped assignment contributes
  nothing; a token dropped by all its choices gets a zero block output and passes through on the
  residual connection.
- Dispatch and combine are one-hot [G, S, E, C] tensors contracted with einsums, so the block is
  one static-shape program (jit- and GSPMD-friendly: no gather, no data-dependent shapes).

Groups. Tokens are routed in groups of `moe_group_size` consecutive positions of one sequence (0,
or a size above the sequence length: the whole sequence; otherwise it must divide the length). Capacity is per group, so a sequence's routing never depends on the other
sequences of its batch (eval results do not depend on the eval batch size), and the dispatch tensor
stays G·S·E·C = tokens·E·C instead of growing with the square of the batch.

Auxiliary losses (sown into the "intermediates" collection, per MoE layer):
- "moe_aux_loss": Switch/GShard load balancing, E · Σ_e f_e · P_e, where f_e is the fraction of the
  group's (token, choice) assignments routed to e before capacity (1/top_k per choice, so Σ f = 1)
  and P_e the mean router probability of e. Uniform routing gives exactly 1.0 (see `route`).
- "router_z_loss": ST-MoE's mean squared log-partition of the router logits.
The task's loss adds them to the objective with the config's weights (`ddiloco.tasks.text`).

Sharding. Expert kernels are [E, D, F] / [E, F, D] with logical axes ("expert", "embed", "mlp"):
`ddiloco.parallel.partitioning` maps "expert" to the learner's "model" mesh axis by default, so the
experts are spread over the model-parallel devices and each device computes its own experts'
buffers; `logical_axis_rules(expert_axis="data")` gives GShard's expert parallelism over the
data-parallel devices instead.
"""

import math
from typing import TYPE_CHECKING, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ddiloco.models.layers import Kernel
from ddiloco.types import BATCH, EMBED, EXPERT, LENGTH, MLP

if TYPE_CHECKING:
  from ddiloco.models.transformer import TransformerConfig

AUX_LOSS = "moe_aux_loss"
Z_LOSS = "router_z_loss"


def expert_capacity(
  group_size: int, *, num_experts: int, top_k: int, capacity_factor: float
) -> int:
  """Buffer slots per expert and group: min(ceil(top_k * S * capacity_factor / E), S).

  An expert can receive a token at most once, so more than S slots would never fill.

  Raises:
    ValueError: for non-positive sizes or factor.
  """
  if min(group_size, num_experts, top_k) < 1 or capacity_factor <= 0:
    raise ValueError(
      f"need positive sizes and capacity_factor, got S={group_size}, E={num_experts}, "
      f"k={top_k}, capacity_factor={capacity_factor}."
    )
  return min(math.ceil(top_k * group_size * capacity_factor / num_experts), group_size)


class Routing(NamedTuple):
  """What `route` decides for a [G, S] block of tokens.

  Attributes:
    dispatch_GxSxExC: 1.0 where token s of group g sits in slot c of expert e's buffer.
    combine_GxSxExC: the same positions weighted by the token's gate for that expert.
    aux_loss: load-balancing loss E · Σ_e f_e · P_e, averaged over groups (float32 scalar).
    z_loss: mean over tokens of logsumexp(logits)² (float32 scalar).
    dropped_fraction: fraction of (token, choice) assignments dropped for lack of capacity.
  """

  dispatch_GxSxExC: jax.Array
  combine_GxSxExC: jax.Array
  aux_loss: jax.Array
  z_loss: jax.Array
  dropped_fraction: jax.Array


def route(logits_GxSxE: jax.Array, *, top_k: int, capacity: int) -> Routing:
  """Top-k routing with per-expert capacity (module docstring: priority and gates).

  Load-balancing normalisation: f_e = mean over tokens of (number of the token's choices that are
  e) / top_k, so Σ_e f_e = 1. If the router is uniform (P_e = 1/E for every e) the loss is
  E · Σ_e f_e / E = Σ_e f_e = 1 whatever the (tie-broken) assignment, and it exceeds 1 when
  probability mass and assignments pile onto the same experts.

  Args:
    logits_GxSxE: router logits (computed in float32).
    top_k: experts per token, in [1, E].
    capacity: buffer slots per expert and group, >= 1.

  Returns:
    The `Routing`.

  Raises:
    ValueError: for a top_k outside [1, E] or capacity < 1.
  """
  g, s, e = logits_GxSxE.shape
  if not 1 <= top_k <= e or capacity < 1:
    raise ValueError(f"need 1 <= top_k <= {e} and capacity >= 1, got {top_k}, {capacity}.")
  logits = logits_GxSxE.astype(jnp.float32)
  probs_GxSxE = jax.nn.softmax(logits, axis=-1)
  top_p_GxSxK, top_idx_GxSxK = jax.lax.top_k(probs_GxSxE, top_k)
  if top_k > 1:
    gates_GxSxK = top_p_GxSxK / jnp.sum(top_p_GxSxK, axis=-1, keepdims=True)
  else:
    gates_GxSxK = top_p_GxSxK
  choice_GxSxKxE = jax.nn.one_hot(top_idx_GxSxK, e, dtype=jnp.float32)

  # Priority: all first choices in token order, then all second choices, ... (choice-major).
  choice_GxKSxE = jnp.swapaxes(choice_GxSxKxE, 1, 2).reshape(g, top_k * s, e)
  slot_GxKSxE = (jnp.cumsum(choice_GxKSxE, axis=1) - 1.0) * choice_GxKSxE
  slot_GxSxK = jnp.swapaxes(jnp.sum(slot_GxKSxE, axis=-1).reshape(g, top_k, s), 1, 2)
  # one_hot of a slot >= capacity is all zeros: the assignment is dropped.
  slot_GxSxKxC = jax.nn.one_hot(slot_GxSxK.astype(jnp.int32), capacity, dtype=jnp.float32)
  dispatch_GxSxExC = jnp.einsum("gske,gskc->gsec", choice_GxSxKxE, slot_GxSxKxC)
  combine_GxSxExC = jnp.einsum("gsk,gske,gskc->gsec", gates_GxSxK, choice_GxSxKxE, slot_GxSxKxC)

  fraction_GxE = jnp.mean(jnp.sum(choice_GxSxKxE, axis=2), axis=1) / top_k
  mean_prob_GxE = jnp.mean(probs_GxSxE, axis=1)
  aux_loss = e * jnp.mean(jnp.sum(fraction_GxE * mean_prob_GxE, axis=-1))
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  dropped = 1.0 - jnp.sum(dispatch_GxSxExC) / (g * s * top_k)
  return Routing(dispatch_GxSxExC, combine_GxSxExC, aux_loss, z_loss, dropped)


class MoeBlock(nn.Module):
  """A SwiGLU mixture of experts: params `router` [D, E], `gate`/`up` [E, D, F], `down` [E, F, D].

  Each expert is the dense `MlpBlock`'s SwiGLU with its own weights. Sows `AUX_LOSS` and `Z_LOSS`
  into the "intermediates" collection (read them with `mutable=["intermediates"]`).
  """

  config: "TransformerConfig"

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    b, length, d = x_BxLxD.shape
    e, f = cfg.num_experts, cfg.mlp_dim
    s = min(cfg.moe_group_size or length, length)
    if length % s:
      raise ValueError(f"moe_group_size {s} does not divide the sequence length {length}.")
    x_GxSxD = x_BxLxD.reshape(b * length // s, s, d)
    capacity = expert_capacity(
      s, num_experts=e, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor
    )

    # The router is tiny (D x E) and replicated: top-k over a sharded expert axis would gather it.
    router_DxE = Kernel((d, e), (EMBED, None), 0, 1, cfg.param_dtype, name="router")()
    logits_GxSxE = jnp.einsum(
      "gsd,de->gse", x_GxSxD.astype(jnp.float32), router_DxE.astype(jnp.float32)
    )
    routing = route(logits_GxSxE, top_k=cfg.top_k, capacity=capacity)
    self.sow("intermediates", AUX_LOSS, routing.aux_loss)
    self.sow("intermediates", Z_LOSS, routing.z_loss)

    expert_axes = (EXPERT, BATCH, None, EMBED)
    dispatch = routing.dispatch_GxSxExC.astype(cfg.dtype)
    x_ExGxCxD = jnp.einsum("gsec,gsd->egcd", dispatch, x_GxSxD)
    x_ExGxCxD = nn.with_logical_constraint(x_ExGxCxD, expert_axes)

    def kernel(name: str, shape: tuple[int, int, int], axes: tuple[str, str, str]) -> jax.Array:
      # Fan-in over the middle axis, each expert initialised as its own matrix.
      return Kernel(shape, (EXPERT, *axes), 1, 2, cfg.param_dtype, batch_axis=0, name=name)()

    gate_ExDxF = kernel("gate", (e, d, f), (EMBED, MLP)).astype(cfg.dtype)
    up_ExDxF = kernel("up", (e, d, f), (EMBED, MLP)).astype(cfg.dtype)
    down_ExFxD = kernel("down", (e, f, d), (MLP, EMBED)).astype(cfg.dtype)
    gate_ExGxCxF = jnp.einsum("egcd,edf->egcf", x_ExGxCxD, gate_ExDxF)
    up_ExGxCxF = jnp.einsum("egcd,edf->egcf", x_ExGxCxD, up_ExDxF)
    h_ExGxCxF = nn.with_logical_constraint(
      nn.silu(gate_ExGxCxF) * up_ExGxCxF, (EXPERT, BATCH, None, MLP)
    )
    y_ExGxCxD = jnp.einsum("egcf,efd->egcd", h_ExGxCxF, down_ExFxD)
    y_ExGxCxD = nn.with_logical_constraint(y_ExGxCxD, expert_axes)

    combine = routing.combine_GxSxExC.astype(cfg.dtype)
    y_GxSxD = jnp.einsum("gsec,egcd->gsd", combine, y_ExGxCxD)
    y_BxLxD = y_GxSxD.reshape(b, length, d)
    return nn.with_logical_constraint(y_BxLxD, (BATCH, LENGTH, EMBED))


def collect_losses(intermediates: dict) -> dict[str, jax.Array]:
  """Sums each sown MoE loss over layers: {AUX_LOSS: Σ_layers, Z_LOSS: Σ_layers, "moe_layers": n}.

  Args:
    intermediates: the "intermediates" collection returned by `apply(..., mutable=[...])`.

  Returns:
    Float32 scalars; all zero (and "moe_layers" 0) for a model without MoE layers.
  """
  sums = {AUX_LOSS: jnp.zeros((), jnp.float32), Z_LOSS: jnp.zeros((), jnp.float32)}
  layers = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
    name = path[-2].key if len(path) >= 2 else None  # sow stores a tuple: (..., name, index).
    if name in sums:
      sums[name] = sums[name] + leaf.astype(jnp.float32)
      layers += name == AUX_LOSS
  return {**sums, "moe_layers": jnp.asarray(layers, jnp.float32)}
