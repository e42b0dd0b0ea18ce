"""Builds what every learner of a run shares: the task, meshes, compiled steps, layout and eval set.

Used by the simulated cluster and by the distributed learner process (`JobConfig.make_learner`),
which builds the same pieces for one learner.
What is trained (model, loss, data, eval, mean-merged tensors) comes from a `ddiloco.tasks.Task`.
"""

import dataclasses
import math
from collections.abc import Iterable

import jax
import numpy as np

from ddiloco.data import text as text_data
from ddiloco.data import token_shards
from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step as train_step_lib
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.learner import Learner
from ddiloco.models import hf_llama, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.tasks import Task, TextTask, TokenShardTask


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
  """One learner's hardware, as the factory and the simulator see it.

  Attributes:
    step_time_s: virtual seconds per inner step.
    batch_size: sequences per step (None: the data config's).
    devices: devices in this learner's mesh.
    jitter: log-normal sigma of the per-step time (0: constant).
  """

  step_time_s: float = 1.0
  batch_size: int | None = None
  devices: int = 1
  jitter: float = 0.0


def resolve_task(
  task: Task | None,
  model: transformer.TransformerConfig | None,
  data: text_data.TextDataConfig | token_shards.TokenShardDataConfig | None,
  *,
  keep_vocab: bool = False,
) -> Task:
  """`task`, or the language-modelling task of a (model, data) pair: a `TextTask` on the
  Shakespeare pipeline, a `TokenShardTask` on a pre-tokenized corpus.

  Args:
    task, model, data: exactly one of `task` and the (model, data) pair.
    keep_vocab: the model keeps its vocabulary (a pretrained checkpoint's).

  Raises:
    ValueError: unless exactly one of `task` and the complete (model, data) pair is given.
  """
  if task is not None:
    if model is not None or data is not None:
      raise ValueError("Give either a task or a (model, data) pair, not both.")
    return task
  if model is None or data is None:
    raise ValueError("Needs a task, or a text model config and a text data config (bind in gin).")
  if isinstance(data, token_shards.TokenShardDataConfig):
    return TokenShardTask(model=model, data=data, keep_vocab=keep_vocab)
  return TextTask(model=model, data=data, keep_vocab=keep_vocab)


def check_hf_checkpoint(task: Task, checkpoint: str) -> transformer.TransformerConfig:
  """The task's transformer, checked to be the model of the Hugging Face checkpoint `checkpoint`.

  Raises:
    ValueError: if the task's model is not the text transformer, or not the checkpoint's.
    FileNotFoundError: if `checkpoint` holds no config.json.
  """
  config = getattr(task, "model_config", None)
  if not isinstance(config, transformer.TransformerConfig):
    raise ValueError(
      f"hf_checkpoint reads a Hugging Face Llama checkpoint; the task {type(task).__name__} does not "
      "train the text transformer."
    )
  hf_llama.check_same_architecture(config, checkpoint)
  return config


