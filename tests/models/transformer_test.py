"""Tests for ddiloco.models.transformer and ddiloco.models.configs."""

import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.fragments.tree import flatten
from ddiloco.models import configs, transformer

REPO = pathlib.Path(__file__).resolve().parents[2]
V = 256
L = 16


def _model(**overrides):
  cfg = configs.transformer_config("tiny", num_layers=2, max_len=L, **overrides)
  return transformer.Transformer(cfg)


def _init(model, seq_len=L):
  boxed = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
  return boxed, nn.unbox(boxed)


def _apply(model, params, tokens, **kwargs):
  # jit: eager op-by-op dispatch of a whole transformer is far slower than one compile.
  return jax.jit(lambda p, t: model.apply({"params": p}, t, **kwargs))(params, tokens)


@pytest.fixture(scope="module")
def tiny():
  """One 2-layer tiny model, its params and a jitted forward, shared to keep compiles few."""
  model = _model()
  boxed, params = _init(model)
  tokens = jax.random.randint(jax.random.key(1), (4, L), 0, V)
  forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
  return model, boxed, params, tokens, forward


def test_forward_shape_and_dtype(tiny):
  _, _, params, tokens, forward = tiny
  logits = forward(params, tokens)
  assert logits.shape == (4, L, V)
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()


def test_bfloat16_compute_still_returns_float32_logits(tiny):
  _, _, params, tokens, forward = tiny
  assert params["block_0"]["attn"]["query"]["kernel"].dtype == jnp.float32  # param_dtype default
  logits = _apply(_model(dtype="bfloat16"), params, tokens)
  assert logits.dtype == jnp.float32
  # bf16 has an 8-bit mantissa: logits of order 1 agree with float32 to a few 1e-2.
  np.testing.assert_allclose(logits, forward(params, tokens), atol=0.1, rtol=0)


def test_causal_masking(tiny):
  _, _, params, tokens, forward = tiny
  t = 9
  changed = tokens.at[:, t].set((tokens[:, t] + 1) % V)
  a = np.asarray(forward(params, tokens))
  b = np.asarray(forward(params, changed))
  # Positions 0..t-1 cannot see token t; position t and later do.
  np.testing.assert_allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
  assert np.abs(a[:, t:] - b[:, t:]).max(axis=-1).min() > 1e-4


def test_initial_loss(tiny):
  _, _, params, tokens, forward = tiny
  logits = forward(params, tokens)
  loss, count = transformer.lm_loss(logits, jnp.roll(tokens, -1, axis=1))
  assert float(count) == 4 * L
  # The final RMSNorm gives sum_d x_d^2 = D, unembed entries have variance 1/D, so each logit is
  # ~N(0, 1) and independent of the target: CE ~= E[logsumexp] ~= log(V * E[e^z]) = log V + 1/2.
  assert abs(float(loss) - (math.log(V) + 0.5)) < 0.15

  # With a zero unembedding every logit is 0: the loss is exactly log V.
  zero = jax.tree_util.tree_map(lambda x: x, params)
  zero["unembed"]["kernel"] = jnp.zeros_like(params["unembed"]["kernel"])
  loss0, _ = transformer.lm_loss(forward(zero, tokens), tokens)
  np.testing.assert_allclose(float(loss0), math.log(V), rtol=1e-6)


def test_lm_loss_mask_hand_computed():
  # V = 2, one sequence of 3 positions:
  #   pos 0: logits [0, 0],        target 1 -> nll = log 2
  #   pos 1: logits [log 3, 0],    target 0 -> p = 3/4, nll = log(4/3)
  #   pos 2: logits [100, -100],   target 1 -> nll = 200 (masked out below)
  logits = jnp.array([[[0.0, 0.0], [math.log(3.0), 0.0], [100.0, -100.0]]])
  targets = jnp.array([[1, 0, 1]])
  loss, count = transformer.lm_loss(logits, targets, jnp.array([[1, 1, 0]]))
  assert float(count) == 2.0
  np.testing.assert_allclose(float(loss), (math.log(2) + math.log(4 / 3)) / 2, rtol=1e-6)

  loss_all, count_all = transformer.lm_loss(logits, targets)
  assert float(count_all) == 3.0
  np.testing.assert_allclose(float(loss_all), (math.log(2) + math.log(4 / 3) + 200) / 3, rtol=1e-5)

  loss_none, count_none = transformer.lm_loss(logits, targets, jnp.zeros((1, 3)))
  assert (float(loss_none), float(count_none)) == (0.0, 0.0)

  # A padded position with nan logits does not poison the loss.
  nan_logits = logits.at[0, 2].set(jnp.nan)
  loss_nan, _ = transformer.lm_loss(nan_logits, targets, jnp.array([[1, 1, 0]]))
  np.testing.assert_allclose(float(loss_nan), float(loss), rtol=1e-6)

  with pytest.raises(ValueError, match="do not match"):
    transformer.lm_loss(logits, targets[:, :2])


