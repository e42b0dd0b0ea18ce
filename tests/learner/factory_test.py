"""`LearnerFactory`'s meshes: tensor parallelism inside a learner (`model_parallelism`)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ddiloco.data import text as text_data
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.factory import LearnerFactory, LearnerSpec
from ddiloco.models import configs

SEQ = 16
DATA = text_data.TextDataConfig(seq_len=SEQ, batch_size=4, tokenizer="byte")
INNER = train_step.InnerOptConfig(warmup_steps=2, decay_steps=100)
SCHEDULE = FragmentSchedule(num_fragments=4, period=4, overlap=0)


def _factory(model_parallelism):
  return LearnerFactory(
    model_config=configs.transformer_config("tiny", max_len=SEQ),
    data_config=DATA,
    inner_opt=INNER,
    num_fragments=4,
    num_shards=1,
    model_parallelism=model_parallelism,
  )


def test_learners_shard_over_the_model_axis_and_train_as_data_parallel_ones():
  tp, dp = _factory(2), _factory(1)
  np.testing.assert_equal(tp.global_init_values(), dp.global_init_values())  # Mesh-independent.
  spec = LearnerSpec(devices=4)
  sharded = tp.make_learner(0, spec=spec, schedule=SCHEDULE, config=LearnerConfig())
  plain = dp.make_learner(0, spec=spec, schedule=SCHEDULE, config=LearnerConfig())
  assert dict(sharded.steps.mesh.shape) == {"data": 2, "model": 2}
  assert dict(plain.steps.mesh.shape) == {"data": 4, "model": 1}
  query = tree.flatten(sharded.params)["block_0/attn/query/kernel"]  # (embed, heads, kv)
  assert query.sharding.spec == P(None, "model", None)
  assert {s.data.shape for s in query.addressable_shards} == {(128, 2, 32)}
  data = tp.make_data(0, spec=spec)
  for _ in range(3):
    batch = next(data)
    a, b = sharded.train_step(batch), plain.train_step(batch)
    np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=2e-5)
  for k, v in tree.flatten(jax.device_get(plain.params)).items():
    got = tree.flatten(jax.device_get(sharded.params))[k]
    np.testing.assert_allclose(got, v, rtol=2e-4, atol=2e-6, err_msg=k)


def test_model_parallelism_must_divide_the_learners_devices():
  with pytest.raises(ValueError, match="does not divide the 3 devices"):
    _factory(2).make_learner(
      0, spec=LearnerSpec(devices=3), schedule=SCHEDULE, config=LearnerConfig()
    )
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="model_parallelism"):
      _factory(bad)


def test_a_syncer_shard_initialises_only_its_fragments_with_the_same_bits():
  # A shard's factory never builds the whole model: its fragments come from a partial init.
  shard, whole = _factory(1), _factory(1)
  mine = shard.global_init_values([1, 3])
  assert shard._host_init is None  # Nothing else was materialised.
  everything = whole.global_init_values()
  keys = [k for p in (1, 3) for k in whole.layout.fragments[p]]
  assert sorted(mine) == sorted(keys)
  for k in keys:
    assert mine[k].dtype == everything[k].dtype
    np.testing.assert_array_equal(mine[k], everything[k])  # Bit for bit, not close.
  assert whole.num_params == shard.num_params == sum(v.size for v in everything.values())
  # Once the whole model is on the host (a learner was made), subsets are cut from it.
  np.testing.assert_equal(whole.global_init_values([1, 3]), mine)
