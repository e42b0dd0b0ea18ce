"""Tests for the jitted, sharded inner step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ddiloco.learner import train_step
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.tasks import Task


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


def test_text_task_steps_equal_the_bare_model_steps():
  """CompiledSteps(TextTask) is today's step: bit-identical params and metrics."""
  from ddiloco.data import text as text_data
  from ddiloco.tasks import TextTask

  # Vocabulary 256: the text task sets it from the byte tokenizer.
  cfg = configs.transformer_config("tiny", max_len=16)
  model = transformer.Transformer(cfg)
  task = TextTask(model=cfg, data=text_data.TextDataConfig(seq_len=16, batch_size=4))
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=16)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=2, decay_steps=50))
  by_model = train_step.CompiledSteps(model, opt, mesh, abstract, shardings)
  by_task = train_step.CompiledSteps(task, opt, mesh, abstract, shardings)
  host = jax.device_get(params)
  p1, p2 = (jax.device_put(host, shardings) for _ in range(2))
  s1, s2 = by_model.init_opt_state(p1), by_task.init_opt_state(p2)
  rng = np.random.default_rng(3)
  for _ in range(2):
    batch = _batch(rng, vocab=256)
    p1, s1, m1 = by_model.train(p1, s1, by_model.put_batch(batch))
    p2, s2, m2 = by_task.train(p2, s2, by_task.put_batch(batch))
    assert {k: float(v) for k, v in m1.items()} == {k: float(v) for k, v in m2.items()}
  for a, b in zip(jax.tree.leaves(jax.device_get(p1)), jax.tree.leaves(jax.device_get(p2))):
    np.testing.assert_array_equal(a, b)
  evals = [_batch(rng, vocab=256) for _ in range(2)]
  assert (
    train_step.eval_loss(by_model, p1, evals) == train_step.eval_metrics(by_task, p2, evals)["loss"]
  )


class _ToyTask(Task):
  """y = w·x on [B, 1] inputs; aux "mean_input" (or a clashing name) to test the plumbing."""

  unit = "examples"

  def __init__(self, aux_name="mean_input"):
    self.model = nn.Dense(
      1,
      kernel_init=nn.with_logical_partitioning(nn.initializers.ones, (None, None)),
      use_bias=False,
    )
    self.aux_name = aux_name

  batch_size = 2

  def dummy_inputs(self, batch_size=1):
    return jax.ShapeDtypeStruct((batch_size, 1), jnp.float32)

  def loss(self, params, batch, *, train=True):
    pred = self.model.apply({"params": params}, batch["inputs"])[:, 0]
    loss = jnp.mean(jnp.square(pred - batch["targets"]))
    return loss, jnp.float32(batch["targets"].shape[0]), {self.aux_name: jnp.mean(batch["inputs"])}

  def make_train_iterator(self, *, shard_index, num_shards, batch_size=None):
    raise NotImplementedError

  def eval_batches(self, num_batches, *, batch_size=None):
    raise NotImplementedError

  def mean_merged(self, path):
    return False

  def units_per_step(self, batch_size=None):
    return batch_size or self.batch_size


def _toy_steps(task):
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  params, shardings = partitioning.init_params(
    task.model, mesh, jax.random.key(0), inputs=task.dummy_inputs()
  )
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = optax.sgd(0.1)
  return train_step.CompiledSteps(task, opt, mesh, abstract, shardings), params


def test_eval_metrics_are_count_weighted_means():
  steps, params = _toy_steps(_ToyTask())
  # w = 1: batch A (2 examples) has errors 1, 1; batch B (6 examples) errors 0. Inputs' mean:
  # (1 + 3 + 6 x 2) / 8 = 2. Loss: (2 x 1 + 6 x 0) / 8 = 0.25.
  a = {"inputs": np.array([[1.0], [3.0]], np.float32), "targets": np.array([0.0, 4.0], np.float32)}
  b = {"inputs": np.full((6, 1), 2.0, np.float32), "targets": np.full(6, 2.0, np.float32)}
  metrics = train_step.eval_metrics(steps, params, [a, b])
  assert metrics == pytest.approx({"loss": 0.25, "mean_input": 2.0})
  _, _, train_metrics = steps.train(params, steps.init_opt_state(params), steps.put_batch(a))
  assert set(train_metrics) == {"loss", "tokens", "grad_norm", "mean_input"}
  assert float(train_metrics["tokens"]) == 2.0


