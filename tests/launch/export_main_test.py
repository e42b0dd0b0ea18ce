"""Tests of `ddiloco-export` (launch/export_main.py) in process: the run's model from its config.gin.

tests/launch/cli_test.py runs the console script itself (help, one-line errors).
"""

import os

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ddiloco.checkpoint.global_model import join_pieces, nest
from ddiloco.checkpoint.learner import LearnerCheckpointer
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
  run = export_main.run_model(str(tmp_path / "run" / "config.gin"))
  layout = make_layout(
    {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in run.signature.items()}, num_fragments=2
  )
  rng = np.random.default_rng(1)
  init = {k: rng.normal(size=layout.shapes[k]).astype(np.float32) for k in layout.shapes}
  merged = {k: init[k] + 1 for k in layout.fragments[1]}
  write_syncer_folder(
    str(tmp_path / "run" / "syncer"), layout, init, checkpointed={1: [merged]}, subdir=run.subdir
  )
  return str(tmp_path / "run"), join_pieces({**init, **merged})


def test_exports_the_runs_global_model_as_hf(tmp_path):
  run, params = _run(tmp_path)
  config, signature, subdir, learner_checkpoint = export_main.run_model(f"{run}/config.gin")
  assert subdir == "checkpoints"
  assert (learner_checkpoint.directory, learner_checkpoint.save_params) == (None, False)
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
  config, signature, _, _ = export_main.run_model(str(tmp_path / "config.gin"))
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


def _learner_checkpoint(run, learner_id, step, seed):
  """Learner `learner_id` of the run saves a checkpoint of `step` as the run's config says, with
  θ drawn from `seed`; returns θ (flat)."""
  model = export_main.run_model(f"{run}/config.gin")
  rng = np.random.default_rng(seed)
  theta = {k: rng.normal(size=s).astype(d) for k, (s, d) in model.signature.items()}
  opt_state = {"count": np.zeros((), np.int32)}
  ckpt = LearnerCheckpointer(
    model.learner_checkpoint,
    learner_id=learner_id,
    workdir=f"{run}/learner_{learner_id}",  # As ddiloco-local lays a run out.
    opt_target=opt_state,
    layout_digest="layout",
  )
  ckpt.save(
    step,
    opt_state=opt_state,
    data_state=None,
    tokens_trained=step * 32,
    schedule_step=step,
    params=jax.device_put(nest(theta)),
  )
  ckpt.close()
  return theta


def test_exports_a_learners_theta_from_the_runs_checkpoints(tmp_path):
  run, global_params = _run(tmp_path, RUN_GIN + "LearnerCheckpointConfig.save_params = True\n")
  theta = _learner_checkpoint(run, 1, step=6, seed=7)
  assert os.path.isdir(f"{run}/learner_1/checkpoints/6/params")
  info = export_main.export(run, fmt="hf", out=str(tmp_path / "hf"), learner=1)
  assert (info.model.learner_id, info.model.step, info.model.tokens_trained) == (1, 6, 192)
  loaded = hf_llama.load(str(tmp_path / "hf"))
  for k, v in theta.items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)
  assert not np.array_equal(loaded["final_norm/scale"], global_params["final_norm/scale"])
  assert export_main._describe(info) == (
    f"wrote hf to {tmp_path}/hf: {len(theta)} tensors, learner 1's θ at step 6 (192 tokens trained)"
  )


def test_a_learners_theta_under_the_runs_checkpoint_directory(tmp_path):
  shared = tmp_path / "learner_checkpoints"
  gin_text = RUN_GIN + f'LearnerCheckpointConfig.directory = "{shared}"\n'
  run, _ = _run(tmp_path, gin_text + "LearnerCheckpointConfig.save_params = True\n")
  theta = _learner_checkpoint(run, 0, step=4, seed=3)
  assert os.listdir(shared) == ["learner_0"]
  export_main.export(run, fmt="orbax", out=str(tmp_path / "out"), learner=0, step=4)
  restored = ocp.StandardCheckpointer().restore(str(tmp_path / "out"))
  np.testing.assert_array_equal(restored["unembed"]["kernel"], theta["unembed/kernel"])


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(learner=0, version=3), ValueError, "--version is the syncer's; .* --step"),
    (dict(step=3), ValueError, "--step is a learner checkpoint's: give --learner too"),
    (dict(learner=2), FileNotFoundError, r"Learner 2 has no checkpoint folder .*: \[1\]"),
    (dict(learner=1, step=9), ValueError, r"has no checkpoint 9; it has steps \[6\]"),
  ],
)  # fmt: skip
def test_bad_learner_requests_are_refused_and_nothing_is_written(tmp_path, kwargs, error, message):
  run, _ = _run(tmp_path)
  _learner_checkpoint(run, 1, step=6, seed=7)
  with pytest.raises(error, match=message):
    export_main.export(run, fmt="orbax", out=str(tmp_path / "out"), **kwargs)
  assert not (tmp_path / "out").exists()


def test_a_learner_checkpoint_without_theta_names_the_field_to_set(tmp_path):
  run, _ = _run(tmp_path)  # save_params is off: the checkpoint holds no θ.
  _learner_checkpoint(run, 1, step=6, seed=7)
  assert os.listdir(f"{run}/learner_1/checkpoints/6").count("params") == 0
  with pytest.raises(ValueError, match=r"LearnerCheckpointConfig\.save_params = True"):
    export_main.export(run, fmt="orbax", out=str(tmp_path / "out"), learner=1)
  assert not (tmp_path / "out").exists()
