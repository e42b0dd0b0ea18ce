"""The learner's inner step: a pure, jitted, sharded AdamW update (SPEC §3).

The step is compiled once with pinned input and output shardings (parameters, optimizer state, batch),
so later steps never recompile (a test asserts the jit cache holds one entry after several steps).
It knows nothing about fragments, syncers or clocks (ARCHITECTURE.md "dependency rule").
"""

import dataclasses
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddiloco.models import transformer
from ddiloco.parallel import partitioning
from ddiloco.types import PyTree


@gin.configurable(module="ddiloco")
@dataclasses.dataclass(frozen=True)
class InnerOptConfig:
  """Inner AdamW with linear warm-up and cosine decay (DiLoCo's inner optimizer).

  Attributes:
    peak_lr: learning rate after warm-up.
    warmup_steps: linear warm-up length.
    decay_steps: length of the cosine decay (including warm-up); the schedule stays at
      `peak_lr * final_lr_ratio` afterwards.
    final_lr_ratio: end of the cosine as a fraction of `peak_lr`.
    b1, b2, eps: Adam moments.
    weight_decay: decoupled weight decay, applied to tensors of rank >= 2 only (not norms).
    grad_clip_norm: global-norm gradient clipping; 0 disables it.
  """

  peak_lr: float = 3e-3
  warmup_steps: int = 20
  decay_steps: int = 1000
  final_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip_norm: float = 1.0

  def __post_init__(self):
    if self.peak_lr <= 0:
      raise ValueError(f"peak_lr must be > 0, got {self.peak_lr}.")
    if self.warmup_steps < 0 or self.decay_steps < 1:
      raise ValueError("warmup_steps must be >= 0 and decay_steps >= 1.")
    if self.warmup_steps >= self.decay_steps:
      raise ValueError(
        f"warmup_steps ({self.warmup_steps}) must be < decay_steps ({self.decay_steps})."
      )
    if not 0 <= self.final_lr_ratio <= 1:
      raise ValueError(f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}.")


def make_inner_optimizer(config: InnerOptConfig) -> optax.GradientTransformation:
  """Returns clip -> AdamW(warm-up + cosine), weight decay masked to rank >= 2 tensors."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.peak_lr,
    warmup_steps=config.warmup_steps,
    decay_steps=config.decay_steps,
    end_value=config.peak_lr * config.final_lr_ratio,
  )
  adamw = optax.adamw(
    schedule,
    b1=config.b1,
    b2=config.b2,
    eps=config.eps,
    weight_decay=config.weight_decay,
    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
  )
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)
  return adamw


def loss_fn(
  model: nn.Module, params: PyTree, batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """Mean next-token loss of `model` on `batch` and the number of target tokens."""
  logits_BxLxV = model.apply({"params": params}, batch["inputs"])
  return transformer.lm_loss(logits_BxLxV, batch["targets"], batch.get("mask"))


class CompiledSteps:
  """A model's jitted train and eval steps on one mesh, with pinned shardings.

  Optimizer-state shardings follow the parameters' through `optax.tree_map_params`; non-parameter
  leaves (step counts) are replicated. Without pinning both sides, the second call recompiles.

  Attributes:
    init_opt_state: params -> opt_state, created directly with its shardings.
    param_shardings, opt_shardings, batch_sharding: what the steps are pinned to.
  """

  def __init__(
    self,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    abstract_params: PyTree,
    param_shardings: PyTree,
  ):
    replicated = NamedSharding(mesh, PartitionSpec())
    self.mesh = mesh
    self.param_shardings = param_shardings
    self.batch_sharding = partitioning.batch_sharding(mesh)
    abstract_state = jax.eval_shape(optimizer.init, abstract_params)
    self.opt_shardings = optax.tree_map_params(
      optimizer,
      lambda _, sharding: sharding,
      abstract_state,
      param_shardings,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, NamedSharding),
    )

    def train(params, opt_state, batch):
      (loss, num_tokens), grads = jax.value_and_grad(
        lambda p: loss_fn(model, p, batch), has_aux=True
      )(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics = {"loss": loss, "tokens": num_tokens, "grad_norm": optax.global_norm(grads)}
      return params, opt_state, metrics

    def evaluate(params, batch):
      loss, num_tokens = loss_fn(model, params, batch)
      return loss * num_tokens, num_tokens

    self._train = jax.jit(
      train,
      in_shardings=(param_shardings, self.opt_shardings, self.batch_sharding),
      out_shardings=(param_shardings, self.opt_shardings, replicated),
      donate_argnums=(0, 1),
    )
    self._evaluate = jax.jit(
      evaluate,
      in_shardings=(param_shardings, self.batch_sharding),
      out_shardings=replicated,
    )
    self.init_opt_state = jax.jit(optimizer.init, out_shardings=self.opt_shardings)

  # The model's activation constraints take effect only when traced under the mesh and the logical
  # rules (flax linen + jax.set_mesh), so every call enters that context.
  def train(self, params: PyTree, opt_state: PyTree, batch: dict[str, jax.Array]):
    """One inner step; `params` and `opt_state` are donated."""
    with partitioning.partitioning_context(self.mesh):
      return self._train(params, opt_state, batch)

  def evaluate(self, params: PyTree, batch: dict[str, jax.Array]):
    """(sum of token losses, number of tokens) of `params` on `batch`."""
    with partitioning.partitioning_context(self.mesh):
      return self._evaluate(params, batch)

  def train_cache_size(self) -> int:
    """Compiled variants of the train step: stays 1 after any number of steps when pinned."""
    return self._train._cache_size()

  def put_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """Places a host batch on the mesh with the pinned batch sharding."""
    return jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, self.batch_sharding)


def eval_loss(steps: CompiledSteps, params: PyTree, batches: list[dict[str, Any]]) -> float:
  """Token-weighted mean loss of `params` over `batches`."""
  total, count = 0.0, 0.0
  for batch in batches:
    s, n = steps.evaluate(params, steps.put_batch(batch))
    total += float(s)
    count += float(n)
  return total / max(count, 1.0)
