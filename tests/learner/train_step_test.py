"""Tests for the jitted, sharded inner step."""

import jax
import numpy as np
import optax
import pytest

from ddiloco.learner import train_step
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning


def _setup(devices=2, model_parallelism=1):
  cfg = configs.transformer_config("tiny", vocab_size=64, max_len=16)
  model = transformer.Transformer(cfg)
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:devices], model_parallelism=model_parallelism)
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=16)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=2, decay_steps=50))
  steps = train_step.CompiledSteps(model, opt, mesh, abstract, shardings)
  return model, steps, params


def _batch(rng, b=4, length=16, vocab=64):
  x = rng.integers(0, vocab, size=(b, length + 1), dtype=np.int32)
  return {"inputs": x[:, :-1], "targets": x[:, 1:]}


@pytest.mark.parametrize("model_parallelism", [1, 2])
def test_no_recompile_after_first_step(model_parallelism):
  _, steps, params = _setup(devices=4, model_parallelism=model_parallelism)
  opt_state = steps.init_opt_state(params)
  rng = np.random.default_rng(0)
  for _ in range(4):
    params, opt_state, _ = steps.train(params, opt_state, steps.put_batch(_batch(rng)))
  assert steps.train_cache_size() == 1
  leaf = jax.tree.leaves(params)[0]
  assert leaf.sharding.mesh.shape == steps.mesh.shape


def test_loss_falls_on_a_repeated_batch():
  _, steps, params = _setup()
  opt_state = steps.init_opt_state(params)
  batch = steps.put_batch(_batch(np.random.default_rng(1)))
  losses = []
  for _ in range(15):
    params, opt_state, metrics = steps.train(params, opt_state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.5


def test_matches_a_bare_optax_loop():
  """The compiled step is AdamW on the model's loss (same numbers as a bare jit loop).

  One device, so both programs reduce in the same order: across data shards, Adam's m/√v turns
  reduction-order differences of near-zero gradients into visible (~1e-5) parameter differences.
  """
  model, steps, params = _setup(devices=1)
  cfg = train_step.InnerOptConfig(warmup_steps=2, decay_steps=50)
  opt = train_step.make_inner_optimizer(cfg)
  host_params = jax.device_get(params)
  ref_params, ref_state = host_params, opt.init(host_params)

  @jax.jit
  def ref_step(p, s, batch):
    grads = jax.grad(lambda q: train_step.loss_fn(model, q, batch)[0])(p)
    updates, s = opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  opt_state = steps.init_opt_state(params)
  rng = np.random.default_rng(2)
  for _ in range(3):
    batch = _batch(rng)
    params, opt_state, _ = steps.train(params, opt_state, steps.put_batch(batch))
    ref_params, ref_state = ref_step(ref_params, ref_state, batch)
  for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_bad_inner_config():
  with pytest.raises(ValueError):
    train_step.InnerOptConfig(warmup_steps=10, decay_steps=10)
  with pytest.raises(ValueError):
    train_step.InnerOptConfig(peak_lr=0)
