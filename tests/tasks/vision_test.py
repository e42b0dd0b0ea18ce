"""Tests for ddiloco.tasks.vision: the digits classification task's contract."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.data import vision as vision_data
from ddiloco.fragments.tree import flatten
from ddiloco.models import configs
from ddiloco.tasks import VisionTask

DATA = vision_data.VisionDataConfig(batch_size=8)


def _task(**kwargs):
  return VisionTask(model=configs.vit_config("tiny", num_layers=1), data=DATA, **kwargs)


def test_units_inputs_and_zero_head_loss():
  task = _task()
  assert task.unit == "examples"
  assert task.dummy_inputs(3) == jax.ShapeDtypeStruct((3, 8, 8, 1), jnp.float32)
  assert (task.batch_size, task.units_per_step(), task.units_per_step(5)) == (8, 8, 5)
  batch = next(task.make_train_iterator(shard_index=0, num_shards=2))
  assert task.units_in_batch(batch) == 8
  params = nn.unbox(jax.jit(task.model.init)(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))["params"]
  loss, count, aux = jax.jit(task.loss)(params, batch)
  # Zero head: uniform softmax (loss ln 10), and argmax picks class 0 for every image.
  assert float(loss) == pytest.approx(np.log(10.0), rel=1e-6) and float(count) == 8
  assert float(aux["accuracy"]) == pytest.approx(np.mean(batch["targets"] == 0))
  assert len(task.eval_batches(3)) == 3


def test_mean_merged_tensors():
  task = _task()
  shapes = jax.eval_shape(task.model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
  paths = flatten(nn.unbox(shapes))
  mean = sorted(p for p in paths if task.mean_merged(p))
  assert mean == [
    "head/bias",
    "head/kernel",
    "patch_embed/bias",
    "patch_embed/kernel",
    "pos_embed/embedding",
  ]
  assert not any(_task(mean_merged_prefixes=()).mean_merged(p) for p in paths)


def test_mismatched_model_is_rejected():
  with pytest.raises(ValueError, match="digits"):
    VisionTask(model=configs.vit_config("tiny", image_size=16), data=DATA)
  with pytest.raises(ValueError, match="digits"):
    VisionTask(model=configs.vit_config("tiny", num_classes=100), data=DATA)


def test_run_config_takes_a_task_or_a_text_pair():
  from ddiloco.data import text as text_data
  from ddiloco.launch.job import JobConfig
  from ddiloco.run_config import RunConfig

  run = RunConfig(task=_task(), num_learners=2, steps_per_learner=5, batch_size=4)
  assert run.the_task() is run.task
  assert (run.tokens_per_step(), run.token_budget(), run.learner_batch_size()) == (4, 40, 4)
  assert RunConfig(task=_task()).learner_batch_size() == 8
  text = RunConfig(
    model=configs.transformer_config("tiny", max_len=64), data=text_data.TextDataConfig(seq_len=64)
  )
  assert text.tokens_per_step() == 8 * 64 and text.the_task().unit == "tokens"
  with pytest.raises(ValueError, match="either a task"):
    RunConfig(
      task=_task(), model=configs.transformer_config("tiny"), data=text_data.TextDataConfig()
    )
  with pytest.raises(ValueError, match="Needs a task"):
    RunConfig()
  with pytest.raises(ValueError, match="Needs a task"):
    JobConfig()  # Its default run has nothing to train either.
