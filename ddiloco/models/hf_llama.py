"""Hugging Face Llama checkpoints in and out: config.json + safetensors <-> `Transformer` params.

ddiloco's dense `Transformer` is a Llama: pre-norm RMSNorm blocks, SwiGLU, RoPE, no biases, an
optional tied output projection and grouped-query attention (`num_kv_heads`). This module maps its
parameters to the names and layouts of Hugging Face's `LlamaForCausalLM` and back, on numpy arrays
(no torch). D = width, H query heads, G key/value heads, K head width, F MLP width, V vocabulary:

  ddiloco leaf [shape]                    Hugging Face tensor [shape]
  token_embed/embedding [V, D]            model.embed_tokens.weight [V, D]
  block_i/pre_attn_norm/scale [D]         model.layers.i.input_layernorm.weight [D]
  block_i/attn/query/kernel [D, H, K]     model.layers.i.self_attn.q_proj.weight [H*K, D]
  block_i/attn/key/kernel [D, G, K]       model.layers.i.self_attn.k_proj.weight [G*K, D]
  block_i/attn/value/kernel [D, G, K]     model.layers.i.self_attn.v_proj.weight [G*K, D]
  block_i/attn/out/kernel [H, K, D]       model.layers.i.self_attn.o_proj.weight [D, H*K]
  block_i/pre_mlp_norm/scale [D]          model.layers.i.post_attention_layernorm.weight [D]
  block_i/mlp/gate/kernel [D, F]          model.layers.i.mlp.gate_proj.weight [F, D]
  block_i/mlp/up/kernel [D, F]            model.layers.i.mlp.up_proj.weight [F, D]
  block_i/mlp/down/kernel [F, D]          model.layers.i.mlp.down_proj.weight [D, F]
  final_norm/scale [D]                    model.norm.weight [D]
  unembed/kernel [D, V]                   lm_head.weight [V, D] (absent when tied)

A kernel's input axes are flattened and the matrix transposed (torch's `Linear` stores [out, in]);
head h's features are rows [h*K, (h+1)*K) of a projection, as Hugging Face views them.

RoPE. ddiloco rotates feature j of a head with feature j + K/2 (the split-half convention), at
frequency theta^(-2j/K): Hugging Face's `rotate_half` exactly. Meta's original checkpoints pair
features (2j, 2j+1) instead, which is why Hugging Face's conversion script permutes the rows of
q_proj and k_proj; between ddiloco and Hugging Face no permutation is needed, and none is made.
tests/models/hf_llama_test.py checks it against logits that `transformers` computed.

config.json. Written with both spellings of the RoPE base (`rope_theta`, read by transformers 4,
and `rope_parameters`, by 5). Read: `model_type` "llama" (or the `LlamaForCausalLM`
architecture), `hidden_act` "silu", no attention or MLP biases and the default RoPE (no
`rope_scaling`); anything else is refused with the reason, since the weights would load into a
model that computes something else. `max_position_embeddings` becomes `max_len`.

Files: `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json` above `max_shard_bytes`, as `save_pretrained` writes them.
"""

import json
import math
import os
from collections.abc import Collection, Mapping
from typing import Any

import ml_dtypes  # noqa: F401  (registers "bfloat16" with np.dtype)
import numpy as np

from ddiloco.models.transformer import TransformerConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default shard size.
# Fields a checkpoint fixes: an override of one would no longer describe the weights.
ARCHITECTURE_FIELDS = (
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "mlp_dim",
  "rope_theta",
  "norm_eps",
  "tie_embeddings",
  "causal",
  "rope",
  "num_experts",
)
# Buffers that some checkpoints carry and that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _safetensors() -> Any:
  try:
    import safetensors
    import safetensors.numpy
  except ImportError as e:
    raise ImportError(
      "Hugging Face checkpoints need safetensors: pip install 'ddiloco[hf]'."
    ) from e
  return safetensors


