"""Named model sizes ("tiny", "small", "2b", "5b", "9b") and a parameter counter.

`transformer_config` is registered with gin (as `ddiloco.transformer_config`), so a model .gin file
binds `transformer_config.size = "tiny"` and a run file refers to `@transformer_config()`. The
function itself stays plain Python: calling it directly ignores gin bindings.

Sizes (parameter counts with the default vocabulary of each size, untied embeddings):
- "tiny":  d=128, 4 layers, 4 heads x 32, mlp 512, vocab 256 -> 1,115,264 (~1.1M); unit tests and
  laptop runs.
- "small": d=384, 6 layers, 6 heads x 64, mlp 1536, vocab 256 -> 14,357,376 (~14M); trains a few
  hundred steps on a 2-core CPU in minutes.
- "2b", "5b", "9b": Gemma-like shapes (wide heads, SwiGLU with a wide hidden layer, RMSNorm, RoPE)
  with a 32k vocabulary; plain multi-head attention (no MQA/GQA), so attention is a little larger
  than in Gemma at the same width. Counts: 2,248,222,720 / 5,033,364,480 / 9,175,344,640.
"""

import dataclasses
import math
from typing import Any

import gin
import jax

from ddiloco.models.transformer import TransformerConfig

# Shapes per size. vocab_size and max_len are the defaults used when the caller passes None.
_SIZES: dict[str, dict[str, int]] = {
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

SIZES = tuple(_SIZES)


def transformer_config(
  size: str, *, vocab_size: int | None = None, max_len: int | None = None, **overrides: Any
) -> TransformerConfig:
  """Returns the `TransformerConfig` of a named size.

  Args:
    size: one of `SIZES`.
    vocab_size: vocabulary size; None picks the size's default (256, the byte vocabulary, for
      "tiny"/"small"; 32768 for "2b"/"5b"/"9b"). It must match the data pipeline's tokenizer.
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


def count_params(params: Any) -> int:
  """Total number of scalars in a pytree of arrays (or `jax.ShapeDtypeStruct`s, or boxed params).

  Args:
    params: any pytree whose leaves have a `.shape`; flax `LogicallyPartitioned` boxes are pytree
      nodes, so boxed and unboxed trees count the same.

  Returns:
    The sum over leaves of the product of their shapes.
  """
  return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


# gin registration (module "ddiloco"): bindings read `transformer_config.size = "tiny"`.
gin.external_configurable(transformer_config, module="ddiloco")
gin.external_configurable(TransformerConfig, module="ddiloco")