def test_param_names_and_logical_axes(tiny):
  _, boxed, params, _, _ = tiny
  assert set(params) == {"token_embed", "block_0", "block_1", "final_norm", "unembed"}
  flat = flatten(params)
  # Per block: 4 attention kernels, 3 MLP kernels, 2 norm scales; plus embed, final norm, unembed.
  assert len(flat) == 2 * 9 + 3
  expected_axes = {
    "token_embed/embedding": ("vocab", "embed"),
    "block_1/attn/query/kernel": ("embed", "heads", "kv"),
    "block_1/attn/key/kernel": ("embed", "heads", "kv"),
    "block_1/attn/value/kernel": ("embed", "heads", "kv"),
    "block_1/attn/out/kernel": ("heads", "kv", "embed"),
    "block_1/mlp/gate/kernel": ("embed", "mlp"),
    "block_1/mlp/up/kernel": ("embed", "mlp"),
    "block_1/mlp/down/kernel": ("mlp", "embed"),
    "block_1/pre_attn_norm/scale": ("embed",),
    "block_1/pre_mlp_norm/scale": ("embed",),
    "final_norm/scale": ("embed",),
    "unembed/kernel": ("embed", "vocab"),
  }
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
  names = flatten(jax.tree_util.tree_map(lambda b: b.names, boxed, is_leaf=is_box))
  # tree_map over boxes maps each box to its names tuple, whose items flatten to "<path>/<i>".
  by_path = {}
  for key, name in names.items():
    path, _, _ = key.rpartition("/")
    by_path.setdefault(path, []).append(name)
  for path, axes in expected_axes.items():
    assert tuple(by_path[path]) == axes, path
  assert flat["block_1/attn/query/kernel"].shape == (128, 4, 32)
  assert flat["block_1/attn/out/kernel"].shape == (4, 32, 128)
  assert flat["unembed/kernel"].shape == (128, V)


def test_tied_embeddings_have_no_unembed(tiny):
  _, _, params, tokens, forward = tiny
  model = _model(tie_embeddings=True)
  shapes = jax.eval_shape(lambda: _init(model)[1])
  assert set(shapes) == set(params) - {"unembed"}
  # tiny at 2 layers: 2 * 262,400 per block + 32,768 embedding + 128 final norm.
  assert configs.count_params(shapes) == 2 * 262_400 + 32_768 + 128
  tied = {k: v for k, v in params.items() if k != "unembed"}
  untied_like = {**tied, "unembed": {"kernel": params["token_embed"]["embedding"].T}}
  # Tying means exactly "unembed = embedding transposed".
  np.testing.assert_allclose(
    _apply(model, tied, tokens), forward(untied_like, tokens), atol=1e-5, rtol=0
  )


def test_is_embedding_path():
  assert transformer.is_embedding_path("token_embed/embedding")
  assert transformer.is_embedding_path("unembed/kernel")
  assert not transformer.is_embedding_path("block_3/attn/query/kernel")
  assert not transformer.is_embedding_path("final_norm/scale")
  assert not transformer.is_embedding_path("unembed_extra/kernel")  # component match, not prefix
  assert not transformer.is_embedding_path("block_0/token_embed/embedding")


def test_embedding_paths_of_a_model(tiny):
  _, _, params, _, _ = tiny
  embedding = [p for p in flatten(params) if transformer.is_embedding_path(p)]
  assert embedding == ["token_embed/embedding", "unembed/kernel"]


def test_dropout_and_remat(tiny):
  _, _, params, tokens, forward = tiny
  model = _model(dropout_rate=0.5)
  det = forward(params, tokens)
  drop = _apply(model, params, tokens, deterministic=False, rngs={"dropout": jax.random.key(3)})
  assert np.abs(np.asarray(det - drop)).max() > 1e-3
  remat = _model(dropout_rate=0.5, remat=True)

  def loss(p, m):
    return transformer.lm_loss(m.apply({"params": p}, tokens), tokens)[0]

  grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  value, g = grad_fn(params, model)
  value_remat, g_remat = grad_fn(params, remat)
  np.testing.assert_allclose(value_remat, value, atol=1e-6, rtol=0)
  np.testing.assert_allclose(value, transformer.lm_loss(det, tokens)[0], atol=1e-6, rtol=0)
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_remat)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_too_long_input_rejected(tiny):
  model, _, params, _, _ = tiny
  with pytest.raises(ValueError, match="exceeds max_len"):
    _apply(model, params, jnp.zeros((1, L + 1), jnp.int32))


