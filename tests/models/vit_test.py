"""Tests for ddiloco.models.vit: shapes, parameters, bidirectional encoder, loss, learning."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.data.vision import VisionDataConfig
from ddiloco.fragments.tree import flatten
from ddiloco.learner import train_step
from ddiloco.models import configs, transformer, vit
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.tasks import VisionTask


def _init(cfg, batch=2):
  model = vit.VisionTransformer(cfg)
  images = jnp.zeros((batch, cfg.image_size, cfg.image_size, cfg.channels))
  return model, nn.unbox(jax.jit(model.init)(jax.random.key(0), images)["params"])


def test_shapes_params_and_determinism():
  cfg = configs.vit_config("tiny")
  model, params = _init(cfg)
  flat = flatten(params)
  # Per block 4 x 64 x 64 (attention) + 3 x 64 x 256 (SwiGLU) + 2 x 64 (norms) = 65,664; x 4 blocks,
  # + patch_embed 4 x 64 + 64, pos_embed 16 x 64, final_norm 64, head 64 x 10 + 10 = 264,714.
  assert configs.count_params(params) == 4 * 65_664 + 320 + 1024 + 64 + 650 == 264_714
  assert flat["patch_embed/kernel"].shape == (4, 64)  # 2 x 2 x 1 pixels per patch.
  assert flat["pos_embed/embedding"].shape == (16, 64)
  assert "cls_token" not in flat and "block_3/attn/query/kernel" in flat
  images = jax.random.uniform(jax.random.key(1), (5, 8, 8, 1))
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
  logits = forward(params, images)
  assert logits.shape == (5, 10) and logits.dtype == jnp.float32
  # The head starts at zero (big_vision): every logit is 0, the loss exactly log 10.
  np.testing.assert_array_equal(np.asarray(logits), 0.0)
  _, again = _init(cfg)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    np.testing.assert_array_equal(a, b)
  params["head"]["kernel"] = jax.random.normal(jax.random.key(2), (64, 10))
  np.testing.assert_array_equal(forward(params, images), forward(params, images))


def test_cls_pool_adds_a_class_token():
  model, params = _init(configs.vit_config("tiny", pool="cls", patch_size=4))
  flat = flatten(params)
  assert flat["cls_token"].shape == (64,)
  assert flat["pos_embed/embedding"].shape == (2 * 2 + 1, 64)  # 4 patches of 4 x 4, + class token.
  assert flat["patch_embed/kernel"].shape == (16, 64)
  assert model.apply({"params": params}, jnp.ones((3, 8, 8, 1))).shape == (3, 10)


def test_config_validation():
  with pytest.raises(ValueError, match="patch_size"):
    configs.vit_config("tiny", patch_size=3)
  with pytest.raises(ValueError, match="pool"):
    configs.vit_config("tiny", pool="max")
  with pytest.raises(ValueError, match="Unknown ViT size"):
    configs.vit_config("huge")


def test_encoder_is_bidirectional():
  """causal=False: the first position's output depends on the last token (it cannot when causal)."""
  for causal in (True, False):
    cfg = configs.transformer_config("tiny", num_layers=1, max_len=8, causal=causal, rope=False)
    model = transformer.Transformer(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    a = model.apply(params, jnp.zeros((1, 8), jnp.int32))
    b = model.apply(params, jnp.zeros((1, 8), jnp.int32).at[0, 7].set(5))
    assert np.array_equal(np.asarray(a[0, 0]), np.asarray(b[0, 0])) == causal


def test_classification_loss_by_hand():
  # Logits (0, ln 3): p(class 1) = 3/4, so the loss is ln(4/3) for label 1 and ln 4 for label 0.
  logits = jnp.array([[0.0, np.log(3.0)], [0.0, np.log(3.0)]])
  loss, count, accuracy = vit.classification_loss(logits, jnp.array([1, 0]))
  assert float(loss) == pytest.approx((np.log(4 / 3) + np.log(4)) / 2, rel=1e-6)
  assert float(count) == 2.0 and float(accuracy) == 0.5
  with pytest.raises(ValueError):
    vit.classification_loss(logits, jnp.array([1, 0, 1]))


def test_loss_falls_on_digits():
  """40 AdamW steps of 32 digits: the cross-entropy starts at exactly ln 10 and clearly drops."""
  task = VisionTask(
    model=configs.vit_config("tiny"), data=VisionDataConfig(batch_size=32, noise_std=0.0)
  )
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  params, shardings = partitioning.init_params(
    task.model, mesh, jax.random.key(0), inputs=task.dummy_inputs()
  )
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=5, decay_steps=40))
  steps = train_step.CompiledSteps(task, opt, mesh, abstract, shardings)
  opt_state = steps.init_opt_state(params)
  data = task.make_train_iterator(shard_index=0, num_shards=1)
  evals = task.eval_batches(4)
  before = train_step.eval_metrics(steps, params, evals)
  assert before["loss"] == pytest.approx(np.log(10.0), rel=1e-6)
  for _ in range(40):
    params, opt_state, metrics = steps.train(params, opt_state, steps.put_batch(next(data)))
  after = train_step.eval_metrics(steps, params, evals)
  assert float(metrics["tokens"]) == 32  # The merge unit of a vision task: examples.
  assert after["loss"] < before["loss"] - 0.5
  assert after["accuracy"] > 0.3  # Chance is 0.1.
