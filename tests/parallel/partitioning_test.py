"""Tests for ddiloco.parallel.partitioning on a (data=2, model=4) mesh of 8 fake CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddiloco.fragments.tree import flatten
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning

SEQ = 16


@pytest.fixture(scope="module")
def mesh():
  return mesh_lib.make_mesh(model_parallelism=4)


@pytest.fixture(scope="module")
def tiny(mesh):
  model = transformer.Transformer(configs.transformer_config("tiny", num_layers=2, max_len=SEQ))
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=SEQ)
  return model, params, shardings


# The sharding every kind of parameter must get under LOGICAL_AXIS_RULES on ("data", "model").
EXPECTED_SPECS = {
  "token_embed/embedding": P("model", None),  # (vocab, embed)
  "block_0/attn/query/kernel": P(None, "model", None),  # (embed, heads, kv): heads wins over kv
  "block_0/attn/key/kernel": P(None, "model", None),
  "block_0/attn/value/kernel": P(None, "model", None),
  "block_0/attn/out/kernel": P("model", None, None),  # (heads, kv, embed)
  "block_0/mlp/gate/kernel": P(None, "model"),  # (embed, mlp)
  "block_0/mlp/up/kernel": P(None, "model"),
  "block_0/mlp/down/kernel": P("model", None),  # (mlp, embed)
  "block_0/pre_attn_norm/scale": P(None),  # (embed,)
  "final_norm/scale": P(None),
  "unembed/kernel": P(None, "model"),  # (embed, vocab)
}


def test_rules_table():
  rules = partitioning.LOGICAL_AXIS_RULES
  assert nn.logical_to_mesh_axes(("batch", "length", "embed"), rules) == P("data", None, None)
  assert nn.logical_to_mesh_axes(("batch", "length", "heads", "kv"), rules) == P(
    "data", None, "model", None
  )
  assert nn.logical_to_mesh_axes(("batch", "length", "vocab"), rules) == P("data", None, "model")
  # Expert parallelism takes the model axis before the MLP dimension does.
  assert nn.logical_to_mesh_axes(("expert", "embed", "mlp"), rules) == P("model", None, None)
  # Without heads, kv goes on the model axis.
  assert nn.logical_to_mesh_axes(("embed", "kv"), rules) == P(None, "model")


def test_batch_sharding(mesh):
  sharding = partitioning.batch_sharding(mesh)
  assert sharding == NamedSharding(mesh, P("data"))
  batch = jax.device_put(np.zeros((4, SEQ), np.int32), sharding)
  assert batch.addressable_shards[0].data.shape == (2, SEQ)


@pytest.mark.parametrize(
  "size,expected_count",
  # Per block 4 d^2 + 3 d f + 2 d, plus 2 V d + d with V = 32768 (see models/configs.py):
  # 2b: 18 * (4*2048^2 + 3*2048*16384 + 4096) + 2*32768*2048 + 2048 = 2,248,222,720
  # 5b: 32 * (4*3072^2 + 3*3072*12288 + 6144) + 2*32768*3072 + 3072 = 5,033,364,480
  # 9b: 42 * (3*3584*4096 + 4096*3584 + 3*3584*14336 + 7168) + 2*32768*3584 + 3584
  #   = 9,175,344,640 (16 heads x 256 = 4096 != d)
  [("2b", 2_248_222_720), ("5b", 5_033_364_480), ("9b", 9_175_344_640)],
)
def test_abstract_params_of_large_models(mesh, size, expected_count):
  model = transformer.Transformer(configs.transformer_config(size))
  abstract, shardings = partitioning.abstract_params(model, mesh)
  assert configs.count_params(abstract) == expected_count
  lo, hi = {"2b": (2e9, 3e9), "5b": (4.5e9, 5.5e9), "9b": (8.5e9, 10e9)}[size]
  assert lo < expected_count < hi
  flat_abstract, flat_shardings = flatten(abstract), flatten(shardings)
  assert flat_abstract.keys() == flat_shardings.keys()
  for path, leaf in flat_abstract.items():
    assert isinstance(leaf, jax.ShapeDtypeStruct), path  # nothing was allocated
    assert leaf.sharding == flat_shardings[path], path
    assert flat_shardings[path].mesh == mesh
  for path, spec in EXPECTED_SPECS.items():
    assert flat_shardings[path].spec == spec, path
  last = configs.transformer_config(size).num_layers - 1
  assert flat_shardings[f"block_{last}/mlp/down/kernel"].spec == P("model", None)


def test_init_params_are_sharded_plain_arrays(mesh, tiny):
  _, params, shardings = tiny
  flat_params, flat_shardings = flatten(params), flatten(shardings)
  assert len(flat_params) == 2 * 9 + 3
  for path, leaf in flat_params.items():
    assert isinstance(leaf, jax.Array), path  # unboxed: no LogicallyPartitioned wrapper
    assert leaf.sharding == flat_shardings[path], path
  for path, spec in EXPECTED_SPECS.items():
    assert flat_params[path].sharding.spec == spec, path
  # The query kernel (128, 4, 32) split 4 ways over heads: each device holds (128, 1, 32).
  query = flat_params["block_0/attn/query/kernel"]
  assert {s.data.shape for s in query.addressable_shards} == {(128, 1, 32)}
  assert len(query.addressable_shards) == 8


def test_sharded_init_matches_unsharded_init(tiny):
  model, params, _ = tiny
  reference = nn.unbox(
    jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
  )
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_forward_matches_unsharded(mesh, tiny):
  model, params, _ = tiny
  tokens = jax.random.randint(jax.random.key(1), (4, SEQ), 0, 256)
  host_params = jax.device_get(params)
  reference = jax.jit(lambda p, t: model.apply({"params": p}, t))(host_params, tokens)
  with partitioning.partitioning_context(mesh):
    sharded = jax.jit(lambda p, t: model.apply({"params": p}, t))(
      params, jax.device_put(tokens, partitioning.batch_sharding(mesh))
    )
  # The activation constraint ("batch", "length", "vocab") took effect.
  assert sharded.sharding.spec == P("data", None, "model")
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), atol=1e-5, rtol=1e-5)


def test_indivisible_sharding_is_rejected():
  mesh = mesh_lib.make_mesh(model_parallelism=8)
  model = transformer.Transformer(configs.transformer_config("tiny", num_layers=1))
  # tiny has 4 heads; the model axis has 8 devices.
  with pytest.raises(ValueError, match=r"block_0/attn/(key|out|query|value)/kernel.*8"):
    partitioning.abstract_params(model, mesh)


class _Unannotated(nn.Module):
  @nn.compact
  def __call__(self, tokens_BxL):
    w = self.param("w", nn.initializers.zeros_init(), (4,))
    return tokens_BxL[..., None] * w


def test_unannotated_params_are_rejected(mesh):
  with pytest.raises(ValueError, match=r"without logical axis names.*'w'"):
    partitioning.abstract_params(_Unannotated(), mesh)


def test_init_leaves_matches_init_params_and_refuses_unknown_paths():
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:2])
  model = transformer.Transformer(configs.transformer_config("tiny", max_len=16))
  full, _ = partitioning.init_params(model, mesh, jax.random.key(3))
  flat = flatten(full)
  some = sorted(flat)[::3]
  part = partitioning.init_leaves(model, mesh, jax.random.key(3), some)
  assert sorted(part) == some
  for path in some:
    assert part[path].sharding == flat[path].sharding
    np.testing.assert_array_equal(np.asarray(part[path]), np.asarray(flat[path]))
  with pytest.raises(KeyError, match="Not a parameter"):
    partitioning.init_leaves(model, mesh, jax.random.key(3), ["no/such/leaf"])