def test_config_validation():
  base = dict(vocab_size=8, d_model=8, num_layers=1, num_heads=2, head_dim=4, mlp_dim=8, max_len=8)
  cfg = transformer.TransformerConfig(**base, dtype="bfloat16")
  assert cfg.dtype == jnp.bfloat16
  assert cfg == transformer.TransformerConfig(**base, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim must be even"):
    transformer.TransformerConfig(**{**base, "head_dim": 3})
  with pytest.raises(ValueError, match="num_layers must be a positive int"):
    transformer.TransformerConfig(**{**base, "num_layers": 0})
  with pytest.raises(ValueError, match="dropout_rate"):
    transformer.TransformerConfig(**base, dropout_rate=1.0)
  with pytest.raises(ValueError, match="floating dtype"):
    transformer.TransformerConfig(**base, dtype="int32")
  with pytest.raises(TypeError):
    transformer.TransformerConfig(8, 8, 1, 2, 4, 8, 8)  # keyword-only
  assert transformer.TransformerConfig(**base).num_kv_heads == 2  # Resolved: plain multi-head.
  assert cfg == transformer.TransformerConfig(**base, dtype="bfloat16", num_kv_heads=2)
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=2"):
    transformer.TransformerConfig(**base, num_kv_heads=3)
  with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
    transformer.TransformerConfig(**base, num_kv_heads=0)
  with pytest.raises(ValueError, match="rope_theta and norm_eps must be > 0"):
    transformer.TransformerConfig(**base, norm_eps=float("nan"))


def test_grouped_query_attention_is_multi_head_with_shared_key_value_heads():
  """A GQA model equals the multi-head model whose key/value heads are its own, repeated: query
  head j * R + r (R = H / G) reads key/value head j, as Hugging Face's `repeat_kv`."""
  gqa = _model(num_heads=4, num_kv_heads=2)
  mha = _model(num_heads=4)
  _, params = _init(gqa)
  assert params["block_0"]["attn"]["key"]["kernel"].shape == (128, 2, 32)
  repeated = jax.tree.map(lambda x: x, params)
  for i in range(2):
    attn = repeated[f"block_{i}"]["attn"]
    for name in ("key", "value"):
      attn[name]["kernel"] = jnp.repeat(attn[name]["kernel"], 2, axis=1)
  tokens = jax.random.randint(jax.random.key(2), (2, L), 0, V)
  np.testing.assert_allclose(
    _apply(gqa, params, tokens), _apply(mha, repeated, tokens), rtol=1e-5, atol=1e-5
  )
  # Tiling instead of repeating (head j serving queries j, j + G, ...) is another model.
  tiled = jax.tree.map(lambda x: x, params)
  for i in range(2):
    attn = tiled[f"block_{i}"]["attn"]
    for name in ("key", "value"):
      attn[name]["kernel"] = jnp.tile(attn[name]["kernel"], (1, 2, 1))
  assert np.abs(_apply(gqa, params, tokens) - _apply(mha, tiled, tokens)).max() > 1e-2


def test_sizes_param_counts():
  def count(size):
    model = transformer.Transformer(configs.transformer_config(size))
    shapes = jax.eval_shape(lambda: _init(model, seq_len=8)[1])
    return configs.count_params(shapes)

  # Per block: 4 d^2 (attention, heads * head_dim == d) + 3 d f (SwiGLU) + 2 d (norms);
  # plus 2 V d (untied embeddings) + d (final norm).
  def closed_form(d, n, f, v):
    return n * (4 * d * d + 3 * d * f + 2 * d) + 2 * v * d + d

  assert count("tiny") == closed_form(128, 4, 512, 256) == 1_115_264
  assert count("small") == closed_form(384, 6, 1536, 256) == 14_357_376
  assert 0.8e6 < count("tiny") < 1.5e6
  assert 10e6 <= count("small") <= 20e6


def test_transformer_config_overrides_and_errors():
  cfg = configs.transformer_config("small", vocab_size=512, max_len=64, remat=True)
  assert (cfg.vocab_size, cfg.max_len, cfg.remat, cfg.d_model) == (512, 64, True, 384)
  assert configs.transformer_config("2b").vocab_size == 32768
  assert configs.transformer_config("tiny").vocab_size == 256
  with pytest.raises(ValueError, match="Unknown model size"):
    configs.transformer_config("huge")
  with pytest.raises(ValueError, match="Unknown TransformerConfig fields"):
    configs.transformer_config("tiny", num_layer=3)


@pytest.mark.parametrize(
  "size,layers,vocab",
  [("tiny", 4, 256), ("small", 6, 256), ("2b", 18, 32768), ("5b", 32, 32768), ("9b", 42, 32768)],
)
def test_gin_model_files(size, layers, vocab):
  from ddiloco.launch import configurables

  try:
    configurables.parse(
      [str(REPO / "gin_configs" / "models" / f"{size}.gin")], ["transformer_config.max_len = 32"]
    )
    cfg = configurables.configured("ddiloco.transformer_config")()
  finally:
    configurables.clear()
  assert cfg == configs.transformer_config(
    size, max_len=32, **({} if size in ("tiny", "small") else {"dtype": "bfloat16", "remat": True})
  )
  assert (cfg.num_layers, cfg.vocab_size) == (layers, vocab)
