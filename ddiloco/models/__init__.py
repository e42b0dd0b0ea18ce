"""ddiloco.models: logical-axis-annotated models and named sizes.

Importing this package registers `transformer_config` and `TransformerConfig` with gin.
"""

from ddiloco.models.configs import SIZES, count_params, transformer_config
from ddiloco.models.transformer import (
  EMBEDDING_PATH_PREFIXES,
  Transformer,
  TransformerConfig,
  is_embedding_path,
  lm_loss,
)

__all__ = [
  "EMBEDDING_PATH_PREFIXES",
  "SIZES",
  "Transformer",
  "TransformerConfig",
  "count_params",
  "is_embedding_path",
  "lm_loss",
  "transformer_config",
]
