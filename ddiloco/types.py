"""Shared type aliases and logical axis names.

Parameters travel between learners and the syncer as *flat* dicts keyed by the leaf path
("block_0/attn/query/kernel"), so that the syncer, the fragment layout and the transports never need
the model's pytree structure (docs/architecture.md "Layers").
"""

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