class LearnerFactory:
  """Task and compiled steps for the learners of one run.

  Args:
    task: what to train (`ddiloco.tasks`); or, for text, give `model_config` and `data_config`.
    model_config: the transformer's config (its vocab is set from the tokenizer): builds a
      `TextTask` with `data_config`.
    data_config: the text pipeline's config.
    inner_opt: the inner AdamW config.
    num_fragments: P.
    slices: S slices per fragment, one per syncer shard (`make_layout`): the layout has P·S.
    layout_strategy: "balanced" | "layer" | "tensor".
    split_large: allow splitting tensors larger than total/P (docs/algorithm.md §2 decision, off by default).
    num_shards: disjoint data shards (one per learner slot).
    seed: parameter-initialisation seed (every learner starts from the same global init).
    hf_checkpoint: a Hugging Face Llama checkpoint folder whose weights are the initial global model
      instead (`RunConfig.hf_checkpoint`); the task's transformer must be its model.
    eval_batches: held-out batches used for every evaluation.
    eval_batch_size: examples per held-out batch.
    batch_size: per-learner batch override (None: the task's); sets `tokens_per_step` (merge
      units per nominal step: tokens for text, examples for vision).
    model_parallelism: size of every learner mesh's "model" axis (tensor parallelism over the
      logical axes the rules table maps there); it must divide a learner's device count. The
      factory's own slice (the initial parameters and the syncer's evaluation) uses the largest
      part of it that divides its devices: the values are the same on any mesh.

  Attributes:
    last_eval: the metrics ({"loss", **aux}) of the latest `evaluate_flat(_metrics)` call.
  """

  def __init__(
    self,
    *,
    task: Task | None = None,
    model_config: transformer.TransformerConfig | None = None,
    data_config: text_data.TextDataConfig | None = None,
    inner_opt: train_step_lib.InnerOptConfig,
    num_fragments: int,
    slices: int = 1,
    layout_strategy: str = "balanced",
    split_large: bool = False,
    num_shards: int = 1,
    seed: int = 0,
    hf_checkpoint: str | None = None,
    eval_batches: int = 8,
    eval_batch_size: int = 8,
    batch_size: int | None = None,
    model_parallelism: int = 1,
  ):
    if isinstance(model_parallelism, bool) or not isinstance(model_parallelism, int):
      raise ValueError(f"model_parallelism must be an int, got {model_parallelism!r}.")
    if model_parallelism < 1:
      raise ValueError(f"model_parallelism must be >= 1, got {model_parallelism}.")
    self.model_parallelism = model_parallelism
    self.task = resolve_task(task, model_config, data_config)
    self.model = self.task.model
    self.optimizer = train_step_lib.make_inner_optimizer(inner_opt)
    self.num_shards = num_shards
    self.seed = seed
    self.hf_checkpoint = hf_checkpoint
    if hf_checkpoint is not None:
      check_hf_checkpoint(self.task, hf_checkpoint)
    self._steps: dict[tuple[int, ...], train_step_lib.CompiledSteps] = {}
    self._host_init = None  # The whole initial model, made on first need (`_full_init`).
    self._init_flat: dict[str, np.ndarray] | None = None
    self._shapes = None  # The params' shapes and dtypes, set by the first `_steps_for`.
    self.tokens_per_step = self.task.units_per_step(batch_size)
    self.last_eval: dict[str, float] | None = None
    # This process's own first device: in a multi-process learner jax.devices()[0] is process 0's,
    # which the other processes cannot read back (learner_process/multihost.py).
    own = mesh_lib.learner_devices(0, 1, jax.local_devices())
    self._eval_steps = self._steps_for(own, math.gcd(model_parallelism, len(own)))
    # Shapes only: a syncer shard never materialises the parts of the model it does not own.
    shapes = tree.flatten(self._shapes)
    self.num_params = int(sum(math.prod(v.shape) for v in shapes.values()))
    self.layout = layout_lib.make_layout(
      shapes,
      num_fragments=num_fragments,
      strategy=layout_strategy,
      split_large=split_large,
      slices=slices,
    )
    # Fixed by these two alone (not by the learners' batches): one held-out set per run file.
    self._eval_batches = self.task.eval_batches(eval_batches, batch_size=eval_batch_size)

  def _steps_for(
    self, devices: list[jax.Device], model_parallelism: int | None = None
  ) -> train_step_lib.CompiledSteps:
    """Compiled steps on a device slice, cached per slice (no parameter values needed)."""
    mp = self.model_parallelism if model_parallelism is None else model_parallelism
    key = (*(d.id for d in devices), mp)
    if key not in self._steps:
      mesh = mesh_lib.make_mesh(devices=devices, model_parallelism=mp)
      inputs = self.task.dummy_inputs(batch_size=1)
      abstract, shardings = partitioning.abstract_params(self.model, mesh, inputs=inputs)
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
      self._shapes = abstract  # The same on every slice: the layout's input (shapes only).
      self._steps[key] = train_step_lib.CompiledSteps(
        self.task, self.optimizer, mesh, abstract, shardings
      )
    return self._steps[key]

  def _full_init(self):
    """The whole initial model on the host, initialised once on the factory's own slice.

    Learners overwrite their parameters with the global fragments at start anyway, and a jitted
    init per mesh would cost a compile each, so later slices get copies of these values.
    """
    if self._host_init is None and self.hf_checkpoint is not None:
      self._host_init = tree.unflatten(self._pretrained(), self._shapes)
    if self._host_init is None:
      steps = self._eval_steps
      params, _ = partitioning.init_params(
        self.model,
        steps.mesh,
        jax.random.key(self.seed),
        inputs=self.task.dummy_inputs(batch_size=1),
      )
      self._host_init = jax.device_get(params)
    return self._host_init

  def _compiled(self, devices: list[jax.Device], model_parallelism: int | None = None):
    """Compiled steps and the initial params placed on a device slice; steps cached per slice."""
    steps = self._steps_for(devices, model_parallelism)
    return steps, jax.device_put(self._full_init(), steps.param_shardings)

  def global_init_values(self, fragments: Iterable[int] | None = None) -> dict[str, np.ndarray]:
    """The initial global parameters keyed as the layout keys them (split pieces included).

    Args:
      fragments: only these fragments' keys (a syncer shard's own); None: every fragment. Only
        the leaves they need are initialised (`partitioning.init_leaves`), unless the whole model
        is already on the host.
    """
    wanted = range(self.layout.num_fragments) if fragments is None else sorted(set(fragments))
    keys = [k for p in wanted for k in self.layout.fragments[p]]
    leaves = {layout_lib.parse_key(k)[0] for k in keys}
    if fragments is None or self._host_init is not None:
      if self._init_flat is None:
        self._init_flat = {k: np.asarray(v) for k, v in tree.flatten(self._full_init()).items()}
      flat = self._init_flat
    elif self.hf_checkpoint is not None:
      flat = self._pretrained(leaves)
    else:
      steps = self._eval_steps
      some = partitioning.init_leaves(
        self.model,
        steps.mesh,
        jax.random.key(self.seed),
        leaves,
        inputs=self.task.dummy_inputs(batch_size=1),
      )
      flat = {k: np.asarray(jax.device_get(v)) for k, v in some.items()}
    return {k: v for p in wanted for k, v in self.layout.select(flat, p).items()}

  def _pretrained(self, leaves: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's flat params (only `leaves`, if given), in the model's param dtypes."""
    dtypes = {k: v.dtype for k, v in tree.flatten(self._shapes).items()}
    flat = hf_llama.load(self.hf_checkpoint, self.task.model_config, leaves=leaves)
    return {k: np.asarray(v, dtype=dtypes[k]) for k, v in flat.items()}

  def embedding_keys(self) -> frozenset[str]:
    """Layout keys merged with the weighted mean (docs/algorithm.md §4.5 decision; `Task.mean_merged`)."""
    keys = (k for frag in self.layout.fragments for k in frag)
    return frozenset(k for k in keys if self.task.mean_merged(layout_lib.parse_key(k)[0]))

  def make_learner(
    self,
    index: int,
    *,
    spec: LearnerSpec,
    schedule: FragmentSchedule,
    config: LearnerConfig,
    device_slot: int | None = None,
  ) -> Learner:
    """Learner `index` on device slice `device_slot` (default `index`; a learner process uses 0)."""
    slot = index if device_slot is None else device_slot
    devices = mesh_lib.learner_devices(slot, spec.devices)
    steps, params = self._compiled(devices)
    return Learner(
      learner_id=index,
      steps=steps,
      params=params,
      layout=self.layout,
      schedule=schedule,
      config=config,
    )

  def make_data(self, index: int, *, spec: LearnerSpec):
    """Learner `index`'s endless, checkpointable iterator over shard `index % num_shards`."""
    return self.task.make_train_iterator(
      shard_index=index % self.num_shards, num_shards=self.num_shards, batch_size=spec.batch_size
    )

  def evaluate_flat(self, flat: dict[str, np.ndarray]) -> float:
    """Held-out loss of full flat parameters {leaf path: array}."""
    return self.evaluate_flat_metrics(flat)["loss"]

  def evaluate_flat_metrics(self, flat: dict[str, np.ndarray]) -> dict[str, float]:
    """Held-out loss and the task's aux metric means (e.g. "accuracy") of flat parameters."""
    steps = self._eval_steps
    params = tree.unflatten(flat, steps.param_shardings)  # The shardings tree gives the structure.
    params = jax.device_put(params, steps.param_shardings)
    self.last_eval = train_step_lib.eval_metrics(steps, params, self._eval_batches)
    return self.last_eval
