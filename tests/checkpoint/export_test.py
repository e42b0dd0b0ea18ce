"""Tests of ddiloco/checkpoint/export.py: the global model, or a learner's θ, out as Orbax or
Hugging Face files.

The syncer folder is written as the runtime writes it (`testing.syncer_folders`), for a small
Llama-style transformer whose fragments hold known values: the export must hold exactly them. A
learner's checkpoints are written by `LearnerCheckpointer` itself, from θ sharded over a 2x2 mesh.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ddiloco.checkpoint import export, learner_params
from ddiloco.checkpoint import learner as learner_ckpt
from ddiloco.checkpoint.global_model import join_pieces
from ddiloco.fragments import tree
from ddiloco.fragments.layout import make_layout
from ddiloco.models import hf_llama, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.testing.syncer_folders import write_syncer_folder

CONFIG = transformer.TransformerConfig(
  vocab_size=48, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, mlp_dim=24,
  max_len=32, rope_theta=5e5,
)  # fmt: skip


def _signature(config=CONFIG):
  model = transformer.Transformer(config)
  return export.param_signature(model, jax.ShapeDtypeStruct((1, 8), jnp.int32))


def _run(tmp_path, *, split_large=False):
  """A run folder whose syncer published two versions of fragment 0 (the second after its
  checkpoint) and one of fragment 2; returns (run folder, the newest model's flat params,
  checkpoint 1's)."""
  signature = _signature()
  layout = make_layout(
    {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in signature.items()},
    num_fragments=3,
    split_large=split_large,
  )
  rng = np.random.default_rng(0)

  def values(p):
    return {k: rng.normal(size=layout.shapes[k]).astype(np.float32) for k in layout.fragments[p]}

  init = {k: v for p in range(3) for k, v in values(p).items()}
  first, second, other = values(0), values(0), values(2)
  write_syncer_folder(
    str(tmp_path / "run" / "syncer"),
    layout,
    init,
    checkpointed={0: [first], 2: [other]},
    later={0: [second]},
  )
  newest = join_pieces({**init, **second, **other})
  at_one = join_pieces({**init, **first, **other})
  return str(tmp_path / "run"), newest, at_one


def test_orbax_export_restores_with_orbax_alone_into_the_models_pytree(tmp_path):
  run, newest, _ = _run(tmp_path, split_large=True)
  out = tmp_path / "out"
  info = export.export_global_model(run, str(out), fmt="orbax", expected=_signature())
  assert info.model.versions == {0: 2, 1: 0, 2: 1}
  # What a user without ddiloco does: orbax reads the folder into a plain nested dict.
  restored = ocp.StandardCheckpointer().restore(str(out))
  assert sorted(restored) == ["block_0", "block_1", "final_norm", "token_embed", "unembed"]
  assert sorted(restored["block_1"]["attn"]) == ["key", "out", "query", "value"]
  for path, value in newest.items():
    node = restored
    for part in path.split("/"):
      node = node[part]
    got = np.asarray(node)
    assert got.dtype == np.float32 and got.shape == value.shape
    np.testing.assert_array_equal(got, value, err_msg=path)
  # The run's model takes the restored tree as its params.
  tokens = jnp.arange(8, dtype=jnp.int32)[None] % CONFIG.vocab_size
  logits = transformer.Transformer(CONFIG).apply({"params": restored}, tokens)
  assert logits.shape == (1, 8, CONFIG.vocab_size) and np.isfinite(np.asarray(logits)).all()
  provenance = json.loads((out / export.PROVENANCE_NAME).read_text())
  assert provenance["versions"] == {"0": 2, "1": 0, "2": 1}
  assert provenance["checkpoint_steps"] == [1]
  assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]  # The stage is gone.


def test_hf_export_is_the_global_model_and_a_checkpoint_step_is_that_checkpoints(tmp_path):
  run, newest, at_one = _run(tmp_path)
  info = export.export_global_model(
    run, str(tmp_path / "hf"), fmt="hf", model_config=CONFIG, expected=_signature()
  )
  assert set(info.files) == {"config.json", "model.safetensors", export.PROVENANCE_NAME}
  assert hf_llama.read_config(str(tmp_path / "hf")) == CONFIG
  loaded = hf_llama.load(str(tmp_path / "hf"))
  assert loaded.keys() == newest.keys()
  for k, v in newest.items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)
  export.export_global_model(run, str(tmp_path / "v1"), fmt="hf", step=1, model_config=CONFIG)
  first = hf_llama.load(str(tmp_path / "v1"))
  np.testing.assert_array_equal(first["token_embed/embedding"], at_one["token_embed/embedding"])
  assert any(not np.array_equal(first[k], newest[k]) for k in newest)


