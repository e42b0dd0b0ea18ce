"""ddiloco.models: logical-axis-annotated models (dense and MoE transformer, ViT) and named sizes.

The entry points register `transformer_config`, `TransformerConfig`, `vit_config` and `VitConfig`
with gin (ddiloco/launch/configurables.py).
"""

from ddiloco.models.configs import (
  SIZES,
  VIT_SIZES,
  count_active_params,
  count_params,
  transformer_config,
  vit_config,
)
from ddiloco.models.moe import MoeBlock, Routing, expert_capacity, route
from ddiloco.models.transformer import (
  EMBEDDING_PATH_PREFIXES,
  Transformer,
  TransformerConfig,
  is_embedding_path,
  lm_loss,
)
from ddiloco.models.vit import VisionTransformer, VitConfig, classification_loss

__all__ = [
  "EMBEDDING_PATH_PREFIXES",
  "SIZES",
  "VIT_SIZES",
  "MoeBlock",
  "Routing",
  "Transformer",
  "TransformerConfig",
  "VisionTransformer",
  "VitConfig",
  "classification_loss",
  "count_active_params",
  "count_params",
  "expert_capacity",
  "is_embedding_path",
  "lm_loss",
  "route",
  "transformer_config",
  "vit_config",
]
