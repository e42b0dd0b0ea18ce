"""A small vision transformer (ViT) for image classification, logical-axis annotated.

Images [B, H, W, C] are cut into non-overlapping p x p patches; each flattened patch goes through a
linear patch embedding (`patch_embed`), gets a learned position embedding (`pos_embed`) and,
with `pool="cls"`, a learned class token is prepended (`cls_token`). The encoder is the
transformer's own pre-norm `Block`, run bidirectionally without RoPE (`TransformerConfig(causal=False,
rope=False)`), so attention, the SwiGLU MLP, RMSNorm and their sharding annotations are shared with
the language model. A final RMSNorm, mean pooling over patches (or the class token) and a linear
`head` give float32 class logits.

Parameter naming follows the transformer's contract: `block_0` ... `block_{n-1}` (the layer
fragment layout strides over them), plus `patch_embed/{kernel,bias}`, `pos_embed/embedding`,
`cls_token` (pool "cls" only), `final_norm/scale` and `head/{kernel,bias}`.
`ddiloco.tasks.vision` decides which of them the syncer merges with the weighted mean.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ddiloco.models.layers import fan_in_init
from ddiloco.models.transformer import Block, RMSNorm, TransformerConfig
from ddiloco.types import BATCH, EMBED, LENGTH

POOLS = ("mean", "cls")
_EMBED_STDDEV = 0.02  # Position embeddings and class token, as the original ViT.


@dataclasses.dataclass(frozen=True, kw_only=True)
class VitConfig:
  """Shape and numerics of a `VisionTransformer`.

  Attributes:
    image_size: height and width of the (square) input images.
    patch_size: side of the square patches; must divide `image_size`.
    channels: input channels.
    num_classes: output classes.
    d_model, num_layers, num_heads, head_dim, mlp_dim: the encoder (as `TransformerConfig`).
    pool: "mean" (global average over patches, the default: better on small data, as in "Better
      plain ViT baselines") or "cls" (a learned class token).
    dtype, param_dtype, dropout_rate, remat: as `TransformerConfig`.
  """

  image_size: int
  patch_size: int
  channels: int = 1
  num_classes: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  pool: str = "mean"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  dropout_rate: float = 0.0
  remat: bool = False

  def __post_init__(self):
    for name in ("image_size", "patch_size", "channels", "num_classes"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"VitConfig.{name} must be a positive int, got {value!r}.")
    if self.image_size % self.patch_size:
      raise ValueError(
        f"VitConfig.patch_size {self.patch_size} must divide image_size {self.image_size}."
      )
    if self.pool not in POOLS:
      raise ValueError(f"VitConfig.pool must be one of {POOLS}, got {self.pool!r}.")
    # Validates the encoder fields (and canonicalises the dtypes there).
    encoder = self.encoder_config()
    object.__setattr__(self, "dtype", encoder.dtype)
    object.__setattr__(self, "param_dtype", encoder.param_dtype)

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def num_tokens(self) -> int:
    """Encoder sequence length: the patches, plus the class token with pool "cls"."""
    return self.num_patches + (self.pool == "cls")

  def encoder_config(self) -> TransformerConfig:
    """The blocks' config: bidirectional, no RoPE; vocab_size is unused by `Block` (the classes)."""
    return TransformerConfig(
      vocab_size=self.num_classes,
      d_model=self.d_model,
      num_layers=self.num_layers,
      num_heads=self.num_heads,
      head_dim=self.head_dim,
      mlp_dim=self.mlp_dim,
      max_len=self.num_tokens,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      dropout_rate=self.dropout_rate,
      remat=self.remat,
      causal=False,
      rope=False,
    )


class _Linear(nn.Module):
  """x @ kernel + bias with logical axes; params `kernel` [N, M] and `bias` [M]."""

  features: int
  axes: tuple[str | None, str | None]
  dtype: Any
  param_dtype: Any
  zero_init: bool = False

  @nn.compact
  def __call__(self, x_BxTxN: jax.Array) -> jax.Array:
    kernel_init = nn.initializers.zeros_init() if self.zero_init else fan_in_init(0, 1)
    kernel = self.param(
      "kernel",
      nn.with_logical_partitioning(kernel_init, self.axes),
      (x_BxTxN.shape[-1], self.features),
      self.param_dtype,
    )
    bias_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[1:])
    bias = self.param("bias", bias_init, (self.features,), self.param_dtype)
    y = jnp.einsum("...n,nm->...m", x_BxTxN.astype(self.dtype), kernel.astype(self.dtype))
    return y + bias.astype(self.dtype)


