"""Bring your own model and data: a user's Flax model and a grain pipeline over ArrayRecord files.

The whole of what ddiloco needs from a user is a `ddiloco.tasks.Task` (docs/custom_tasks.md): a
flax module, its loss, a per-learner training iterator that can be checkpointed, and fixed
held-out batches. Learners, fragments, codecs, the syncer and every launcher work on it unchanged.

This example:
- writes a synthetic 10-class dataset (64 features, a mixture of Gaussians) as ArrayRecord files,
  one record per example: the float32 features then the int32 label, as raw bytes. Files are
  written atomically and only once, so every process of a distributed run may call it;
- defines `MlpClassifier`, a plain flax model whose hidden layer carries logical axis names, so a
  learner with a `model` mesh axis shards it and one without replicates it;
- defines `RecordsTask`, which reads its learner's shard of the records with grain
  (`ArrayRecordDataSource` → shard → per-epoch shuffle → parse → batch), and is gin-configurable;
- trains it on the simulated cluster (4 learners) and prints the held-out loss and accuracy.

  python experiments/custom_task.py --workdir=workdirs/custom_task

The same task as a distributed job (the gin file imports this module, so run from the repository
root):

  PYTHONPATH=. ddiloco-local --gin_file=gin_configs/examples/custom_task.gin \
    --workdir=workdirs/custom_task_local
"""

import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import gin
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from array_record.python import array_record_module

from ddiloco.tasks.base import Batch, LossOutput, Task

NUM_FEATURES = 64
NUM_CLASSES = 10
_RECORD = np.dtype([("features", np.float32, (NUM_FEATURES,)), ("label", np.int32)])


# -- the data: ArrayRecord files ----------------------------------------------------------------


def write_records(folder: str, *, num_train: int = 8192, num_eval: int = 1024, seed: int = 0):
  """Writes train-*.array_record and eval.array_record into `folder` unless they exist; returns
  (train files, eval file).

  Class c's examples are drawn around a fixed random centre with unit noise, so a linear model
  gets most of them and an MLP more.
  """
  os.makedirs(folder, exist_ok=True)
  train = [os.path.join(folder, f"train-{i:05d}-of-00002.array_record") for i in range(2)]
  evaluation = os.path.join(folder, "eval.array_record")
  if all(os.path.exists(p) for p in [*train, evaluation]):
    return train, evaluation
  rng = np.random.default_rng(seed)
  centres = rng.normal(scale=0.3, size=(NUM_CLASSES, NUM_FEATURES)).astype(np.float32)

  def examples(n: int) -> np.ndarray:
    out = np.empty(n, _RECORD)
    out["label"] = rng.integers(0, NUM_CLASSES, size=n)
    out["features"] = centres[out["label"]] + rng.normal(size=(n, NUM_FEATURES))
    return out

  parts = np.array_split(examples(num_train), len(train))
  for path, part in [*zip(train, parts, strict=True), (evaluation, examples(num_eval))]:
    tmp = f"{path}.tmp{os.getpid()}"
    writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
    for record in part:
      writer.write(record.tobytes())
    writer.close()
    os.replace(tmp, path)  # Atomic: a reader never sees half a file.
  return train, evaluation


def parse(record: bytes) -> dict[str, np.ndarray]:
  """One example from its bytes."""
  example = np.frombuffer(record, _RECORD)[0]
  return {"inputs": example["features"], "targets": example["label"]}


# -- the model ----------------------------------------------------------------------------------


class MlpClassifier(nn.Module):
  """Features → hidden (GELU) → class logits.

  ddiloco places every parameter by its logical axis names (docs/custom_tasks.md), so every
  initializer is wrapped in `nn.with_logical_partitioning`: the hidden layer's width is "mlp"
  (sharded over a learner's `model` mesh axis), the features "embed", and None replicates an axis.
  """

  hidden: int = 256

  @nn.compact
  def __call__(self, x_BxF: jax.Array) -> jax.Array:
    def named(init, *axes):
      return nn.with_logical_partitioning(init, axes)

    h_BxH = nn.Dense(
      self.hidden,
      kernel_init=named(nn.initializers.lecun_normal(), "embed", "mlp"),
      bias_init=named(nn.initializers.zeros_init(), "mlp"),
      name="hidden",
    )(x_BxF)
    return nn.Dense(
      NUM_CLASSES,
      kernel_init=named(nn.initializers.lecun_normal(), "mlp", None),
      bias_init=named(nn.initializers.zeros_init(), None),
      name="head",
    )(nn.gelu(h_BxH))


