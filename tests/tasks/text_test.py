"""Tests for ddiloco.tasks.text: the text task is today's LM training, plus MoE objectives."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.data import text as text_data
from ddiloco.learner import train_step
from ddiloco.models import configs, moe
from ddiloco.tasks import Task, TextTask

L = 16
DATA = text_data.TextDataConfig(seq_len=L, batch_size=2)


def _batch():
  tokens = jax.random.randint(jax.random.key(1), (2, L + 1), 0, 256)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _params(task):
  return nn.unbox(jax.jit(task.model.init)(jax.random.key(0), jnp.zeros((1, L), jnp.int32)))[
    "params"
  ]


def test_dense_loss_is_the_lm_loss():
  task = TextTask(model=configs.transformer_config("tiny", num_layers=1, max_len=L), data=DATA)
  assert isinstance(task, Task) and task.unit == "tokens"
  params, batch = _params(task), _batch()
  loss, count, aux = jax.jit(task.loss)(params, batch)
  ref_loss, ref_count = jax.jit(lambda p, b: train_step.loss_fn(task.model, p, b))(params, batch)
  assert float(loss) == float(ref_loss) and float(count) == float(ref_count) == 2 * L
  assert aux == {}


def test_vocab_units_iterators_and_embeddings():
  task = TextTask(model=configs.transformer_config("tiny", vocab_size=99, max_len=L), data=DATA)
  assert task.model_config.vocab_size == 256  # Set from the byte tokenizer.
  assert task.dummy_inputs() == jax.ShapeDtypeStruct((1, L), jnp.int32)
  assert (task.batch_size, task.units_per_step(), task.units_per_step(3)) == (2, 2 * L, 3 * L)
  batch = next(task.make_train_iterator(shard_index=1, num_shards=3))
  ref = next(text_data.make_train_iterator(DATA, shard_index=1, num_shards=3))
  np.testing.assert_array_equal(batch["inputs"], ref["inputs"])
  assert task.units_in_batch(batch) == 2 * L
  np.testing.assert_array_equal(
    task.eval_batches(2)[1]["targets"], text_data.eval_batches(DATA, num_batches=2)[1]["targets"]
  )
  assert task.mean_merged("token_embed/embedding") and task.mean_merged("unembed/kernel")
  assert not task.mean_merged("block_0/attn/query/kernel")
  with pytest.raises(ValueError, match="max_len"):
    TextTask(model=configs.transformer_config("tiny", max_len=8), data=DATA)


def test_moe_objective_adds_weighted_aux_losses_summed_over_layers():
  """2 blocks, both MoE (moe_every=1): objective = lm + 0.01 x 2 x mean aux + 0.1 x 2 x mean z."""
  cfg = configs.transformer_config(
    "tiny_moe", num_layers=2, max_len=L, moe_every=1, router_z_loss_weight=0.1
  )
  task = TextTask(model=cfg, data=DATA)
  params, batch = _params(task), _batch()
  loss, count, aux = jax.jit(task.loss)(params, batch)
  assert set(aux) == {"lm_loss", moe.AUX_LOSS, moe.Z_LOSS} and float(count) == 2 * L
  expected = aux["lm_loss"] + 0.01 * 2 * aux[moe.AUX_LOSS] + 0.1 * 2 * aux[moe.Z_LOSS]
  assert float(loss) == pytest.approx(float(expected), rel=1e-6)
  assert float(loss) > float(aux["lm_loss"])
  eval_loss, _, eval_aux = jax.jit(lambda p, b: task.loss(p, b, train=False))(params, batch)
  assert float(eval_loss) == float(aux["lm_loss"]) == float(eval_aux["lm_loss"])
