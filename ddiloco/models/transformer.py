"""A dense decoder-only transformer (flax linen, t5x style) with logical axis annotations.

Every parameter initializer is wrapped in `nn.with_logical_partitioning` so that `ddiloco.parallel`
can map the logical names ("embed", "heads", "mlp", ...) onto one learner's mesh through a single
rules table; activations carry `nn.with_logical_constraint` hints that are no-ops unless a mesh and
rules are in context (see `ddiloco.parallel.partitioning.partitioning_context`).

Parameter naming is part of the contract with the rest of the system:
- one submodule per layer, `block_0`, `block_1`, ... (no `nn.scan`), because the layer fragment
  layout (docs/algorithm.md §2) strides over these names;
- `token_embed/embedding` and `unembed/kernel` are the embedding tensors that the syncer merges with
  the weighted mean instead of RDA (docs/algorithm.md §4.5), recognised by `is_embedding_path`;
- a mixture-of-experts layer (`num_experts > 0`, every `moe_every`-th block) holds its feed-forward
  weights under `block_{i}/moe/...` instead of `block_{i}/mlp/...` (see `ddiloco.models.moe`).

The encoder flags (`causal=False`, `rope=False`) let the vision transformer (`ddiloco.models.vit`)
reuse the same blocks bidirectionally with learned position embeddings.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.models.layers import Kernel, fan_in_init
from ddiloco.models.moe import MoeBlock
from ddiloco.types import BATCH, EMBED, HEADS, KV, LENGTH, MLP, VOCAB

EMBEDDING_PATH_PREFIXES = ("token_embed", "unembed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Shape and numerics of a `Transformer`.

  Attributes:
    vocab_size: number of token ids.
    d_model: width of the residual stream.
    num_layers: number of transformer blocks (`block_0` ... `block_{num_layers-1}`).
    num_heads: query heads.
    num_kv_heads: key and value heads; None (default) = `num_heads`, plain multi-head attention.
      Fewer is grouped-query attention (Llama 2 70B, Llama 3): query heads
      [j * num_heads / num_kv_heads, (j + 1) * num_heads / num_kv_heads) share key/value head j.
      It must divide `num_heads` (and, on a learner with tensor parallelism, its model axis must
      divide it: the key/value heads shard over that axis as the query heads do).
    head_dim: width of one head; must be even when `rope` (RoPE rotates pairs of features).
    mlp_dim: hidden width of the SwiGLU MLP.
    max_len: longest sequence the model accepts.
    dtype: compute dtype of matmuls (a dtype or its name, e.g. "bfloat16"); logits are float32.
    param_dtype: storage dtype of the parameters.
    tie_embeddings: use `token_embed/embedding` transposed as the output projection (no `unembed`).
    dropout_rate: residual dropout, active only when `deterministic=False`.
    remat: rematerialise each block in the backward pass (`nn.remat`), trading compute for memory.
    causal: mask attention to earlier positions (a decoder); False gives a bidirectional encoder.
    rope: rotary position embeddings on queries and keys; False leaves positions to the caller.
    rope_theta: RoPE's base wavelength (Llama 2: 10,000; Llama 3: 500,000).
    norm_eps: epsilon of every RMSNorm (added to the mean square).
    num_experts: experts per MoE layer; 0 (default) makes every feed-forward layer dense.
    top_k: experts each token is routed to, in [1, num_experts].
    capacity_factor: expert buffer size relative to an even split (`moe.expert_capacity`).
    moe_every: block i is an MoE layer iff (i + 1) % moe_every == 0 (1: all; 2: every other
      block, starting with block_1, as Switch/GShard).
    aux_loss_weight: weight of the load-balancing loss, summed over MoE layers, in the objective.
    router_z_loss_weight: weight of the router z-loss, summed over MoE layers (0: off).
    moe_group_size: tokens routed together (capacity is per group); 0, or more than the sequence
      length, = one group per sequence; otherwise it must divide the sequence length.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  max_len: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  tie_embeddings: bool = False
  dropout_rate: float = 0.0
  remat: bool = False
  causal: bool = True
  rope: bool = True
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  num_kv_heads: int | None = None
  num_experts: int = 0
  top_k: int = 2
  capacity_factor: float = 1.25
  moe_every: int = 1
  aux_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.0
  moe_group_size: int = 0

  def __post_init__(self):
    for name in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "head_dim",
      "mlp_dim",
      "max_len",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}.")
    if self.rope and self.head_dim % 2:
      raise ValueError(f"TransformerConfig.head_dim must be even for RoPE, got {self.head_dim}.")
    self._check_kv_heads()
    if not self.rope_theta > 0 or not self.norm_eps > 0:  # `not >` refuses NaN too.
      raise ValueError(
        f"TransformerConfig.rope_theta and norm_eps must be > 0, got {self.rope_theta} and "
        f"{self.norm_eps}."
      )
    self._check_moe()
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(
        f"TransformerConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}."
      )
    # Accept dtype names so that gin files can say `dtype = "bfloat16"`; store canonical dtypes so
    # that equal configs hash equal (the config is a static field of the linen module).
    for name in ("dtype", "param_dtype"):
      try:
        dtype = jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f"TransformerConfig.{name}: not a dtype: {getattr(self, name)!r}.") from e
      if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"TransformerConfig.{name} must be a floating dtype, got {dtype}.")
      object.__setattr__(self, name, dtype)

  def _check_kv_heads(self) -> None:
    # Stored resolved, so that a config that spells out the default equals one that does not.
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    kv = self.num_kv_heads
    if isinstance(kv, bool) or not isinstance(kv, int | np.integer) or kv < 1:
      raise ValueError(f"TransformerConfig.num_kv_heads must be a positive int, got {kv!r}.")
    if self.num_heads % kv:
      raise ValueError(
        f"TransformerConfig.num_kv_heads={kv} must divide num_heads={self.num_heads}."
      )

  def _check_moe(self) -> None:
    for name in ("num_experts", "moe_group_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"TransformerConfig.{name} must be an int >= 0, got {value!r}.")
    if self.moe_every < 1:
      raise ValueError(f"TransformerConfig.moe_every must be >= 1, got {self.moe_every}.")
    if self.capacity_factor <= 0:
      raise ValueError(
        f"TransformerConfig.capacity_factor must be > 0, got {self.capacity_factor}."
      )
    if min(self.aux_loss_weight, self.router_z_loss_weight) < 0:
      raise ValueError("TransformerConfig.aux_loss_weight and router_z_loss_weight must be >= 0.")
    if self.num_experts and not 1 <= self.top_k <= self.num_experts:
      raise ValueError(
        f"TransformerConfig.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}."
      )

  @property
  def is_moe(self) -> bool:
    """Whether any block is a mixture-of-experts layer."""
    return self.num_experts > 0 and self.num_layers >= self.moe_every

  def is_moe_layer(self, layer: int) -> bool:
    """Whether block `layer` (0-based) is a mixture-of-experts layer."""
    return self.num_experts > 0 and (layer + 1) % self.moe_every == 0


def is_embedding_path(path: str) -> bool:
  """Whether a flat parameter path ("token_embed/embedding") names an embedding tensor.

  docs/algorithm.md §4.5: embedding tensors (input embedding and unembedding) are merged with the weighted
  mean; every other tensor with RDA.

  Args:
    path: a leaf path as produced by `ddiloco.fragments.tree.flatten`, relative to the params
      collection (no leading "params/").

  Returns:
    True iff the first path component is one of `EMBEDDING_PATH_PREFIXES`.
  """
  return path.split("/", 1)[0] in EMBEDDING_PATH_PREFIXES


class RMSNorm(nn.Module):
  """Root-mean-square layer norm with a learned scale, computed in float32."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    scale_D = self.param(
      "scale",
      nn.with_logical_partitioning(nn.initializers.ones_init(), (EMBED,)),
      (cfg.d_model,),
      cfg.param_dtype,
    )
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + cfg.norm_eps)
    return (x * scale_D.astype(jnp.float32)).astype(cfg.dtype)


