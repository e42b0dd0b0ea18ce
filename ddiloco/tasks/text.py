"""`TextTask`: next-token prediction with the decoder-only transformer (dense or MoE) on text.

For a dense model this is exactly what the learners trained before tasks existed: the same model
call, `lm_loss`, data iterators, eval batches and embedding paths, so runs are bit-identical.

MoE models (`TransformerConfig.num_experts > 0`): the forward pass collects the load-balancing and
router z-losses that every MoE layer sows (`ddiloco.models.moe`); the training objective is
  lm_loss + aux_loss_weight · Σ_layers aux + router_z_loss_weight · Σ_layers z
(summed over layers as Switch/GShard do), and the metrics report the per-layer means
"moe_aux_loss" (1.0 = balanced) and "router_z_loss", plus "lm_loss". The eval loss is lm_loss alone,
so dense and MoE eval losses compare directly.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ddiloco.data import text as text_data
from ddiloco.data import token_shards
from ddiloco.models import moe, transformer
from ddiloco.tasks.base import Batch, LossOutput, Task
from ddiloco.types import PyTree

# Model vocabularies are padded to this multiple (up to 128-way model parallelism divides them).
VOCAB_MULTIPLE = 128


def fit_model(
  model: transformer.TransformerConfig,
  *,
  vocab: int,
  source: str,
  seq_len: int,
  keep_vocab: bool,
) -> transformer.TransformerConfig:
  """The model with the data's vocabulary: `vocab` ids rounded up to `VOCAB_MULTIPLE`, or with
  `keep_vocab` its own (which must hold them); `source` names the data in errors."""
  if keep_vocab and vocab > model.vocab_size:
    raise ValueError(
      f"The {source} has {vocab} ids, more than the model's vocabulary of {model.vocab_size}: "
      "train a pretrained model on a token corpus written with its own tokenizer "
      "(TokenShardDataConfig)."
    )
  vocab = model.vocab_size if keep_vocab else -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  if model.vocab_size != vocab:
    model = dataclasses.replace(model, vocab_size=vocab)
  if seq_len > model.max_len:
    raise ValueError(f"seq_len {seq_len} exceeds the model's max_len {model.max_len}.")
  return model


class TextTask(Task):
  """Language modelling on the Shakespeare text pipeline; counts target tokens.

  Args:
    model: the transformer's config; its vocab_size is replaced by the tokenizer's, rounded up to
      a multiple of `VOCAB_MULTIPLE` so that the embedding and the output projection shard evenly
      over a learner's model axis (cl100k's 100,277 ids become 100,352; the extra ids never occur
      in the data, and training drives their logits down).
    data: the text pipeline's config.
    keep_vocab: keep `model.vocab_size` (a pretrained checkpoint's vocabulary, `RunConfig.hf_checkpoint`)
      instead; it must hold every id of the tokenizer.
  """

  unit = "tokens"

  def __init__(
    self,
    *,
    model: transformer.TransformerConfig,
    data: text_data.TextDataConfig,
    keep_vocab: bool = False,
  ) -> None:
    self.model_config = fit_model(
      model,
      vocab=text_data.get_tokenizer(data.tokenizer).vocab_size,
      source=f"tokenizer {data.tokenizer!r}",
      seq_len=data.seq_len,
      keep_vocab=keep_vocab,
    )
    self.data_config = data
    self.seq_len = data.seq_len
    self.model = transformer.Transformer(self.model_config)

  @property
  def batch_size(self) -> int:
    return self.data_config.batch_size

  def dummy_inputs(self, batch_size: int = 1) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.int32)

  def loss(self, params: PyTree, batch: Mapping[str, Any], *, train: bool = True) -> LossOutput:
    cfg = self.model_config
    variables = {"params": params}
    if not cfg.is_moe:
      logits_BxLxV = self.model.apply(variables, batch["inputs"])
      loss, num_tokens = transformer.lm_loss(logits_BxLxV, batch["targets"], batch.get("mask"))
      return loss, num_tokens, {}
    logits_BxLxV, state = self.model.apply(variables, batch["inputs"], mutable=["intermediates"])
    lm_loss, num_tokens = transformer.lm_loss(logits_BxLxV, batch["targets"], batch.get("mask"))
    sums = moe.collect_losses(state["intermediates"])
    layers = sums["moe_layers"]
    aux = {
      "lm_loss": lm_loss,
      moe.AUX_LOSS: sums[moe.AUX_LOSS] / layers,
      moe.Z_LOSS: sums[moe.Z_LOSS] / layers,
    }
    if not train:
      return lm_loss, num_tokens, aux
    objective = (
      lm_loss
      + cfg.aux_loss_weight * sums[moe.AUX_LOSS]
      + cfg.router_z_loss_weight * sums[moe.Z_LOSS]
    )
    return objective, num_tokens, aux

  def make_train_iterator(
    self, *, shard_index: int, num_shards: int, batch_size: int | None = None
  ) -> text_data.TextTrainIterator:
    return text_data.make_train_iterator(
      self.data_config, shard_index=shard_index, num_shards=num_shards, batch_size=batch_size
    )

  def eval_batches(self, num_batches: int, *, batch_size: int | None = None) -> list[Batch]:
    return text_data.eval_batches(self.data_config, num_batches=num_batches, batch_size=batch_size)

  def mean_merged(self, path: str) -> bool:
    """Input embedding and unembedding (docs/algorithm.md §4.5 decision; `transformer.is_embedding_path`)."""
    return transformer.is_embedding_path(path)

  def units_per_step(self, batch_size: int | None = None) -> int:
    return (batch_size or self.data_config.batch_size) * self.seq_len


class TokenShardTask(TextTask):
  """Language modelling on a pre-tokenized corpus (data/token_shards.py); counts target tokens.

  The model, loss and merge rules are `TextTask`'s; the data are the corpus's windows, its
  sequence length theirs, its vocabulary the corpus's (rounded up to `VOCAB_MULTIPLE`), or the
  model's own with `keep_vocab` (`RunConfig.hf_checkpoint`), which must hold the corpus's ids.
  `RunConfig.data = @TokenShardDataConfig()` picks it.

  Args:
    model: the transformer's config.
    data: the corpus and batch size.
    keep_vocab: keep `model.vocab_size`.
  """

  # Not `TextTask.__init__`: it reads a tokenizer, and a corpus brings its own ids.
  def __init__(
    self,
    *,
    model: transformer.TransformerConfig,
    data: token_shards.TokenShardDataConfig,
    keep_vocab: bool = False,
  ) -> None:
    info = data.info()
    self.model_config = fit_model(
      model,
      vocab=info.vocab_size,
      source=f"corpus {data.path}",
      seq_len=info.seq_len,
      keep_vocab=keep_vocab,
    )
    self.data_config = data
    self.seq_len = info.seq_len
    self.model = transformer.Transformer(self.model_config)

  def make_train_iterator(
    self, *, shard_index: int, num_shards: int, batch_size: int | None = None
  ) -> token_shards.TokenShardIterator:
    return token_shards.make_train_iterator(
      self.data_config, shard_index=shard_index, num_shards=num_shards, batch_size=batch_size
    )

  def eval_batches(self, num_batches: int, *, batch_size: int | None = None) -> list[Batch]:
    return token_shards.eval_batches(
      self.data_config, num_batches=num_batches, batch_size=batch_size
    )