def test_aux_metrics_may_not_shadow_step_metrics():
  steps, params = _toy_steps(_ToyTask(aux_name="tokens"))
  a = {"inputs": np.ones((2, 1), np.float32), "targets": np.ones(2, np.float32)}
  with pytest.raises(ValueError, match="clash"):
    steps.evaluate_sums(params, steps.put_batch(a))


def test_inner_optimizer_may_be_any_optax_transformation():
  """SGD on the warm-up/cosine schedule: the first update is −lr(0)·g after clipping (lr(0) = 0),
  the second −lr(1)·g, with lr(1) = peak/warmup."""
  cfg = train_step.InnerOptConfig(
    optimizer=optax.sgd, peak_lr=0.5, warmup_steps=2, decay_steps=10, grad_clip_norm=0.0
  )
  opt = train_step.make_inner_optimizer(cfg)
  params = {"w": jnp.ones((2, 2))}
  grads = {"w": jnp.full((2, 2), 2.0)}
  state = opt.init(params)
  updates, state = opt.update(grads, state, params)
  np.testing.assert_allclose(updates["w"], 0.0)
  updates, state = opt.update(grads, state, params)
  np.testing.assert_allclose(updates["w"], -0.25 * 2.0)
  with pytest.raises(TypeError, match="not an optax transformation"):
    train_step.make_inner_optimizer(
      train_step.InnerOptConfig(optimizer=lambda learning_rate: learning_rate)
    )


def test_inner_optimizer_binds_from_gin():
  from ddiloco.launch import configurables

  configurables.parse(
    [],
    [
      "ddiloco.InnerOptConfig.optimizer = @optax.sgd",
      "optax.sgd.momentum = 0.9",
      "ddiloco.InnerOptConfig.warmup_steps = 1",
      "ddiloco.InnerOptConfig.decay_steps = 4",
    ],
  )
  try:
    cfg = configurables.configured(train_step.InnerOptConfig)()
    state = train_step.make_inner_optimizer(cfg).init({"w": jnp.ones(3)})
    # clip → sgd(momentum) = trace → scale_by_learning_rate(schedule).
    assert any(isinstance(s, optax.TraceState) for s in jax.tree.leaves(state, is_leaf=_is_state))
  finally:
    configurables.clear()


def _is_state(x):
  return isinstance(x, optax.TraceState | optax.ScaleByScheduleState)


def test_schedule_at_least_raises_only_the_schedule_count_and_keeps_its_sharding():
  _, steps, params = _setup(devices=2)
  state = steps.init_opt_state(params)
  joined = train_step.schedule_at_least(state, 50)
  leaves = jax.tree.leaves(joined, is_leaf=_is_state)
  (schedule,) = [s for s in leaves if isinstance(s, optax.ScaleByScheduleState)]
  assert int(schedule.count) == 50
  old = [
    s
    for s in jax.tree.leaves(state, is_leaf=_is_state)
    if isinstance(s, optax.ScaleByScheduleState)
  ]
  assert schedule.count.sharding == old[0].count.sharding
  # Adam's own count (bias correction) stays the learner's.
  adam = [
    s
    for s in jax.tree.leaves(joined, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState)
  ]
  assert adam and all(int(a.count) == 0 for a in adam)
  # Never lowered: a learner further along keeps its own schedule.
  again = train_step.schedule_at_least(joined, 10)
  (kept,) = [
    s
    for s in jax.tree.leaves(again, is_leaf=_is_state)
    if isinstance(s, optax.ScaleByScheduleState)
  ]
  assert int(kept.count) == 50
  # The step still compiles once with the raised count.
  rng = np.random.default_rng(0)
  params, joined, _ = steps.train(params, joined, steps.put_batch(_batch(rng)))
  assert steps.train_cache_size() == 1