def _rope(x_BxLxHxK: jax.Array, positions_L: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, computed in float32.

  The split-half convention: feature j of a head rotates with feature j + K/2 at frequency
  theta^(-2j/K), as Hugging Face's Llama (`rotate_half`), not Meta's original interleaved pairs
  (2j, 2j + 1). Query and key weights therefore map to Hugging Face's without a permutation
  (ddiloco/models/hf_llama.py).
  """
  head_dim = x_BxLxHxK.shape[-1]
  fraction_K2 = 2.0 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  inv_freq_K2 = theta**-fraction_K2
  angle_LxK2 = positions_L.astype(jnp.float32)[:, None] * inv_freq_K2[None, :]
  sin, cos = jnp.sin(angle_LxK2)[None, :, None, :], jnp.cos(angle_LxK2)[None, :, None, :]
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
  """Multi-head (or grouped-query) self-attention, causal and with RoPE unless the config says not.

  Params `query` [D, H, K], `key` and `value` [D, G, K] (G = `num_kv_heads`), `out` [H, K, D].
  """

  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    activation_axes = (BATCH, LENGTH, HEADS, KV)

    def project(name: str, heads: int) -> jax.Array:
      kernel_DxHxK = Kernel(
        (d, heads, k), (EMBED, HEADS, KV), 0, (1, 2), cfg.param_dtype, name=name
      )()
      y_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, kernel_DxHxK.astype(cfg.dtype))
      return nn.with_logical_constraint(y_BxLxHxK, activation_axes)

    q_BxLxHxK = project("query", h)
    k_BxLxGxK = project("key", g)
    v_BxLxGxK = project("value", g)
    length = x_BxLxD.shape[1]
    if cfg.rope:
      positions_L = jnp.arange(length)
      q_BxLxHxK = _rope(q_BxLxHxK, positions_L, cfg.rope_theta)
      k_BxLxGxK = _rope(k_BxLxGxK, positions_L, cfg.rope_theta)
    if cfg.causal:
      causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))

    if g == h:
      # Scores and softmax in float32 whatever the compute dtype, for a stable normaliser.
      scores_BxHxLxL = jnp.einsum(
        "bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxGxK, preferred_element_type=jnp.float32
      ) / np.sqrt(k)
      if cfg.causal:
        scores_BxHxLxL = jnp.where(
          causal_LxL[None, None], scores_BxHxLxL, jnp.finfo(jnp.float32).min
        )
      probs_BxHxLxL = jax.nn.softmax(scores_BxHxLxL, axis=-1).astype(cfg.dtype)
      ctx_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxL, v_BxLxGxK)
    else:
      # Grouped queries: query head j * R + r (R = H / G) attends with key/value head j.
      b, r = x_BxLxD.shape[0], h // g
      q_BxLxGxRxK = q_BxLxHxK.reshape(b, length, g, r, k)
      scores_BxGxRxLxL = jnp.einsum(
        "bqgrk,bsgk->bgrqs", q_BxLxGxRxK, k_BxLxGxK, preferred_element_type=jnp.float32
      ) / np.sqrt(k)
      if cfg.causal:
        scores_BxGxRxLxL = jnp.where(
          causal_LxL[None, None, None], scores_BxGxRxLxL, jnp.finfo(jnp.float32).min
        )
      probs_BxGxRxLxL = jax.nn.softmax(scores_BxGxRxLxL, axis=-1).astype(cfg.dtype)
      ctx_BxLxGxRxK = jnp.einsum("bgrqs,bsgk->bqgrk", probs_BxGxRxLxL, v_BxLxGxK)
      ctx_BxLxHxK = ctx_BxLxGxRxK.reshape(b, length, h, k)
    ctx_BxLxHxK = nn.with_logical_constraint(ctx_BxLxHxK, activation_axes)

    out_HxKxD = Kernel((h, k, d), (HEADS, KV, EMBED), (0, 1), 2, cfg.param_dtype, name="out")()
    y_BxLxD = jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, out_HxKxD.astype(cfg.dtype))
    return nn.with_logical_constraint(y_BxLxD, (BATCH, LENGTH, EMBED))


class MlpBlock(nn.Module):
  """SwiGLU MLP: down(silu(gate(x)) * up(x)); params `gate`, `up`, `down`."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    d, f = cfg.d_model, cfg.mlp_dim
    gate_DxF = Kernel((d, f), (EMBED, MLP), 0, 1, cfg.param_dtype, name="gate")()
    up_DxF = Kernel((d, f), (EMBED, MLP), 0, 1, cfg.param_dtype, name="up")()
    down_FxD = Kernel((f, d), (MLP, EMBED), 0, 1, cfg.param_dtype, name="down")()
    gate_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, gate_DxF.astype(cfg.dtype))
    up_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, up_DxF.astype(cfg.dtype))
    h_BxLxF = nn.with_logical_constraint(nn.silu(gate_BxLxF) * up_BxLxF, (BATCH, LENGTH, MLP))
    y_BxLxD = jnp.einsum("blf,fd->bld", h_BxLxF, down_FxD.astype(cfg.dtype))
    return nn.with_logical_constraint(y_BxLxD, (BATCH, LENGTH, EMBED))


