"""A tiny `Learner` on one CPU device, for tests of the learner, its kernel and its step boundary.

`tiny_learner` builds the tiny transformer (vocabulary 32, sequences of 8) with its jitted step,
a fragment layout of it and the schedule asked for, and loads the initial values as version 0 of
every fragment, as a learner's first registration does: held as pulled (the anchors of its
answers' outer gradients) and written to the devices.
"""

import jax
import numpy as np

from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.learner import Learner
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.protocol import FragmentState

BATCH, SEQ_LEN, VOCAB = 2, 8, 32


def tiny_learner(
  *,
  num_fragments: int = 2,
  period: int = 4,
  overlap: int = 1,
  config: LearnerConfig | None = None,
  split_large: bool = False,
  slices: int = 1,
) -> Learner:
  """The tiny learner (module docstring), P = `num_fragments`, H = `period`, τ = `overlap`, each
  fragment cut into `slices` slices (fragments/schedule.py)."""
  cfg = configs.transformer_config("tiny", vocab_size=VOCAB, max_len=SEQ_LEN)
  model = transformer.Transformer(cfg)
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=SEQ_LEN)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=1, decay_steps=20))
  steps = train_step.CompiledSteps(model, opt, mesh, abstract, shardings)
  flat = {k: np.asarray(v) for k, v in tree.flatten(jax.device_get(params)).items()}
  layout = layout_lib.make_layout(
    flat, num_fragments=num_fragments, split_large=split_large, slices=slices
  )
  schedule = FragmentSchedule(
    num_fragments=num_fragments, period=period, overlap=overlap, slices=slices
  )
  learner = Learner(
    learner_id=0, steps=steps, params=params, layout=layout, schedule=schedule, config=config
  )
  states = [fragment_state(layout.select(flat, p), p, 0) for p in range(layout.num_fragments)]
  for state in states:
    learner.kernel.held.keep(state)
  learner.load_global(states)
  return learner


def fragment_state(values: dict[str, np.ndarray], p: int, version: int) -> FragmentState:
  """Version `version` of fragment p with `values`, digested as the syncer publishes it."""
  return FragmentState(fragment=p, version=version, values=values, digest=values_digest(values))


def batch(seed: int) -> dict[str, np.ndarray]:
  """A batch of random tokens for the tiny learner."""
  x = np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, SEQ_LEN + 1), dtype=np.int32)
  return {"inputs": x[:, :-1], "targets": x[:, 1:]}
