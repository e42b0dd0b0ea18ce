"""Named model sizes (dense, mixture-of-experts and vision) and parameter counters.

The entry points register `transformer_config` and `vit_config` with gin (as
`ddiloco.transformer_config` and `ddiloco.vit_config`, ddiloco/launch/configurables.py), so a
model .gin file binds `transformer_config.size = "tiny"` and a run file
refers to `@transformer_config()`. The functions stay plain Python: calling them directly ignores
gin bindings.

Sizes (parameter counts with the default vocabulary of each size, untied embeddings):
- "tiny":  d=128, 4 layers, 4 heads x 32, mlp 512, vocab 256 -> 1,115,264 (~1.1M); unit tests and
  laptop runs.
- "small": d=384, 6 layers, 6 heads x 64, mlp 1536, vocab 256 -> 14,357,376 (~14M); trains a few
  hundred steps on a 2-core CPU in minutes.
- "2b", "5b", "9b": Gemma-like shapes (wide heads, SwiGLU with a wide hidden layer, RMSNorm, RoPE)
  with a 32k vocabulary; plain multi-head attention (no MQA/GQA), so attention is a little larger
  than in Gemma at the same width. Counts: 2,248,222,720 / 5,033,364,480 / 9,175,344,640.

Mixture-of-experts sizes (`ddiloco.models.moe`): a dense size's shape with every other block's MLP
replaced by E SwiGLU experts of the same width, top-2 routing, capacity factor 1.25 (Switch/GShard
conventions; the paper does not publish its MoE shape, so these are our choices):
- "tiny_moe":  "tiny" with 4 experts in blocks 1 and 3 -> 2,295,936 params (1,509,504 active per
  token); unit tests.
- "small_moe": "small" with 8 experts in blocks 1, 3, 5 -> 51,525,504 (19,675,008 active).
- "5b_moe": the "5b" backbone with 8 experts in 16 of 32 blocks -> 17,717,332,992 params,
  6,845,697,024 active: built abstractly (`partitioning.abstract_params`) on this machine.

Vision sizes (`vit_config`, `ddiloco.models.vit`), 8 x 8 single-channel images in 2 x 2 patches
(scikit-learn's digits), 10 classes, mean pooling:
- "tiny":  d=64, 4 layers, 4 heads x 16, mlp 256 -> 264,714 params.
- "small": d=128, 6 layers, 4 heads x 32, mlp 512 -> 1,578,506 params.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ddiloco.models import hf_llama
from ddiloco.models.transformer import Transformer, TransformerConfig
from ddiloco.models.vit import VitConfig

# Shapes per size. vocab_size and max_len are the defaults used when the caller passes None.
_SIZES: dict[str, dict[str, Any]] = {
  "tiny": dict(
    d_model=128, num_layers=4, num_heads=4, head_dim=32, mlp_dim=512, vocab_size=256, max_len=512
  ),
  "small": dict(
    d_model=384, num_layers=6, num_heads=6, head_dim=64, mlp_dim=1536, vocab_size=256, max_len=1024
  ),
  # Gemma-2B width/depth (d=2048, 18 layers, 8 x 256 heads, 16k MLP).
  "2b": dict(
    d_model=2048,
    num_layers=18,
    num_heads=8,
    head_dim=256,
    mlp_dim=16384,
    vocab_size=32768,
    max_len=8192,
  ),
  # The paper's 5B dense model: its shape is not published; 32 layers at d=3072 with 4x MLP lands
  # on 5.0B.
  "5b": dict(
    d_model=3072,
    num_layers=32,
    num_heads=24,
    head_dim=128,
    mlp_dim=12288,
    vocab_size=32768,
    max_len=8192,
  ),
  # Gemma-2-9B width/depth (d=3584, 42 layers, 16 x 256 heads, 14336 MLP).
  "9b": dict(
    d_model=3584,
    num_layers=42,
    num_heads=16,
    head_dim=256,
    mlp_dim=14336,
    vocab_size=32768,
    max_len=8192,
  ),
}
# MoE sizes: a dense size plus the MoE fields of TransformerConfig.
_MOE = dict(top_k=2, capacity_factor=1.25, moe_every=2)
_SIZES["tiny_moe"] = dict(_SIZES["tiny"], num_experts=4, **_MOE)
_SIZES["small_moe"] = dict(_SIZES["small"], num_experts=8, **_MOE)
_SIZES["5b_moe"] = dict(_SIZES["5b"], num_experts=8, **_MOE)

SIZES = tuple(_SIZES)

_VIT_SIZES: dict[str, dict[str, Any]] = {
  "tiny": dict(d_model=64, num_layers=4, num_heads=4, head_dim=16, mlp_dim=256),
  "small": dict(d_model=128, num_layers=6, num_heads=4, head_dim=32, mlp_dim=512),
}
VIT_SIZES = tuple(_VIT_SIZES)
# scikit-learn's digits: 8 x 8 grey images, 10 classes; 2 x 2 patches give 16 tokens.
_VIT_DEFAULTS: dict[str, Any] = dict(image_size=8, patch_size=2, channels=1, num_classes=10)


def transformer_config(
  size: str, *, vocab_size: int | None = None, max_len: int | None = None, **overrides: Any
) -> TransformerConfig:
  """Returns the `TransformerConfig` of a named size.

  Args:
    size: one of `SIZES`.
    vocab_size: vocabulary size; None picks the size's default (256, the byte vocabulary, for
      "tiny"/"small"(_moe); 32768 for "2b"/"5b"/"9b"/"5b_moe"). It must match the data
      pipeline's tokenizer.
    max_len: longest sequence; None picks the size's default.
    **overrides: any other `TransformerConfig` field (e.g. `dtype="bfloat16"`, `remat=True`,
      `num_layers=2`).

  Returns:
    The config, validated by `TransformerConfig.__post_init__`.

  Raises:
    ValueError: for an unknown size or an override that is not a `TransformerConfig` field.
  """
  if size not in _SIZES:
    raise ValueError(f"Unknown model size {size!r}; expected one of {SIZES}.")
  fields = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"Unknown TransformerConfig fields {unknown}; valid: {sorted(fields)}.")
  kwargs: dict[str, Any] = dict(_SIZES[size])
  if vocab_size is not None:
    kwargs["vocab_size"] = vocab_size
  if max_len is not None:
    kwargs["max_len"] = max_len
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


def hf_llama_config(path: str, **overrides: Any) -> TransformerConfig:
  """The `TransformerConfig` of a Hugging Face Llama checkpoint folder, from its config.json.

  For a run started from the checkpoint (`RunConfig.hf_checkpoint`) that changes what the checkpoint
  does not fix, e.g. in gin `RunConfig.model = @hf_llama_config()`,
  `hf_llama_config.path = %INIT_FROM`, `hf_llama_config.dtype = "bfloat16"`.

  Args:
    path: the checkpoint folder.
    **overrides: `TransformerConfig` fields outside `hf_llama.ARCHITECTURE_FIELDS` (`dtype`,
      `param_dtype`, `remat`, `max_len`, `dropout_rate`).

  Raises:
    FileNotFoundError, ValueError: as `hf_llama.read_config`.
  """
  return hf_llama.read_config(path, **overrides)


def vit_config(size: str, **overrides: Any) -> VitConfig:
  """Returns the `VitConfig` of a named vision size (defaults: 8 x 8 x 1 images, 2 x 2 patches).

  Args:
    size: one of `VIT_SIZES`.
    **overrides: any other `VitConfig` field (e.g. `image_size=32`, `pool="cls"`).

  Returns:
    The config, validated by `VitConfig.__post_init__`.

  Raises:
    ValueError: for an unknown size or an override that is not a `VitConfig` field.
  """
  if size not in _VIT_SIZES:
    raise ValueError(f"Unknown ViT size {size!r}; expected one of {VIT_SIZES}.")
  fields = {f.name for f in dataclasses.fields(VitConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"Unknown VitConfig fields {unknown}; valid: {sorted(fields)}.")
  return VitConfig(**{**_VIT_DEFAULTS, **_VIT_SIZES[size], **overrides})


def count_active_params(config: TransformerConfig) -> int:
  """Parameters one token passes through: MoE layers count `top_k` experts (and the router).

  Equals the total for a dense config. Derived from the shapes: an MoE layer holds E experts of
  3·d·f weights plus a d·E router, of which a token uses k experts and the router.
  """
  total = count_params(_abstract_shapes(config))
  per_expert = 3 * config.d_model * config.mlp_dim
  moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
  return total - moe_layers * (config.num_experts - config.top_k) * per_expert


def _abstract_shapes(config: TransformerConfig) -> Any:
  """The params' shapes through jax.eval_shape: nothing is allocated (the 5b_moe is 17.7B)."""
  model = Transformer(config)
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


def count_params(params: Any) -> int:
  """Total number of scalars in a pytree of arrays (or `jax.ShapeDtypeStruct`s, or boxed params).

  Args:
    params: any pytree whose leaves have a `.shape`; flax `LogicallyPartitioned` boxes are pytree
      nodes, so boxed and unboxed trees count the same.

  Returns:
    The sum over leaves of the product of their shapes.
  """
  return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
