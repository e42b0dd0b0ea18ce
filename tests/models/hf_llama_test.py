"""Tests of ddiloco/models/hf_llama.py: Hugging Face Llama checkpoints in and out.

The Hugging Face side is checked without torch or transformers, against a checkpoint that
transformers itself wrote: fixtures/hf_llama_tiny (made by fixtures/make_hf_llama.py with
transformers 5.24.0 and torch 2.13.0 on the CPU; grouped-query attention, RoPE base 500,000, RMSNorm
eps 1e-5) with `LlamaForCausalLM`'s logits on fixed tokens. ddiloco's forward on the imported
weights matches them to 5.8e-6 (logits up to 6.1). The other direction was checked once with the
same versions: `save` of the imported weights, single-file and in 6 shards, loaded by
`LlamaForCausalLM.from_pretrained` gave a state dict bit-identical to the fixture's and logits equal
to them exactly (`make_hf_llama.py --check=DIR` repeats that check on any export).
"""

import dataclasses
import json
import os
import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.tree import unflatten
from ddiloco.models import hf_llama, transformer

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_llama_tiny"


def _logits(config, flat, tokens):
  model = transformer.Transformer(config)
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  params = unflatten(flat, nn.unbox(abstract["params"]))
  return np.asarray(model.apply({"params": params}, tokens))


def _random_params(config, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(dtype) for k, s in hf_llama.param_shapes(config).items()}


def _config(**overrides):
  fields = dict(
    vocab_size=48, d_model=16, num_layers=2, num_heads=4, head_dim=4, mlp_dim=24, max_len=32
  )
  return transformer.TransformerConfig(**{**fields, **overrides})


def test_reads_the_checkpoint_transformers_wrote_and_matches_its_logits():
  config = hf_llama.read_config(str(FIXTURE))
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
  assert (config.rope_theta, config.norm_eps, config.tie_embeddings) == (500_000.0, 1e-5, False)
  assert (config.vocab_size, config.d_model, config.mlp_dim, config.max_len) == (64, 32, 64, 64)
  ref = np.load(FIXTURE / "logits.npz")
  logits = _logits(config, hf_llama.load(str(FIXTURE)), ref["tokens"])
  np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=2e-5)


def test_an_interleaved_rope_pairing_would_not_match():
  """The check above can fail: pairing features (2j, 2j+1), as Meta's original checkpoints do,
  changes the logits far beyond the tolerance."""
  config = hf_llama.read_config(str(FIXTURE))
  flat = hf_llama.load(str(FIXTURE))
  k = config.head_dim
  interleaved = np.concatenate([np.arange(0, k, 2), np.arange(1, k, 2)])
  for i in range(config.num_layers):
    for name in ("query", "key"):
      path = f"block_{i}/attn/{name}/kernel"
      flat[path] = flat[path][:, :, interleaved]
  ref = np.load(FIXTURE / "logits.npz")
  assert np.abs(_logits(config, flat, ref["tokens"]) - ref["logits"]).max() > 0.1


def test_names_and_layouts_are_hugging_faces():
  config = hf_llama.read_config(str(FIXTURE))
  flat = hf_llama.load(str(FIXTURE))
  tensors = hf_llama.to_hf(flat, config)
  q = tensors["model.layers.1.self_attn.q_proj.weight"]
  assert q.shape == (4 * 8, 32)
  # Row h*K + j of q_proj is feature j of head h; its columns are the input features.
  np.testing.assert_array_equal(q[2 * 8 + 3], flat["block_1/attn/query/kernel"][:, 2, 3])
  o = tensors["model.layers.0.self_attn.o_proj.weight"]
  np.testing.assert_array_equal(o[:, 1 * 8 + 5], flat["block_0/attn/out/kernel"][1, 5])
  np.testing.assert_array_equal(tensors["lm_head.weight"], flat["unembed/kernel"].T)
  assert len(tensors) == 2 + 9 * config.num_layers + 1


def test_config_json_round_trip():
  for config in (_config(), _config(num_kv_heads=2, tie_embeddings=True, rope_theta=1e6)):
    hf = hf_llama.to_hf_config(config)
    assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"] == config.rope_theta
    assert hf_llama.from_hf_config(json.loads(json.dumps(hf))) == config


@pytest.mark.parametrize("max_shard_bytes", [hf_llama.MAX_SHARD_BYTES, 3000])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_save_then_load_is_bit_exact(tmp_path, max_shard_bytes, dtype):
  config = _config(num_kv_heads=2, tie_embeddings=True)
  flat = _random_params(config, dtype=dtype)
  files = hf_llama.save(flat, config, str(tmp_path), max_shard_bytes=max_shard_bytes)
  assert sorted(files) == sorted(os.listdir(tmp_path))
  assert (hf_llama.INDEX_NAME in files) == (max_shard_bytes < hf_llama.MAX_SHARD_BYTES)
  assert "lm_head.weight" not in hf_llama.to_hf(flat, config)  # Tied: the embedding serves.
  with open(tmp_path / hf_llama.CONFIG_NAME) as f:
    assert json.load(f)["torch_dtype"] == np.dtype(dtype).name
  assert hf_llama.read_config(str(tmp_path)) == config
  loaded = hf_llama.load(str(tmp_path))
  assert loaded.keys() == flat.keys()
  for k, v in flat.items():
    assert loaded[k].dtype == v.dtype
    np.testing.assert_array_equal(loaded[k].view(np.uint8), v.view(np.uint8))


