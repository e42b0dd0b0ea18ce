"""`VisionTask`: image classification with the small ViT on scikit-learn's digits.

Loss: softmax cross-entropy; count: examples (the merge weight unit, docs/algorithm.md §4.4); aux: top-1
accuracy.

Mean-merged tensors (docs/algorithm.md §4.5 decision, carried over by role): text merges its *input embedding*
and its *output projection* with the weighted mean and everything else with RDA. The ViT's
counterparts are the input side — `patch_embed` (the linear map from pixels into the residual
stream), `pos_embed` and the `cls_token` — and the output side, the class `head` (the unembedding
over the label vocabulary). So those are mean-merged and every encoder block uses RDA, as the
transformer's blocks do. The set is a constructor argument: `mean_merged_prefixes=()` merges every
tensor with RDA (an ablation).
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ddiloco.data import vision as vision_data
from ddiloco.models import vit
from ddiloco.tasks.base import Batch, LossOutput, Task
from ddiloco.types import PyTree

DEFAULT_MEAN_MERGED = ("patch_embed", "pos_embed", "cls_token", "head")


class VisionTask(Task):
  """Digits classification with a `VisionTransformer`; counts examples.

  Args:
    model: the ViT's config; must match the data (8 x 8 x 1 images, 10 classes).
    data: the digits pipeline's config.
    mean_merged_prefixes: first path components merged with the weighted mean (module docstring).

  Raises:
    ValueError: if the model's input or output shape does not match the data.
  """

  unit = "examples"

  def __init__(
    self,
    *,
    model: vit.VitConfig,
    data: vision_data.VisionDataConfig,
    mean_merged_prefixes: tuple[str, ...] = DEFAULT_MEAN_MERGED,
  ) -> None:
    expected = (vision_data.IMAGE_SIZE, vision_data.CHANNELS, vision_data.NUM_CLASSES)
    got = (model.image_size, model.channels, model.num_classes)
    if got != expected:
      raise ValueError(
        f"VitConfig (image_size, channels, num_classes) = {got} does not match the digits data "
        f"{expected}."
      )
    self.model_config = model
    self.data_config = data
    self.model = vit.VisionTransformer(model)
    self.mean_merged_prefixes = tuple(mean_merged_prefixes)

  @property
  def batch_size(self) -> int:
    return self.data_config.batch_size

  def dummy_inputs(self, batch_size: int = 1) -> jax.ShapeDtypeStruct:
    cfg = self.model_config
    return jax.ShapeDtypeStruct(
      (batch_size, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32
    )

  def loss(self, params: PyTree, batch: Mapping[str, Any], *, train: bool = True) -> LossOutput:
    del train  # No auxiliary objective: train and eval losses are the same cross-entropy.
    logits_BxN = self.model.apply({"params": params}, batch["inputs"])
    loss, num_examples, accuracy = vit.classification_loss(logits_BxN, batch["targets"])
    return loss, num_examples, {"accuracy": accuracy}

  def make_train_iterator(
    self, *, shard_index: int, num_shards: int, batch_size: int | None = None
  ) -> vision_data.VisionTrainIterator:
    return vision_data.make_train_iterator(
      self.data_config, shard_index=shard_index, num_shards=num_shards, batch_size=batch_size
    )

  def eval_batches(self, num_batches: int, *, batch_size: int | None = None) -> list[Batch]:
    return vision_data.eval_batches(
      self.data_config, num_batches=num_batches, batch_size=batch_size
    )

  def mean_merged(self, path: str) -> bool:
    return path.split("/", 1)[0] in self.mean_merged_prefixes

  def units_per_step(self, batch_size: int | None = None) -> int:
    return batch_size or self.data_config.batch_size