# -- the task -----------------------------------------------------------------------------------


@gin.configurable
class RecordsTask(Task):
  """`MlpClassifier` on the ArrayRecord files of `data_dir` (written there if missing).

  Args:
    data_dir: where the records are (and are written on first use).
    batch_size: default examples per learner step.
    hidden: the MLP's width.
    seed: shuffle seed.
  """

  unit = "examples"

  def __init__(
    self,
    *,
    data_dir: str = "workdirs/custom_task_data",
    batch_size: int = 32,
    hidden: int = 256,
    seed: int = 0,
  ):
    self.data_dir = data_dir
    self._batch_size = batch_size
    self.seed = seed
    self.model = MlpClassifier(hidden=hidden)

  @functools.cached_property
  def _files(self) -> tuple[list[str], str]:
    return write_records(self.data_dir)

  @property
  def batch_size(self) -> int:
    return self._batch_size

  def dummy_inputs(self, batch_size: int = 1) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch_size, NUM_FEATURES), jnp.float32)

  def loss(self, params: Any, batch: Mapping[str, Any], *, train: bool = True) -> LossOutput:
    del train
    logits_BxC = self.model.apply({"params": params}, batch["inputs"])
    labels_B = batch["targets"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B).mean()
    accuracy = (jnp.argmax(logits_BxC, -1) == labels_B).mean(dtype=jnp.float32)
    return loss, jnp.asarray(labels_B.size, jnp.float32), {"accuracy": accuracy}

  def make_train_iterator(
    self, *, shard_index: int, num_shards: int, batch_size: int | None = None
  ) -> Iterator[Batch]:
    # Grain's own iterator: `get_state`/`set_state` make the learner's data position part of
    # its checkpoint, so a restarted learner continues where it stopped.
    train, _ = self._files
    dataset = (
      grain.MapDataset.source(grain.sources.ArrayRecordDataSource(train))[
        shard_index::num_shards
      ]  # This learner's shard: examples shard_index, +num_shards, ...
      .repeat()  # Endless; with the shuffle below, a new order every epoch.
      .shuffle(seed=self.seed + shard_index)
      .map(parse)
      .batch(batch_size or self._batch_size, drop_remainder=True)
    )
    return iter(dataset)

  def eval_batches(self, num_batches: int, *, batch_size: int | None = None) -> list[Batch]:
    _, evaluation = self._files
    source = grain.sources.ArrayRecordDataSource([evaluation])
    size = batch_size or self._batch_size
    dataset = grain.MapDataset.source(source).map(parse).batch(size, drop_remainder=True)
    return [dataset[i] for i in range(min(num_batches, len(dataset)))]

  def mean_merged(self, path: str) -> bool:
    return False  # Every tensor merges with RDA; a model with embeddings would list them here.

  def units_per_step(self, batch_size: int | None = None) -> int:
    return batch_size or self._batch_size


# -- the simulated run --------------------------------------------------------------------------


def run(workdir: str, *, steps: int = 96, num_learners: int = 4) -> dict[str, Any]:
  """Trains `RecordsTask` on the simulated cluster; returns its summary."""
  import ddiloco

  return ddiloco.simulate(
    workdir=workdir,
    run=ddiloco.RunConfig(
      task=RecordsTask(data_dir=os.path.join(workdir, "data")),
      schedule=ddiloco.FragmentSchedule(num_fragments=4, period=8, overlap=2),
      syncer=ddiloco.SyncerConfig(min_quorum=1),
      inner_opt=ddiloco.InnerOptConfig(peak_lr=1e-3, warmup_steps=8, decay_steps=steps),
      num_learners=num_learners,
      steps_per_learner=steps,
      eval_batches=8,
      eval_every_s=16.0,
    ),
    tensorboard=False,
  )


def main(argv: list[str]) -> None:
  del argv
  import ddiloco

  summary = run(_WORKDIR.value)
  evals = [e for e in ddiloco.read_events(_WORKDIR.value) if e["kind"] == "eval"]
  print(
    f"held-out loss {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}, accuracy "
    f"{evals[0]['accuracy']:.3f} -> {evals[-1]['accuracy']:.3f}; {summary['merges']} merges, "
    f"mean quorum {summary['mean_quorum_size']:.2f}; outputs in {_WORKDIR.value}"
  )


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from absl import app, flags

  _WORKDIR = flags.DEFINE_string("workdir", "workdirs/custom_task", "outputs and the data")
  app.run(main)
