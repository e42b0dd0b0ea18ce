"""`Task`: what a run trains — a model, its loss, its data and its evaluation set.

The learner step (`ddiloco.learner.train_step`), the learner factory (`ddiloco.learner.factory`),
the simulator and the distributed `JobConfig` only talk to a `Task`, so a dense language model, a
mixture of experts and a vision transformer go through the same learners, fragments, compression,
RDA merge and syncer unchanged (docs/architecture.md "Layers": a task knows nothing of
fragments, syncers or clocks).

Contract:
- A batch is a dict of host arrays with at least "inputs" and "targets". The number of elements of
  "targets" is the batch's count of merge units (docs/algorithm.md §4.4's "tokens": target tokens for text,
  examples for classification); `units_in_batch` computes it, and the learner and the simulator
  count a batch the same way.
- `loss(params, batch, train=...)` is traced inside the jitted steps. It returns (loss, count, aux):
  the objective to minimise when `train` (or the held-out metric when not: an MoE's auxiliary
  losses are left out of its eval loss), the count as a float32 scalar, and extra float32 scalar
  metrics, each a mean over the batch's units, so that means over several batches are
  count-weighted.
- `mean_merged(path)` names the flat parameter paths the syncer merges with the weighted mean
  instead of RDA (docs/algorithm.md §4.5).
"""

import abc
import math
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax

from ddiloco.types import PyTree

Batch = dict[str, Any]
LossOutput = tuple[jax.Array, jax.Array, dict[str, jax.Array]]
# Train-step metric names that a task's aux metrics must not reuse.
RESERVED_METRICS = ("loss", "tokens", "grad_norm")


class Task(abc.ABC):
  """Model + loss + data + eval of one run (see the module docstring for the contract).

  Attributes:
    model: the flax module; `model.init(rng, dummy)` with `dummy` shaped as `dummy_inputs()`.
    unit: what `units_in_batch` counts ("tokens", "examples"), for logs and docs.
  """

  model: nn.Module
  unit: str

  @property
  @abc.abstractmethod
  def batch_size(self) -> int:
    """Default per-learner batch size (a learner's `batch_size` override replaces it)."""

  @abc.abstractmethod
  def dummy_inputs(self, batch_size: int = 1) -> jax.ShapeDtypeStruct:
    """Shape and dtype of a model input batch, to trace `init` (`partitioning.init_params`)."""

  @abc.abstractmethod
  def loss(self, params: PyTree, batch: Mapping[str, Any], *, train: bool = True) -> LossOutput:
    """(loss, count, aux metrics) of `params` on `batch`; traced under jit."""

  @abc.abstractmethod
  def make_train_iterator(
    self, *, shard_index: int, num_shards: int, batch_size: int | None = None
  ) -> Iterator[Batch]:
    """An endless, checkpointable (get_state/set_state) iterator over one learner's shard."""

  @abc.abstractmethod
  def eval_batches(self, num_batches: int, *, batch_size: int | None = None) -> list[Batch]:
    """Fixed held-out batches, identical in every process of a run."""

  @abc.abstractmethod
  def mean_merged(self, path: str) -> bool:
    """Whether the syncer merges this flat parameter path with the weighted mean (docs/algorithm.md §4.5)."""

  @abc.abstractmethod
  def units_per_step(self, batch_size: int | None = None) -> int:
    """Merge units in one nominal step of `batch_size` (default `self.batch_size`) examples."""

  def units_in_batch(self, batch: Mapping[str, Any]) -> int:
    """Merge units in a host batch: the number of elements of its "targets"."""
    return math.prod(batch["targets"].shape)