class Block(nn.Module):
  """One pre-norm transformer layer: x + attn(norm(x)), then x + ffn(norm(x)).

  The feed-forward network is the dense `MlpBlock` ("mlp") or, when `moe`, a `MoeBlock` ("moe");
  tokens an MoE layer drops for lack of capacity get a zero output and keep x unchanged.
  """

  config: TransformerConfig
  moe: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, deterministic: bool) -> jax.Array:
    cfg = self.config
    dropout = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=())
    h = RMSNorm(cfg, name="pre_attn_norm")(x_BxLxD)
    h = Attention(cfg, name="attn")(h)
    x_BxLxD = x_BxLxD + dropout(h, deterministic=deterministic)
    h = RMSNorm(cfg, name="pre_mlp_norm")(x_BxLxD)
    h = MoeBlock(cfg, name="moe")(h) if self.moe else MlpBlock(cfg, name="mlp")(h)
    x_BxLxD = x_BxLxD + dropout(h, deterministic=deterministic)
    return nn.with_logical_constraint(x_BxLxD, (BATCH, LENGTH, EMBED))


class Transformer(nn.Module):
  """Decoder-only language model: tokens [B, L] -> float32 logits [B, L, V].

  Parameters: `token_embed/embedding` [V, D], `block_{i}/...` for each layer, `final_norm/scale`
  [D] and, unless `tie_embeddings`, `unembed/kernel` [D, V]. MoE layers sow their auxiliary losses
  into the "intermediates" collection (`ddiloco.models.moe.collect_losses`).
  """

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """Runs the model.

    Args:
      tokens_BxL: int token ids in [0, vocab_size).
      deterministic: disables dropout; when False (and dropout_rate > 0) a "dropout" rng is needed.

    Returns:
      float32 logits of shape [B, L, vocab_size]; position t only sees tokens 0..t (when causal).

    Raises:
      ValueError: if the input is not [B, L] or L exceeds `max_len`.
    """
    cfg = self.config
    if tokens_BxL.ndim != 2:
      raise ValueError(f"Expected tokens of shape [batch, length], got {tokens_BxL.shape}.")
    if tokens_BxL.shape[1] > cfg.max_len:
      raise ValueError(f"Sequence length {tokens_BxL.shape[1]} exceeds max_len {cfg.max_len}.")
    embed = nn.Embed(
      num_embeddings=cfg.vocab_size,
      features=cfg.d_model,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      # std 1/sqrt(D) (fan-in over the feature axis, as nanodo): with a tied output projection the
      # initial logits then have unit variance; pre-norm blocks rescale the residual stream anyway.
      embedding_init=nn.with_logical_partitioning(fan_in_init(1, 0), (VOCAB, EMBED)),
      name="token_embed",
    )
    x_BxLxD = nn.with_logical_constraint(embed(tokens_BxL), (BATCH, LENGTH, EMBED))

    # One named submodule per layer (no nn.scan): the layer fragment layout strides over these.
    block_cls = nn.remat(Block, static_argnums=(2,)) if cfg.remat else Block
    for i in range(cfg.num_layers):
      x_BxLxD = block_cls(cfg, moe=cfg.is_moe_layer(i), name=f"block_{i}")(x_BxLxD, deterministic)
    x_BxLxD = RMSNorm(cfg, name="final_norm")(x_BxLxD)

    if cfg.tie_embeddings:
      kernel_DxV = embed.embedding.T
    else:
      kernel_DxV = Kernel(
        (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB), 0, 1, cfg.param_dtype, name="unembed"
      )()
    logits_BxLxV = jnp.einsum(
      "bld,dv->blv",
      x_BxLxD,
      kernel_DxV.astype(cfg.dtype),
      preferred_element_type=jnp.float32,
    )
    return nn.with_logical_constraint(logits_BxLxV, (BATCH, LENGTH, VOCAB))


