"""Shared type aliases and logical axis names.

Parameters travel between learners and the syncer as *flat* dicts keyed by the leaf path
("block_0/attn/query/kernel"), so that the syncer, the fragment layout and the transports never need
the model's pytree structure (docs/architecture.md "Layers").
"""

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

PyTree = Any
Params = PyTree  # A (nested) pytree of arrays, as produced by a flax model's init.
FlatParams = Mapping[str, np.ndarray]  # Leaf path -> array.
FragmentId = int
LearnerId = int
Version = int

# Logical axis names used by the models' annotations (t5x style); parallel/ maps them to mesh axes.
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
KV = "kv"
MLP = "mlp"
VOCAB = "vocab"
EXPERT = "expert"
LAYERS = "layers"

# Mesh axis names of one learner's mesh.
DATA_AXIS = "data"
MODEL_AXIS = "model"


def check_int_fields(config: Any) -> None:
  """Refuses a dataclass config whose `int` fields hold anything but an integer (numpy's count),
  naming the field: a gin typo such as 4.5 fails at construction, not mid-run.

  Raises:
    ValueError: naming the first such field.
  """
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.type in (int, "int") and not isinstance(value, numbers.Integral):
      raise ValueError(f"{field.name} must be an integer, got {value!r}.")