def param_map(config: TransformerConfig) -> list[tuple[str, str, int | None]]:
  """(ddiloco leaf path, Hugging Face name, input axes) of every parameter, in model order.

  Input axes: how many leading axes of the ddiloco kernel are its input (flattened, then the matrix
  is transposed); None for a tensor with the same layout on both sides.
  """
  rows: list[tuple[str, str, int | None]] = [
    ("token_embed/embedding", "model.embed_tokens.weight", None)
  ]
  for i in range(config.num_layers):
    ours, theirs = f"block_{i}", f"model.layers.{i}"
    rows += [
      (f"{ours}/pre_attn_norm/scale", f"{theirs}.input_layernorm.weight", None),
      (f"{ours}/attn/query/kernel", f"{theirs}.self_attn.q_proj.weight", 1),
      (f"{ours}/attn/key/kernel", f"{theirs}.self_attn.k_proj.weight", 1),
      (f"{ours}/attn/value/kernel", f"{theirs}.self_attn.v_proj.weight", 1),
      (f"{ours}/attn/out/kernel", f"{theirs}.self_attn.o_proj.weight", 2),
      (f"{ours}/pre_mlp_norm/scale", f"{theirs}.post_attention_layernorm.weight", None),
      (f"{ours}/mlp/gate/kernel", f"{theirs}.mlp.gate_proj.weight", 1),
      (f"{ours}/mlp/up/kernel", f"{theirs}.mlp.up_proj.weight", 1),
      (f"{ours}/mlp/down/kernel", f"{theirs}.mlp.down_proj.weight", 1),
    ]
  rows.append(("final_norm/scale", "model.norm.weight", None))
  if not config.tie_embeddings:
    rows.append(("unembed/kernel", "lm_head.weight", 1))
  return rows


def param_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """{ddiloco leaf path: shape} of a dense `Transformer` with this config."""
  d, h, g, k, f, v = (
    config.d_model,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
    config.mlp_dim,
    config.vocab_size,
  )
  shapes = {"token_embed/embedding": (v, d), "final_norm/scale": (d,)}
  for i in range(config.num_layers):
    b = f"block_{i}"
    shapes.update(
      {
        f"{b}/pre_attn_norm/scale": (d,),
        f"{b}/attn/query/kernel": (d, h, k),
        f"{b}/attn/key/kernel": (d, g, k),
        f"{b}/attn/value/kernel": (d, g, k),
        f"{b}/attn/out/kernel": (h, k, d),
        f"{b}/pre_mlp_norm/scale": (d,),
        f"{b}/mlp/gate/kernel": (d, f),
        f"{b}/mlp/up/kernel": (d, f),
        f"{b}/mlp/down/kernel": (f, d),
      }
    )
  if not config.tie_embeddings:
    shapes["unembed/kernel"] = (d, v)
  return shapes


def check_exportable(config: TransformerConfig) -> None:
  """Raises ValueError unless the config is a Llama: a dense, causal decoder with RoPE."""
  if config.num_experts:
    raise ValueError(
      "A mixture of experts has no Llama counterpart in Hugging Face format; export it as orbax."
    )
  if not config.causal or not config.rope:
    raise ValueError("Only a causal decoder with RoPE (causal=True, rope=True) is a Llama.")


def check_params(params: Mapping[str, Any], config: TransformerConfig) -> None:
  """Raises ValueError unless flat `params` are a Llama of this config (`to_hf` would take them)."""
  check_exportable(config)
  _check_leaves(params, param_shapes(config))


def to_hf(params: Mapping[str, np.ndarray], config: TransformerConfig) -> dict[str, np.ndarray]:
  """Hugging Face's tensors {name: array} of flat ddiloco params {leaf path: array}.

  Raises:
    ValueError: if the config is no Llama (`check_exportable`), or `params` lacks a leaf, has one
      the model does not, or one of another shape.
  """
  check_params(params, config)
  out = {}
  for ours, theirs, inputs in param_map(config):
    value = np.asarray(params[ours])
    if inputs is not None:
      value = value.reshape(math.prod(value.shape[:inputs]), -1).T
    out[theirs] = np.ascontiguousarray(value)
  return out


def from_hf(tensors: Mapping[str, np.ndarray], config: TransformerConfig) -> dict[str, np.ndarray]:
  """Flat ddiloco params {leaf path: array} of Hugging Face tensors (as stored: no cast).

  Raises:
    ValueError: for a missing tensor, an unknown one, or one whose shape does not fit `config`.
  """
  check_exportable(config)
  shapes = param_shapes(config)
  rows = param_map(config)
  known = {theirs for _, theirs, _ in rows}
  if config.tie_embeddings:
    known.add("lm_head.weight")  # Some tied checkpoints store the copy; it is the embedding.
  missing = sorted(theirs for _, theirs, _ in rows if theirs not in tensors)
  extra = sorted(n for n in tensors if n not in known and not n.endswith(_IGNORED_SUFFIXES))
  if missing or extra:
    raise ValueError(
      f"The checkpoint's tensors do not fit the model of its config.json: missing {missing[:4]}"
      f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}."
    )
  return _convert_rows(tensors, rows, shapes)