class VisionTransformer(nn.Module):
  """Images [B, H, W, C] -> float32 class logits [B, num_classes]."""

  config: VitConfig

  @nn.compact
  def __call__(self, images_BxHxWxC: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """Runs the model.

    Args:
      images_BxHxWxC: float images (any scale; the data pipeline gives [0, 1]).
      deterministic: disables dropout; when False (and dropout_rate > 0) a "dropout" rng is needed.

    Returns:
      float32 logits of shape [B, num_classes].

    Raises:
      ValueError: if the images do not have the configured size and channels.
    """
    cfg = self.config
    side, p, c = cfg.image_size, cfg.patch_size, cfg.channels
    if images_BxHxWxC.shape[1:] != (side, side, c):
      raise ValueError(f"Expected images [B, {side}, {side}, {c}], got {images_BxHxWxC.shape}.")
    b, n = images_BxHxWxC.shape[0], side // p
    patches = images_BxHxWxC.reshape(b, n, p, n, p, c).transpose(0, 1, 3, 2, 4, 5)
    patches_BxTxP = patches.reshape(b, n * n, p * p * c)
    x_BxTxD = _Linear(cfg.d_model, (None, EMBED), cfg.dtype, cfg.param_dtype, name="patch_embed")(
      patches_BxTxP
    )
    if cfg.pool == "cls":
      cls_D = self.param(
        "cls_token",
        nn.with_logical_partitioning(nn.initializers.normal(_EMBED_STDDEV), (EMBED,)),
        (cfg.d_model,),
        cfg.param_dtype,
      )
      cls_Bx1xD = jnp.broadcast_to(cls_D.astype(cfg.dtype), (b, 1, cfg.d_model))
      x_BxTxD = jnp.concatenate([cls_Bx1xD, x_BxTxD], axis=1)
    pos_TxD = nn.Embed(
      num_embeddings=cfg.num_tokens,
      features=cfg.d_model,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(_EMBED_STDDEV), (LENGTH, EMBED)
      ),
      name="pos_embed",
    ).embedding
    x_BxTxD = x_BxTxD + pos_TxD.astype(cfg.dtype)[None]
    x_BxTxD = nn.with_logical_constraint(x_BxTxD, (BATCH, LENGTH, EMBED))

    encoder = cfg.encoder_config()
    block_cls = nn.remat(Block, static_argnums=(2,)) if cfg.remat else Block
    for i in range(cfg.num_layers):
      x_BxTxD = block_cls(encoder, name=f"block_{i}")(x_BxTxD, deterministic)
    x_BxTxD = RMSNorm(encoder, name="final_norm")(x_BxTxD)
    pooled_BxD = x_BxTxD[:, 0] if cfg.pool == "cls" else jnp.mean(x_BxTxD, axis=1)
    # Zero-initialised head (as big_vision): the initial loss is exactly log(num_classes).
    logits_BxN = _Linear(
      cfg.num_classes, (EMBED, None), jnp.float32, cfg.param_dtype, zero_init=True, name="head"
    )(pooled_BxD)
    return nn.with_logical_constraint(logits_BxN, (BATCH, None))


def classification_loss(
  logits_BxN: jax.Array, labels_B: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Mean softmax cross-entropy, the number of examples and the top-1 accuracy.

  Args:
    logits_BxN: unnormalised class scores (computed in float32).
    labels_B: int class ids.

  Returns:
    (loss, num_examples, accuracy), float32 scalars.

  Raises:
    ValueError: if shapes disagree.
  """
  if logits_BxN.ndim != 2 or logits_BxN.shape[:1] != labels_B.shape:
    raise ValueError(f"logits {logits_BxN.shape} do not match labels {labels_B.shape}.")
  logits = logits_BxN.astype(jnp.float32)
  log_z_B = jax.nn.logsumexp(logits, axis=-1)
  target_B = jnp.take_along_axis(logits, labels_B[:, None], axis=-1)[:, 0]
  loss = jnp.mean(log_z_B - target_B)
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels_B).astype(jnp.float32))
  return loss, jnp.asarray(labels_B.shape[0], jnp.float32), accuracy
