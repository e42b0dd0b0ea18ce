"""Tests of `ddiloco-export` (launch/export_main.py) in process: the run's model from its config.gin.

tests/launch/cli_test.py runs the console script itself (help, one-line errors).
"""

import os

import gin
import jax
import numpy as np
import pytest

from ddiloco.checkpoint.global_model import join_pieces
from ddiloco.fragments.layout import make_layout
from ddiloco.launch import configurables, export_main
from ddiloco.models import hf_llama
from ddiloco.testing.syncer_folders import write_syncer_folder

RUN_GIN = """
RunConfig.model = @transformer_config()
RunConfig.data = @TextDataConfig()
transformer_config.size = "tiny"
transformer_config.num_layers = 1
transformer_config.d_model = 16
transformer_config.num_heads = 2
transformer_config.head_dim = 8
transformer_config.mlp_dim = 32
transformer_config.max_len = 16
TextDataConfig.seq_len = 16
"""


def _run(tmp_path, gin_text=RUN_GIN):
  """A run folder with config.gin and a syncer that merged fragment 1 once; returns (folder,
  the global model's flat params)."""
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "config.gin").write_text(gin_text)
  _, signature, subdir = export_main.run_model(str(tmp_path / "run" / "config.gin"))
  layout = make_layout(
    {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in signature.items()}, num_fragments=2
  )
  rng = np.random.default_rng(1)
  init = {k: rng.normal(size=layout.shapes[k]).astype(np.float32) for k in layout.shapes}
  merged = {k: init[k] + 1 for k in layout.fragments[1]}
  write_syncer_folder(
    str(tmp_path / "run" / "syncer"), layout, init, checkpointed={1: [merged]}, subdir=subdir
  )
  return str(tmp_path / "run"), join_pieces({**init, **merged})


def test_exports_the_runs_global_model_as_hf(tmp_path):
  run, params = _run(tmp_path)
  config, signature, subdir = export_main.run_model(f"{run}/config.gin")
  assert subdir == "checkpoints"
  assert (config.vocab_size, config.d_model, config.num_layers) == (256, 16, 1)  # Byte vocabulary.
  assert signature["token_embed/embedding"] == ((256, 16), np.dtype(np.float32))
  info = export_main.export(run, fmt="hf", out=str(tmp_path / "hf"))
  assert info.model.versions == {0: 0, 1: 1}
  assert hf_llama.read_config(str(tmp_path / "hf")) == config
  loaded = hf_llama.load(str(tmp_path / "hf"))
  for k, v in params.items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)


def test_a_run_without_config_gin_is_named(tmp_path):
  run, _ = _run(tmp_path)
  (tmp_path / "run" / "config.gin").unlink()
  with pytest.raises(FileNotFoundError, match=r"holds no config\.gin .* --config"):
    export_main.export(run, fmt="orbax", out=str(tmp_path / "out"))
  # The syncer's own copy serves, as does --config.
  (tmp_path / "run" / "syncer" / "config.gin").write_text(RUN_GIN)
  assert export_main.find_config(run) == f"{run}/syncer/config.gin"
  export_main.export(run, fmt="orbax", out=str(tmp_path / "out"))
  assert (tmp_path / "out" / "_CHECKPOINT_METADATA").exists()


def test_a_model_that_is_no_llama_is_refused_for_hf_and_nothing_is_written(tmp_path):
  run, _ = _run(tmp_path, RUN_GIN + "transformer_config.rope = False\n")
  with pytest.raises(ValueError, match="causal decoder with RoPE"):
    export_main.export(run, fmt="hf", out=str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()


def test_the_config_gin_a_launcher_writes_gives_the_runs_model(tmp_path):
  """`gin_flags.parse_gin` writes `gin.config_str()` of the parsed files into the run's folder."""
  configurables.parse(["local_tiny.gin"])
  try:
    (tmp_path / "config.gin").write_text(gin.config_str())
  finally:
    configurables.clear()
  config, signature, _ = export_main.run_model(str(tmp_path / "config.gin"))
  assert (config.d_model, config.num_layers, config.vocab_size, config.max_len) == (128, 4, 256, 64)
  assert len(signature) == 2 + 9 * 4 + 1


def test_the_syncers_checkpoints_folder_is_the_runs(tmp_path):
  run, params = _run(tmp_path, RUN_GIN + 'SyncerCheckpointConfig.subdir = "state"\n')
  assert os.path.isdir(f"{run}/syncer/state")
  info = export_main.export(run, fmt="hf", out=str(tmp_path / "hf"))
  assert info.model.versions == {0: 0, 1: 1}
  np.testing.assert_array_equal(
    hf_llama.load(str(tmp_path / "hf"))["final_norm/scale"], params["final_norm/scale"]
  )
