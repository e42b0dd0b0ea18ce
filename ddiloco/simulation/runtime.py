"""Builds what every learner of a run shares: the model, meshes, compiled steps, layout and eval set.

Used by the simulated cluster; the distributed learner process builds the same pieces for one learner.
"""

import dataclasses

import jax
import numpy as np

from ddiloco.data import text as text_data
from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step as train_step_lib
from ddiloco.learner.learner import Learner, LearnerConfig
from ddiloco.models import transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.simulation.config import LearnerSpec


class LearnerFactory:
  """Model, data and compiled steps for the learners of one run.

  Args:
    model_config: the transformer's config; its vocab must match the tokenizer's.
    data_config: the text pipeline's config.
    inner_opt: the inner AdamW config.
    num_fragments: P.
    layout_strategy: "balanced" | "layer" | "tensor".
    split_large: allow splitting tensors larger than total/P (SPEC §2 decision, off by default).
    num_shards: disjoint data shards (one per learner slot).
    seed: parameter-initialisation seed (every learner starts from the same global init).
    eval_batches: held-out batches used for every evaluation.
    batch_size: per-learner batch override (None: the data config's); sets `tokens_per_step`.
  """

  def __init__(
    self,
    *,
    model_config: transformer.TransformerConfig,
    data_config: text_data.TextDataConfig,
    inner_opt: train_step_lib.InnerOptConfig,
    num_fragments: int,
    layout_strategy: str = "balanced",
    split_large: bool = False,
    num_shards: int = 1,
    seed: int = 0,
    eval_batches: int = 8,
    batch_size: int | None = None,
  ):
    vocab = text_data.get_tokenizer(data_config.tokenizer).vocab_size
    if model_config.vocab_size != vocab:
      model_config = dataclasses.replace(model_config, vocab_size=vocab)
    self.model_config = model_config
    self.model = transformer.Transformer(model_config)
    self.data_config = data_config
    self.optimizer = train_step_lib.make_inner_optimizer(inner_opt)
    self.num_shards = num_shards
    self.seed = seed
    self._steps: dict[tuple[int, ...], train_step_lib.CompiledSteps] = {}
    self._host_init = None
    self.tokens_per_step = (batch_size or data_config.batch_size) * data_config.seq_len
    steps0, params0 = self._compiled(mesh_lib.learner_devices(0, 1))
    self._init_flat = {k: np.asarray(jax.device_get(v)) for k, v in tree.flatten(params0).items()}
    self.num_params = int(sum(v.size for v in self._init_flat.values()))
    self.layout = layout_lib.make_layout(
      self._init_flat,
      num_fragments=num_fragments,
      strategy=layout_strategy,
      split_large=split_large,
    )
    self._eval_steps = steps0
    self._eval_batches = text_data.eval_batches(data_config, num_batches=eval_batches)

  def _compiled(self, devices: list[jax.Device]):
    """Compiled steps and the initial params placed on a device slice; steps cached per slice.

    Parameters are initialised once (on the first slice) and copied to later slices: learners
    overwrite them with the global fragments at start anyway, and a jitted init per mesh costs a
    compile each.
    """
    key = tuple(d.id for d in devices)
    if key not in self._steps:
      mesh = mesh_lib.make_mesh(devices=devices)
      if not self._steps:
        params, shardings = partitioning.init_params(
          self.model,
          mesh,
          jax.random.key(self.seed),
          batch_size=1,
          seq_len=self.data_config.seq_len,
        )
        self._host_init = jax.device_get(params)
      else:
        _, shardings = partitioning.abstract_params(
          self.model, mesh, batch_size=1, seq_len=self.data_config.seq_len
        )
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._host_init)
      steps = train_step_lib.CompiledSteps(self.model, self.optimizer, mesh, abstract, shardings)
      self._steps[key] = steps
    steps = self._steps[key]
    return steps, jax.device_put(self._host_init, steps.param_shardings)

  def global_init_values(self) -> dict[str, np.ndarray]:
    """The initial global parameters keyed as the layout keys them (split pieces included)."""
    return {k: v for frag in self.layout.split(self._init_flat) for k, v in frag.items()}

  def embedding_keys(self) -> frozenset[str]:
    """Layout keys merged with the weighted mean (SPEC §4.5 decision: input and output embeddings)."""
    keys = (k for frag in self.layout.fragments for k in frag)
    return frozenset(k for k in keys if transformer.is_embedding_path(k.split("@", 1)[0]))

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
    return text_data.make_train_iterator(
      self.data_config,
      shard_index=index % self.num_shards,
      num_shards=self.num_shards,
      batch_size=spec.batch_size,
    )

  def evaluate_flat(self, flat: dict[str, np.ndarray]) -> float:
    """Held-out loss of full flat parameters {leaf path: array}."""
    steps = self._eval_steps
    params = tree.unflatten(flat, steps.param_shardings)  # The shardings tree gives the structure.
    params = jax.device_put(params, steps.param_shardings)
    return train_step_lib.eval_loss(steps, params, self._eval_batches)