def _listing(root):
  return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(fmt="onnx"), ValueError, "format must be one of"),
    (dict(fmt="hf"), ValueError, "needs the run's transformer config"),
    (
      dict(fmt="hf", model_config=dataclasses.replace(CONFIG, num_experts=2)),
      ValueError,
      "mixture of experts has no Llama counterpart",
    ),
    (dict(fmt="orbax", step=9), ValueError, r"no checkpoint 9; it has steps \[1\]"),
    (
      dict(fmt="hf", model_config=dataclasses.replace(CONFIG, mlp_dim=8)),
      ValueError,
      "wrong shapes",
    ),
    (
      dict(fmt="orbax", expected=_signature(dataclasses.replace(CONFIG, vocab_size=64))),
      ValueError,
      "does not fit the run's model",
    ),
  ],
)  # fmt: skip
def test_bad_input_is_refused_and_nothing_is_written(tmp_path, kwargs, error, message):
  run, _, _ = _run(tmp_path)
  before = _listing(tmp_path)
  with pytest.raises(error, match=message):
    export.export_global_model(run, str(tmp_path / "out"), **kwargs)
  assert _listing(tmp_path) == before


def test_an_output_folder_that_holds_something_is_refused(tmp_path):
  run, _, _ = _run(tmp_path)
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="is not an empty folder"):
    export.export_global_model(run, str(tmp_path / "out"), fmt="orbax")
  assert os.listdir(tmp_path / "out") == ["notes.txt"]
  (tmp_path / "empty").mkdir()  # An empty folder is taken.
  export.export_global_model(run, str(tmp_path / "empty"), fmt="orbax")
  assert export.PROVENANCE_NAME in os.listdir(tmp_path / "empty")


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
  run, _, _ = _run(tmp_path)
  before = _listing(tmp_path)

  def fail(params, config, folder):
    os.makedirs(folder)
    (open(os.path.join(folder, "model.safetensors"), "w")).close()
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(hf_llama, "save", fail)
  with pytest.raises(OSError, match="No space left"):
    export.export_global_model(run, str(tmp_path / "out"), fmt="hf", model_config=CONFIG)
  assert _listing(tmp_path) == before


# -- a learner's θ ----------------------------------------------------------------------------------


def _learner_run(tmp_path, *, save_params=True, directory=None):
  """A run folder where learner 1 saved checkpoints 3 and 5 (θ sharded over a 2x2 mesh, moved off
  its initial values) and learner 0 saved checkpoint 2; returns (run folder, {step: learner 1's
  flat θ})."""
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:4], model_parallelism=2)
  params, _ = partitioning.init_params(transformer.Transformer(CONFIG), mesh, jax.random.key(0))
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
  config = learner_ckpt.LearnerCheckpointConfig(save_params=save_params, directory=directory)
  opt_state = {"count": jnp.zeros((), jnp.int32)}  # Stands for the optimizer state.
  run = tmp_path / "run"
  saved = {}
  for learner_id, steps in ((1, (3, 5)), (0, (2,))):
    ckpt = learner_ckpt.LearnerCheckpointer(
      config,
      learner_id=learner_id,
      workdir=str(run / f"learner_{learner_id}"),
      opt_target=opt_state,
      layout_digest="layout",
    )
    for step in steps:
      theta = jax.tree.map(lambda x, s=step, i=learner_id: x * s + i, params)
      ckpt.save(
        step,
        opt_state=opt_state,
        data_state=None,
        tokens_trained=step * 16,
        schedule_step=step,
        params=theta,
      )
      if learner_id == 1:
        saved[step] = {k: np.asarray(v) for k, v in tree.flatten(jax.device_get(theta)).items()}
    ckpt.close()
  return str(run), saved


