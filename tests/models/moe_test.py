"""Tests for ddiloco.models.moe: routing, capacity, auxiliary losses, sharding, MoE transformers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ddiloco.data import text as text_data
from ddiloco.fragments.tree import flatten
from ddiloco.learner import train_step
from ddiloco.models import configs, moe, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.tasks import TextTask

L = 16


def _tiny_moe(**overrides):
  return configs.transformer_config("tiny_moe", num_layers=2, max_len=L, **overrides)


def test_expert_capacity():
  # ceil(k * S * cf / E): 2 * 8 * 1.0 / 4 = 4; 2 * 8 * 1.25 / 4 = 5; capped at S = 8.
  assert moe.expert_capacity(8, num_experts=4, top_k=2, capacity_factor=1.0) == 4
  assert moe.expert_capacity(8, num_experts=4, top_k=2, capacity_factor=1.25) == 5
  assert moe.expert_capacity(8, num_experts=4, top_k=2, capacity_factor=100.0) == 8
  with pytest.raises(ValueError):
    moe.expert_capacity(8, num_experts=4, top_k=2, capacity_factor=0.0)


def test_route_hand_built_priority_and_capacity():
  """4 tokens, 3 experts, top-2, capacity 2. Router probabilities (softmax of log p = p):

    token 0: [0.5, 0.3, 0.2]   -> e0, e1; gates 0.5/0.8 = 0.625, 0.375
    token 1: [0.6, 0.1, 0.3]   -> e0, e2; gates 2/3, 1/3
    token 2: [0.4, 0.35, 0.25] -> e0, e1
    token 3: [0.3, 0.6, 0.1]   -> e1, e0; gates 2/3, 1/3

  First choices in token order take slots first: e0 <- t0 (slot 0), t1 (slot 1), t2 (full: dropped);
  e1 <- t3 (slot 0). Then second choices: e1 <- t0 (slot 1); e2 <- t1 (slot 0); e1 <- t2 (full);
  e0 <- t3 (full). So token 2 is dropped by both choices and 3 of 8 assignments are dropped.
  """
  probs = np.array([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.4, 0.35, 0.25], [0.3, 0.6, 0.1]])
  r = moe.route(jnp.log(jnp.asarray(probs, jnp.float32))[None], top_k=2, capacity=2)
  dispatch, combine = np.asarray(r.dispatch_GxSxExC[0]), np.asarray(r.combine_GxSxExC[0])
  expected = {
    (0, 0, 0): 0.625,
    (1, 0, 1): 2 / 3,
    (3, 1, 0): 2 / 3,
    (0, 1, 1): 0.375,
    (1, 2, 0): 1 / 3,
  }
  want_dispatch = np.zeros((4, 3, 2))
  want_combine = np.zeros((4, 3, 2))
  for (s, e, c), gate in expected.items():
    want_dispatch[s, e, c] = 1.0
    want_combine[s, e, c] = gate
  np.testing.assert_array_equal(dispatch, want_dispatch)
  np.testing.assert_allclose(combine, want_combine, rtol=1e-6, atol=1e-7)
  assert float(r.dropped_fraction) == pytest.approx(3 / 8)
  # f = assignments per expert / 8 = (4, 3, 1) / 8 (before capacity); P = mean probs
  # = (1.8, 1.35, 0.85) / 4. Loss = 3 * (0.5 * 0.45 + 0.375 * 0.3375 + 0.125 * 0.2125) = 1.134375.
  assert float(r.aux_loss) == pytest.approx(1.134375, rel=1e-6)


def test_uniform_router_aux_loss_is_one():
  """P_e = 1/E for all e, so E * Σ f_e P_e = Σ f_e = 1 whatever the tie-broken assignment."""
  r = moe.route(jnp.zeros((2, 16, 8)), top_k=2, capacity=4)
  assert float(r.aux_loss) == pytest.approx(1.0, abs=1e-6)
  # Uniform logits 0: logsumexp = log 8 for every token.
  assert float(r.z_loss) == pytest.approx(np.log(8.0) ** 2, rel=1e-6)


def test_top1_gate_is_the_raw_probability():
  probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
  r = moe.route(jnp.log(jnp.asarray(probs, jnp.float32))[None], top_k=1, capacity=2)
  combine = np.asarray(r.combine_GxSxExC[0])
  assert combine[0, 0, 0] == pytest.approx(0.7) and combine[1, 2, 0] == pytest.approx(0.8)
  assert combine.sum() == pytest.approx(1.5)


def _moe_block_params(cfg, x):
  return nn.unbox(moe.MoeBlock(cfg).init(jax.random.key(1), x)["params"])


def test_single_expert_equals_dense_mlp():
  """E = 1, k = 1: gate = softmax of one logit = 1 and capacity = S, so the block is the MLP."""
  cfg = _tiny_moe(num_experts=1, top_k=1, capacity_factor=1.0)
  x = jax.random.normal(jax.random.key(0), (2, L, cfg.d_model))
  dense = nn.unbox(transformer.MlpBlock(cfg).init(jax.random.key(2), x)["params"])
  params = _moe_block_params(cfg, x)
  for name in ("gate", "up", "down"):
    params[name]["kernel"] = dense[name]["kernel"][None]
  y_moe = moe.MoeBlock(cfg).apply({"params": params}, x, mutable=["intermediates"])[0]
  y_dense = transformer.MlpBlock(cfg).apply({"params": dense}, x)
  np.testing.assert_allclose(y_moe, y_dense, rtol=1e-5, atol=1e-5)


def test_dropped_tokens_get_a_zero_output():
  """E = 2, k = 1, capacity ceil(1 * 16 * 0.05 / 2) = 1: each expert takes only the first token of
  the sequence that picks it, so exactly (number of distinct experts picked) tokens get an output
  and every other token's block output is exactly 0 (it passes through on the residual).
  """
  cfg = _tiny_moe(num_experts=2, top_k=1, capacity_factor=0.05)
  x = jax.random.normal(jax.random.key(0), (3, L, cfg.d_model))
  params = _moe_block_params(cfg, x)
  y = moe.MoeBlock(cfg).apply({"params": params}, x, mutable=["intermediates"])[0]
  picked = np.argmax(np.asarray(x) @ np.asarray(params["router"]["kernel"]), axis=-1)
  nonzero = np.any(np.asarray(y) != 0, axis=-1)
  for b in range(3):
    first = sorted(int(np.flatnonzero(picked[b] == e)[0]) for e in set(picked[b].tolist()))
    assert np.flatnonzero(nonzero[b]).tolist() == first


def test_moe_layer_placement_and_param_shapes():
  cfg = configs.transformer_config("tiny_moe", max_len=L)
  assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
  boxed = jax.eval_shape(
    lambda: transformer.Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))
  )["params"]
  flat = flatten(nn.unbox(boxed))
  assert "block_0/mlp/gate/kernel" in flat and "block_1/mlp/gate/kernel" not in flat
  assert flat["block_1/moe/gate/kernel"].shape == (4, 128, 512)
  assert flat["block_1/moe/down/kernel"].shape == (4, 512, 128)
  assert flat["block_3/moe/router/kernel"].shape == (128, 4)
  # 1,115,264 dense + 2 MoE layers x (3 extra experts x 3 x 128 x 512 + router 128 x 4).
  assert configs.count_params(boxed) == 1_115_264 + 2 * (3 * 196_608 + 512) == 2_295_936
  # Active per token: total - 2 layers x (4 - 2) unused experts x 196,608.
  assert configs.count_active_params(cfg) == 2_295_936 - 2 * 2 * 196_608


def test_config_validation():
  with pytest.raises(ValueError, match="top_k"):
    _tiny_moe(num_experts=2, top_k=3)
  with pytest.raises(ValueError, match="moe_every"):
    _tiny_moe(moe_every=0)
  with pytest.raises(ValueError, match="capacity_factor"):
    _tiny_moe(capacity_factor=0.0)


def test_gradients_reach_the_router_through_the_task_loss():
  cfg = _tiny_moe(aux_loss_weight=0.0)  # Only the LM loss: the router learns through the gates.
  task = TextTask(model=cfg, data=text_data.TextDataConfig(seq_len=L, batch_size=2))
  params = nn.unbox(task.model.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"])
  tokens = jax.random.randint(jax.random.key(1), (2, L + 1), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  grads = jax.jit(jax.grad(lambda p: task.loss(p, batch)[0]))(params)
  router = np.asarray(grads["block_1"]["moe"]["router"]["kernel"])
  assert np.abs(router).sum() > 0
  assert np.isfinite(router).all()


@pytest.mark.parametrize(
  ("expert_axis", "model_parallelism", "gate_spec"),
  [("model", 4, P("model", None, None)), ("data", 2, P("data", None, "model"))],
)
def test_sharded_experts_match_unsharded(expert_axis, model_parallelism, gate_spec):
  """Experts over 4 devices (model axis) or over the data axis (GShard): same logits as one device."""
  cfg = _tiny_moe()
  model = transformer.Transformer(cfg)
  rules = partitioning.logical_axis_rules(expert_axis=expert_axis)
  mesh = mesh_lib.make_mesh(model_parallelism=model_parallelism)
  params, _ = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=L, rules=rules)
  flat = flatten(params)
  assert flat["block_1/moe/gate/kernel"].sharding.spec == gate_spec
  assert flat["block_1/moe/router/kernel"].sharding.spec == P(None, None)
  tokens = jax.random.randint(jax.random.key(1), (4, L), 0, 256)
  forward = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["intermediates"]))
  reference, ref_state = forward(jax.device_get(params), tokens)
  with partitioning.partitioning_context(mesh, rules):
    sharded, state = forward(params, jax.device_put(tokens, partitioning.batch_sharding(mesh)))
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), atol=2e-5, rtol=2e-5)
  aux = moe.collect_losses(state["intermediates"])[moe.AUX_LOSS]
  ref_aux = moe.collect_losses(ref_state["intermediates"])[moe.AUX_LOSS]
  assert float(aux) == pytest.approx(float(ref_aux), rel=1e-5)


def test_train_step_compiles_once_and_reports_moe_metrics():
  task = TextTask(model=_tiny_moe(), data=text_data.TextDataConfig(seq_len=L, batch_size=4))
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:4], model_parallelism=2)
  params, shardings = partitioning.init_params(
    task.model, mesh, jax.random.key(0), inputs=task.dummy_inputs()
  )
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=1, decay_steps=10))
  steps = train_step.CompiledSteps(task, opt, mesh, abstract, shardings)
  opt_state = steps.init_opt_state(params)
  data = task.make_train_iterator(shard_index=0, num_shards=1)
  for _ in range(3):
    params, opt_state, metrics = steps.train(params, opt_state, steps.put_batch(next(data)))
  assert steps.train_cache_size() == 1
  assert set(metrics) == {"loss", "tokens", "grad_norm", "lm_loss", moe.AUX_LOSS, moe.Z_LOSS}
  assert float(metrics["tokens"]) == 4 * L
  # objective = lm_loss + 0.01 x (sum over the 1 MoE layer of aux) + 0 x z.
  expected = float(metrics["lm_loss"]) + 0.01 * float(metrics[moe.AUX_LOSS])
  assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)


def test_paper_scale_moe_builds_abstractly():
  """5b_moe: 5b (5,033,364,480) + 16 MoE layers x (7 extra experts x 3 x 3072 x 12288 + router)."""
  mesh = mesh_lib.make_mesh(model_parallelism=4)
  cfg = configs.transformer_config("5b_moe")
  abstract, shardings = partitioning.abstract_params(transformer.Transformer(cfg), mesh)
  per_expert = 3 * 3072 * 12288  # 113,246,208
  assert configs.count_params(abstract) == 5_033_364_480 + 16 * (7 * per_expert + 3072 * 8)
  assert configs.count_params(abstract) == 17_717_332_992
  assert configs.count_active_params(cfg) == 17_717_332_992 - 16 * 6 * per_expert
  assert flatten(shardings)["block_31/moe/up/kernel"].spec == P("model", None, None)


def test_expert_axis_rules():
  logical = ("expert", "batch", None, "embed")  # An expert buffer [E, G, C, D].
  for axis, want in (
    ("model", P("model", "data", None, None)),
    ("data", P("data", None, None, None)),  # "batch" loses "data" to "expert", listed first.
    (None, P(None, "data", None, None)),
  ):
    rules = partitioning.logical_axis_rules(expert_axis=axis)
    assert nn.logical_to_mesh_axes(logical, rules) == want
  assert partitioning.logical_axis_rules(expert_axis="model") == partitioning.LOGICAL_AXIS_RULES
  with pytest.raises(ValueError, match="expert_axis"):
    partitioning.logical_axis_rules(expert_axis="tensor")