def test_load_reads_only_the_leaves_asked_for_and_casts(tmp_path):
  config = _config()
  flat = _random_params(config, dtype=ml_dtypes.bfloat16)
  hf_llama.save(flat, config, str(tmp_path), max_shard_bytes=3000)
  leaves = ["block_1/mlp/down/kernel", "unembed/kernel"]
  got = hf_llama.load(str(tmp_path), leaves=leaves, dtype=np.float32)
  assert sorted(got) == leaves
  for k in leaves:
    assert got[k].dtype == np.float32
    np.testing.assert_array_equal(got[k], flat[k].astype(np.float32))
  with pytest.raises(ValueError, match=r"no leaves \['block_9/x'\]"):
    hf_llama.load(str(tmp_path), leaves=["block_9/x"])


def _write_config(folder, **changes):
  hf = {**hf_llama.to_hf_config(_config()), **changes}
  hf = {k: v for k, v in hf.items() if v is not None or k in changes}
  folder.mkdir(exist_ok=True)
  (folder / hf_llama.CONFIG_NAME).write_text(json.dumps(hf))
  return folder


@pytest.mark.parametrize(
  "changes, message",
  [
    (
      dict(model_type="mistral", architectures=["MistralForCausalLM"]),
      r"model_type 'mistral' \['MistralForCausalLM'\]: only Llama",
    ),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(attention_bias=True), "the model has no biases"),
    (dict(mlp_bias=True), "the model has no biases"),
    (
      dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
      "RoPE type 'llama3' is not supported",
    ),
    (dict(rope_parameters=None, rope_scaling={"type": "linear"}), "RoPE type 'linear'"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_kv_heads=3 must divide"),
  ],
)
def test_unsupported_configs_are_refused_with_the_reason(tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    hf_llama.read_config(str(_write_config(tmp_path / "ckpt", **changes)))


def test_a_config_without_a_field_names_it(tmp_path):
  folder = _write_config(tmp_path / "ckpt")
  hf = json.loads((folder / hf_llama.CONFIG_NAME).read_text())
  del hf["intermediate_size"]
  (folder / hf_llama.CONFIG_NAME).write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=r"config\.json lacks 'intermediate_size'"):
    hf_llama.read_config(str(folder))


def test_overrides_take_only_what_the_checkpoint_does_not_fix():
  hf = hf_llama.to_hf_config(_config())
  config = hf_llama.from_hf_config(hf, dtype="bfloat16", remat=True, max_len=16)
  assert (config.dtype, config.remat, config.max_len) == (jnp.bfloat16, True, 16)
  with pytest.raises(ValueError, match=r"\['d_model', 'vocab_size'\] are fixed"):
    hf_llama.from_hf_config(hf, vocab_size=128, d_model=8)


def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"holds no config\.json"):
    hf_llama.read_config(str(tmp_path))
  folder = _write_config(tmp_path / "ckpt")
  with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
    hf_llama.load(str(folder))


def test_tensors_that_do_not_fit_the_config_are_refused(tmp_path):
  config = _config()
  tensors = hf_llama.to_hf(_random_params(config), config)
  with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \[\]"):
    hf_llama.from_hf({k: v for k, v in tensors.items() if k != "model.norm.weight"}, config)
  extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(16, np.float32)}
  with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.q_proj.bias'\]"):
    hf_llama.from_hf(extra, config)
  wrong = {**tensors, "model.layers.1.mlp.up_proj.weight": np.zeros((16, 24), np.float32)}
  with pytest.raises(ValueError, match=r"up_proj.weight has shape \(16, 24\); .* \(24, 16\)"):
    hf_llama.from_hf(wrong, config)
  # A buffer some checkpoints carry is no parameter: ignored.
  buffers = {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(2, np.float32)}
  assert hf_llama.from_hf(buffers, config).keys() == hf_llama.param_shapes(config).keys()
  # A checkpoint of another size than its config.json says.
  shutil.copytree(FIXTURE, tmp_path / "ckpt")
  _write_config(tmp_path / "ckpt", **{**hf_llama.to_hf_config(config), "hidden_size": 16})
  with pytest.raises(
    ValueError,
    match=r"embed_tokens\.weight has shape \(64, 32\); its config\.json implies \(48, 16\)",
  ):
    hf_llama.load(str(tmp_path / "ckpt"))


def test_models_without_a_llama_counterpart_are_not_exported(tmp_path):
  for config in (_config(num_experts=2), _config(causal=False), _config(rope=False)):
    with pytest.raises(ValueError, match=r"mixture of experts|causal decoder with RoPE"):
      hf_llama.save({}, config, str(tmp_path))
  config = _config()
  flat = _random_params(config)
  flat["block_0/mlp/up/kernel"] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match=r"wrong shapes \['block_0/mlp/up/kernel \(3, 3\) != "):
    hf_llama.save(flat, config, str(tmp_path))
  mixed = {**_random_params(config), "final_norm/scale": np.ones(16, ml_dtypes.bfloat16)}
  with pytest.raises(ValueError, match="mix dtypes"):
    hf_llama.save(mixed, config, str(tmp_path))


def test_exported_mha_and_tied_models_keep_their_logits(tmp_path):
  """Plain multi-head attention and a tied output projection, through save and load."""
  config = _config(tie_embeddings=True)
  flat = _random_params(config)
  hf_llama.save(flat, config, str(tmp_path))
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12) % config.vocab_size
  np.testing.assert_array_equal(
    _logits(config, hf_llama.load(str(tmp_path)), tokens), _logits(config, flat, tokens)
  )
  assert dataclasses.replace(config) == hf_llama.read_config(str(tmp_path))