def test_a_learners_theta_exports_as_orbax_and_restores_with_orbax_alone(tmp_path):
  run, saved = _learner_run(tmp_path)
  out = tmp_path / "out"
  info = export.export_learner_params(
    run, str(out), learner_id=1, fmt="orbax", expected=_signature()
  )
  assert (info.model.learner_id, info.model.step, info.model.tokens_trained) == (1, 5, 80)
  restored = ocp.StandardCheckpointer().restore(str(out))
  assert tree.flatten(restored).keys() == saved[5].keys()  # The model's own pytree.
  for path, value in saved[5].items():
    node = restored
    for part in path.split("/"):
      node = node[part]
    got = np.asarray(node)
    assert got.dtype == value.dtype and got.shape == value.shape
    np.testing.assert_array_equal(got, value, err_msg=path)  # Bit for bit, gathered from 4 devices.
  tokens = jnp.arange(8, dtype=jnp.int32)[None] % CONFIG.vocab_size
  logits = transformer.Transformer(CONFIG).apply({"params": restored}, tokens)
  assert logits.shape == (1, 8, CONFIG.vocab_size)
  provenance = json.loads((out / export.PROVENANCE_NAME).read_text())
  assert provenance["format"] == "orbax"
  assert (provenance["learner_id"], provenance["step"], provenance["tokens_trained"]) == (1, 5, 80)
  assert provenance["checkpoint_folder"] == f"{run}/learner_1/checkpoints"
  assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_a_learners_theta_exports_as_hf_and_a_step_is_that_checkpoints(tmp_path):
  run, saved = _learner_run(tmp_path)
  info = export.export_learner_params(
    run, str(tmp_path / "hf"), learner_id=1, fmt="hf", step=3, model_config=CONFIG
  )
  assert info.model.step == 3
  assert set(info.files) == {"config.json", "model.safetensors", export.PROVENANCE_NAME}
  loaded = hf_llama.load(str(tmp_path / "hf"))
  assert loaded.keys() == saved[3].keys()
  for k, v in saved[3].items():
    np.testing.assert_array_equal(loaded[k], v, err_msg=k)


def test_a_learners_theta_under_a_shared_checkpoint_directory(tmp_path):
  shared = str(tmp_path / "shared")
  run, saved = _learner_run(tmp_path, directory=shared)
  assert sorted(os.listdir(shared)) == ["learner_0", "learner_1"]
  config = learner_ckpt.LearnerCheckpointConfig(directory=shared)
  assert learner_params.learner_folders(config, run) == {
    0: f"{shared}/learner_0",
    1: f"{shared}/learner_1",
  }
  info = export.export_learner_params(
    run, str(tmp_path / "out"), learner_id=1, fmt="orbax", checkpoint=config
  )
  np.testing.assert_array_equal(info.model.params["unembed/kernel"], saved[5]["unembed/kernel"])
  # Without the run's `directory` the learners' folders are not found.
  with pytest.raises(FileNotFoundError, match=r"no learner has one"):
    export.export_learner_params(run, str(tmp_path / "o2"), learner_id=1, fmt="orbax")


@pytest.mark.parametrize(
  "save_params, kwargs, error, message",
  [
    (True, dict(learner_id=7), FileNotFoundError,
     r"Learner 7 has no checkpoint folder under .*run; learners with checkpoints: \[0, 1\]"),
    (True, dict(learner_id=1, step=4), ValueError, r"has no checkpoint 4; it has steps \[3, 5\]"),
    (False, dict(learner_id=1), ValueError,
     r"holds no parameters: .* LearnerCheckpointConfig\.save_params = True"),
    (True, dict(learner_id=1, fmt="hf"), ValueError, "needs the run's transformer config"),
    (
      True,
      dict(learner_id=1, expected=_signature(dataclasses.replace(CONFIG, vocab_size=64))),
      ValueError,
      "Learner 1's θ does not fit the run's model",
    ),
    (
      True,
      dict(learner_id=1, fmt="hf", model_config=dataclasses.replace(CONFIG, mlp_dim=8)),
      ValueError,
      "wrong shapes",
    ),
  ],
)  # fmt: skip
def test_bad_learner_input_is_refused_and_nothing_is_written(
  tmp_path, save_params, kwargs, error, message
):
  run, _ = _learner_run(tmp_path, save_params=save_params)
  before = _listing(tmp_path)
  with pytest.raises(error, match=message):
    export.export_learner_params(run, str(tmp_path / "out"), **{"fmt": "orbax", **kwargs})
  assert _listing(tmp_path) == before
