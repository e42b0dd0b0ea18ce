"""`import ddiloco`: the names a notebook needs, loaded on first use."""

import subprocess
import sys

import pytest

import ddiloco


def test_top_level_names_are_the_submodules_objects():
  from ddiloco.data.text import TextDataConfig
  from ddiloco.fragments.schedule import FragmentSchedule
  from ddiloco.simulation.config import ClusterConfig
  from ddiloco.simulation.simulate import simulate
  from ddiloco.syncer.core import SyncerConfig

  assert ddiloco.simulate is simulate
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


def test_import_ddiloco_does_not_import_jax():
  code = "import sys, ddiloco; print('jax' in sys.modules, ddiloco.__version__)"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
  )
  assert out.stdout.split() == ["False", ddiloco.__version__]