def _check_leaves(params: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
  missing = sorted(set(shapes) - set(params))
  extra = sorted(set(params) - set(shapes))
  wrong = [
    f"{k} {tuple(params[k].shape)} != {s}"
    for k, s in shapes.items()
    if k in params and tuple(params[k].shape) != s
  ]
  if missing or extra or wrong:
    raise ValueError(
      f"The parameters do not fit the model's config: missing {missing[:4]}, unexpected "
      f"{extra[:4]}, wrong shapes {wrong[:4]}."
    )


def to_hf_config(config: TransformerConfig, *, dtype: Any = np.float32) -> dict[str, Any]:
  """config.json of a `LlamaForCausalLM` with this shape; `dtype` is the stored weights' dtype."""
  check_exportable(config)
  return {
    "architectures": [ARCHITECTURE],
    "model_type": "llama",
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.mlp_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": config.max_len,
    "rms_norm_eps": config.norm_eps,
    "rope_theta": config.rope_theta,
    "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
    "rope_scaling": None,
    "tie_word_embeddings": config.tie_embeddings,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "torch_dtype": np.dtype(dtype).name,
  }


def from_hf_config(hf: Mapping[str, Any], **overrides: Any) -> TransformerConfig:
  """The `TransformerConfig` of a Hugging Face Llama config.json (a dict).

  Args:
    hf: the parsed config.json.
    **overrides: `TransformerConfig` fields the checkpoint does not fix, e.g. `dtype="bfloat16"`,
      `remat=True`, `max_len=256` (not `ARCHITECTURE_FIELDS`).

  Raises:
    ValueError: for another architecture, a feature ddiloco's model lacks (biases, another
      activation, RoPE scaling), a missing field, or an override of an architecture field.
  """
  model_type, archs = hf.get("model_type"), hf.get("architectures") or []
  if model_type != "llama" and ARCHITECTURE not in archs:
    raise ValueError(
      f"config.json describes model_type {model_type!r} {archs}: only Llama-architecture "
      f"checkpoints (model_type 'llama', {ARCHITECTURE}) can be read."
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported: the MLP is SwiGLU (silu).")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ValueError("attention_bias and mlp_bias are not supported: the model has no biases.")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"RoPE type {rope_type!r} is not supported, only the default (no scaling).")
  bad = sorted(set(overrides) & set(ARCHITECTURE_FIELDS))
  if bad:
    raise ValueError(f"{bad} are fixed by the checkpoint's config.json and cannot be overridden.")
  try:
    heads = int(hf["num_attention_heads"])
    fields = dict(
      vocab_size=int(hf["vocab_size"]),
      d_model=int(hf["hidden_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
      mlp_dim=int(hf["intermediate_size"]),
      max_len=int(hf.get("max_position_embeddings", 2048)),
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
  except KeyError as e:
    raise ValueError(f"config.json lacks {e.args[0]!r}.") from None
  fields.update(overrides)
  return TransformerConfig(**fields)


def read_config(path: str, **overrides: Any) -> TransformerConfig:
  """The `TransformerConfig` of the checkpoint in folder `path` (its config.json; see
  `from_hf_config` for `overrides` and errors).

  Raises:
    FileNotFoundError: if `path` has no config.json.
  """
  file = os.path.join(path, CONFIG_NAME)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} holds no {CONFIG_NAME}: not a Hugging Face checkpoint folder.")
  with open(file) as f:
    return from_hf_config(json.load(f), **overrides)


def check_same_architecture(config: TransformerConfig, checkpoint: str) -> None:
  """Raises ValueError unless `config` is the model of the checkpoint in folder `checkpoint`.

  The fields of `ARCHITECTURE_FIELDS` must equal its config.json's: a different RoPE base or norm
  epsilon would load the weights into a model that computes something else, with no shape to
  tell.

  Raises:
    FileNotFoundError: as `read_config`.
  """
  check_exportable(config)
  theirs = read_config(checkpoint)
  wrong = {
    name: (getattr(config, name), getattr(theirs, name))
    for name in ARCHITECTURE_FIELDS
    if getattr(config, name) != getattr(theirs, name)
  }
  if wrong:
    listed = ", ".join(f"{k} {ours} (config.json: {its})" for k, (ours, its) in wrong.items())
    raise ValueError(
      f"The run's model is not the one of {checkpoint}: {listed}. Leave the model to the "
      "checkpoint's config.json (only dtype, param_dtype, remat, max_len and dropout are free)."
    )


def save(
  params: Mapping[str, np.ndarray],
  config: TransformerConfig,
  directory: str,
  *,
  max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
  """Writes flat ddiloco params as a Hugging Face checkpoint folder; returns the files written.

  The tensors keep the params' dtype (config.json's `torch_dtype` says which). Above
  `max_shard_bytes` in all, they are split over shards in model order, with an index.

  Raises:
    ValueError: as `to_hf`, or for params of mixed dtypes.
  """
  safetensors = _safetensors()
  tensors = to_hf(params, config)
  dtypes = {a.dtype for a in tensors.values()}
  if len(dtypes) != 1:
    raise ValueError(f"The parameters mix dtypes {sorted(map(str, dtypes))}; convert them first.")
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_NAME), "w") as f:
    json.dump(to_hf_config(config, dtype=dtypes.pop()), f, indent=2)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, value in tensors.items():
    if shards[-1] and size + value.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = value
    size += value.nbytes
  meta = {"format": "pt"}  # transformers refuses a file without it.
  if len(shards) == 1:
    safetensors.numpy.save_file(shards[0], os.path.join(directory, WEIGHTS_NAME), metadata=meta)
    return [CONFIG_NAME, WEIGHTS_NAME]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    safetensors.numpy.save_file(shard, os.path.join(directory, name), metadata=meta)
    weight_map.update(dict.fromkeys(shard, name))
  index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}}
  index["weight_map"] = weight_map
  with open(os.path.join(directory, INDEX_NAME), "w") as f:
    json.dump(index, f, indent=2)
  return [CONFIG_NAME, *names, INDEX_NAME]


def _weight_files(directory: str) -> dict[str, str]:
  """{tensor name: file} of a checkpoint folder, single-file or sharded."""
  index = os.path.join(directory, INDEX_NAME)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  single = os.path.join(directory, WEIGHTS_NAME)
  if not os.path.isfile(single):
    raise FileNotFoundError(
      f"{directory} holds neither {WEIGHTS_NAME} nor {INDEX_NAME} (PyTorch .bin checkpoints are "
      "not read: convert them to safetensors)."
    )
  safetensors = _safetensors()
  with safetensors.safe_open(single, "numpy") as f:
    return dict.fromkeys(f.keys(), single)


def load(
  directory: str,
  config: TransformerConfig | None = None,
  *,
  leaves: Collection[str] | None = None,
  dtype: Any = None,
) -> dict[str, np.ndarray]:
  """Flat ddiloco params {leaf path: array} of a Hugging Face Llama checkpoint folder.

  Args:
    directory: the folder (config.json and safetensors).
    config: the model it is read into (default: its config.json's, `read_config`).
    leaves: only these leaf paths (a syncer shard's own); only their tensors are read.
    dtype: cast every array to it (e.g. the model's param dtype); None keeps the stored dtype.

  Raises:
    FileNotFoundError: for a folder without config.json or weights.
    ValueError: as `from_hf`, or for an unknown leaf in `leaves`.
  """
  safetensors = _safetensors()
  config = config or read_config(directory)
  files = _weight_files(directory)
  rows = param_map(config)
  wanted = {ours for ours, _, _ in rows} if leaves is None else set(leaves)
  unknown = sorted(wanted - {ours for ours, _, _ in rows})
  if unknown:
    raise ValueError(f"The model has no leaves {unknown[:4]}.")
  missing = sorted(theirs for ours, theirs, _ in rows if ours in wanted and theirs not in files)
  if missing:
    raise ValueError(f"{directory} lacks the tensors {missing[:4]}.")
  needed = {theirs for ours, theirs, _ in rows if ours in wanted}
  if leaves is None:
    needed = set(files)  # Everything: unexpected tensors are refused by `from_hf`.
  tensors = {}
  for file in sorted({files[n] for n in needed}):
    with safetensors.safe_open(file, "numpy") as f:
      for name in sorted(n for n in needed if files[n] == file):
        tensors[name] = f.get_tensor(name)
  if leaves is None:
    out = from_hf(tensors, config)
  else:  # `from_hf` wants every tensor: convert the selected rows alone.
    subset = [(o, t, i) for o, t, i in rows if o in wanted]
    out = _convert_rows(tensors, subset, param_shapes(config))
  if dtype is not None:
    out = {k: v.astype(dtype, copy=False) for k, v in out.items()}
  return out


def _convert_rows(
  tensors: Mapping[str, np.ndarray],
  rows: list[tuple[str, str, int | None]],
  shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, np.ndarray]:
  out = {}
  for ours, theirs, inputs in rows:
    value, shape = np.asarray(tensors[theirs]), shapes[ours]
    expected = shape if inputs is None else (math.prod(shape[inputs:]), math.prod(shape[:inputs]))
    if value.shape != expected:
      raise ValueError(f"{theirs} has shape {value.shape}; its config.json implies {expected}.")
    out[ours] = np.ascontiguousarray(value if inputs is None else value.T.reshape(shape))
  return out