def lm_loss(
  logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Mean next-token cross-entropy over unmasked positions.

  Inputs and targets are already shifted by the data pipeline: `targets_BxL[b, t]` is the token
  that should follow position t.

  Args:
    logits_BxLxV: unnormalised scores (any float dtype; computed in float32).
    targets_BxL: int target ids.
    mask_BxL: optional weights, 1 for positions that count and 0 for padding; None counts all.

  Returns:
    (loss, num_tokens): the mean cross-entropy over unmasked positions (0 when none is unmasked)
    and the number (sum of weights) of unmasked positions, both float32 scalars.

  Raises:
    ValueError: if shapes disagree.
  """
  if logits_BxLxV.shape[:-1] != targets_BxL.shape:
    raise ValueError(f"logits {logits_BxLxV.shape} do not match targets {targets_BxL.shape}.")
  if mask_BxL is not None and mask_BxL.shape != targets_BxL.shape:
    raise ValueError(f"mask {mask_BxL.shape} does not match targets {targets_BxL.shape}.")
  logits = logits_BxLxV.astype(jnp.float32)
  log_z_BxL = jax.nn.logsumexp(logits, axis=-1)
  target_logit_BxL = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  nll_BxL = log_z_BxL - target_logit_BxL
  if mask_BxL is None:
    weights_BxL = jnp.ones_like(nll_BxL)
  else:
    weights_BxL = mask_BxL.astype(jnp.float32)
  num_tokens = jnp.sum(weights_BxL)
  # where() rather than a bare multiply, so that a padded position whose logits are inf/nan cannot
  # turn the reported loss into nan (0 * nan = nan).
  total = jnp.sum(jnp.where(weights_BxL > 0, nll_BxL * weights_BxL, 0.0))
  loss = total / jnp.maximum(num_tokens, 1e-9)
  return loss, num_tokens
