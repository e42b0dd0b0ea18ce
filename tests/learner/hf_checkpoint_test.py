"""A run started from a Hugging Face Llama checkpoint (`RunConfig.hf_checkpoint`, `LearnerFactory`).

The factory is the one place initial parameters are made: the syncer's initial global model (whole,
or a shard's fragments) and every learner's start, in the simulator and in the learner and syncer
processes alike. Here: the checkpoint a run exported comes back bit for bit, and a simulated run
started from a checkpoint first evaluates that checkpoint's own loss.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.checkpoint import export
from ddiloco.checkpoint.global_model import nest
from ddiloco.data import text as text_data
from ddiloco.data import token_corpus, token_shards
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.factory import LearnerFactory, LearnerSpec
from ddiloco.metrics.writer import read_events
from ddiloco.models import hf_llama, transformer
from ddiloco.run_config import RunConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.testing.syncer_folders import write_syncer_folder

DATA = text_data.TextDataConfig(seq_len=16, batch_size=2)
INNER = train_step.InnerOptConfig(warmup_steps=1, decay_steps=10)
# vocab 256: the byte tokenizer's (TextTask keeps a checkpoint's vocabulary).
MODEL = transformer.TransformerConfig(
  vocab_size=256, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, mlp_dim=32,
  max_len=16, rope_theta=5e5, norm_eps=1e-5,
)  # fmt: skip


def _factory(**kwargs):
  kwargs.setdefault("model_config", MODEL)
  return LearnerFactory(data_config=DATA, inner_opt=INNER, num_fragments=3, **kwargs)


def _checkpoint(folder, seed=0, scale=1.0):
  """A Hugging Face checkpoint of MODEL with random weights (far from an init's loss)."""
  rng = np.random.default_rng(seed)
  flat = {
    k: (scale * rng.normal(size=s)).astype(np.float32)
    for k, s in hf_llama.param_shapes(MODEL).items()
  }
  hf_llama.save(flat, MODEL, str(folder))
  return flat


def test_an_exported_global_model_comes_back_bit_for_bit(tmp_path):
  source = _factory(seed=3)
  init = source.global_init_values()
  merged = {k: v * 1.5 + 0.25 for k, v in init.items() if k in source.layout.fragments[1]}
  write_syncer_folder(
    str(tmp_path / "run" / "syncer"), source.layout, init, checkpointed={1: [merged]}
  )
  exported = export.export_global_model(
    str(tmp_path / "run"), str(tmp_path / "hf"), fmt="hf", model_config=MODEL
  ).model.params

  started = _factory(hf_checkpoint=str(tmp_path / "hf"))
  assert started.layout == source.layout
  flat = started.global_init_values()
  assert flat.keys() == init.keys()
  for k in flat:
    np.testing.assert_array_equal(flat[k], exported[k], err_msg=k)
  assert not np.array_equal(flat[next(iter(merged))], init[next(iter(merged))])
  # A syncer shard reads only its own fragments' tensors, with the same values.
  fresh = _factory(hf_checkpoint=str(tmp_path / "hf"))
  part = fresh.global_init_values([1])
  assert part.keys() == set(source.layout.fragments[1])
  for k, v in part.items():
    np.testing.assert_array_equal(v, exported[k], err_msg=k)
  # Every learner starts from it too.
  learner = started.make_learner(
    0, spec=LearnerSpec(), schedule=FragmentSchedule(num_fragments=3), config=LearnerConfig()
  )
  for k, v in tree.flatten(jax.device_get(learner.params)).items():
    np.testing.assert_array_equal(v, exported[k], err_msg=k)


def _loss(flat, batches):
  """The mean token loss of flat params on batches, computed without the factory."""
  model = transformer.Transformer(MODEL)
  params = nest(flat)
  total = count = 0.0
  for batch in batches:
    logits = model.apply({"params": params}, batch["inputs"])
    loss, n = transformer.lm_loss(logits, jnp.asarray(batch["targets"]))
    total, count = total + float(loss) * float(n), count + float(n)
  return total / count


def _first_eval(tmp_path, name, **run):
  run.setdefault("data", DATA)
  simulate(
    workdir=str(tmp_path / name),
    run=RunConfig(
      schedule=FragmentSchedule(num_fragments=1, period=2, overlap=0),
      inner_opt=INNER,
      num_learners=1,
      steps_per_learner=2,
      eval_batches=2,
      eval_batch_size=2,
      eval_every_s=0.5,  # Before the first step ends (1 s): the initial global model.
      **run,
    ),
    tensorboard=False,
  )
  return read_events(str(tmp_path / name), "eval")[0]["loss"]


def test_a_simulated_run_from_a_checkpoint_first_evaluates_the_checkpoint(tmp_path):
  flat = _checkpoint(tmp_path / "hf")
  batches = text_data.eval_batches(DATA, num_batches=2, batch_size=2)
  expected = _loss(flat, batches)
  # The model comes from config.json alone: RunConfig.model is left unset.
  first = _first_eval(tmp_path, "pretrained", hf_checkpoint=str(tmp_path / "hf"))
  np.testing.assert_allclose(first, expected, rtol=1e-5)
  random_init = _loss(_factory().global_init_values(), batches)
  assert abs(random_init - expected) > 1.0, (random_init, expected)


def test_a_model_that_is_not_the_checkpoints_is_refused(tmp_path):
  _checkpoint(tmp_path / "hf")
  other = dataclasses.replace(MODEL, rope_theta=1e4, norm_eps=1e-6)
  with pytest.raises(ValueError, match=r"rope_theta 10000.0 \(config.json: 500000.0\), norm_eps"):
    RunConfig(model=other, data=DATA, hf_checkpoint=str(tmp_path / "hf"))
  # Fields the checkpoint does not fix are free.
  run = RunConfig(
    model=dataclasses.replace(MODEL, remat=True), data=DATA, hf_checkpoint=str(tmp_path / "hf")
  )
  assert run.the_task().model_config.remat
  with pytest.raises(FileNotFoundError, match=r"holds no config\.json"):
    RunConfig(data=DATA, hf_checkpoint=str(tmp_path / "nowhere"))
  small = dataclasses.replace(MODEL, vocab_size=64)
  hf_llama.save(
    {k: np.zeros(s, np.float32) for k, s in hf_llama.param_shapes(small).items()},
    small,
    str(tmp_path / "small"),
  )
  with pytest.raises(
    ValueError, match=r"'byte' has 256 ids, more than the model's vocabulary of 64"
  ):
    RunConfig(data=DATA, hf_checkpoint=str(tmp_path / "small"))


FIXTURE = pathlib.Path(__file__).parents[1] / "models" / "fixtures" / "hf_llama_tiny"


def test_a_run_from_the_checkpoint_transformers_wrote_on_its_own_token_ids(tmp_path):
  """The fixture's vocabulary is 64 ids: a corpus of such ids (as its tokenizer would write)."""
  rng = np.random.default_rng(0)
  windows = {s: list(rng.integers(0, 64, size=(n, 9))) for s, n in (("train", 40), ("eval", 8))}
  token_corpus.write_corpus(str(tmp_path / "ids"), windows, vocab_size=64, tokenizer="fixture")
  data = token_shards.TokenShardDataConfig(path=str(tmp_path / "ids"), batch_size=2)
  config = hf_llama.read_config(str(FIXTURE))
  batches = token_shards.eval_batches(data, num_batches=2, batch_size=2)
  model = transformer.Transformer(config)
  flat = hf_llama.load(str(FIXTURE))
  total = count = 0.0
  for batch in batches:
    logits = model.apply({"params": nest(flat)}, batch["inputs"])
    loss, n = transformer.lm_loss(logits, jnp.asarray(batch["targets"]))
    total, count = total + float(loss) * float(n), count + float(n)
  first = _first_eval(tmp_path, "fixture", data=data, hf_checkpoint=str(FIXTURE))
  np.testing.assert_allclose(first, total / count, rtol=1e-5)
