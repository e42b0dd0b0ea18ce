"""The learner's inner step: a pure, jitted, sharded AdamW update (docs/algorithm.md §3).

The step is compiled once with pinned input and output shardings (parameters, optimizer state, batch),
so later steps never recompile (a test asserts the jit cache holds one entry after several steps).
It knows nothing about fragments, syncers or clocks (docs/architecture.md "Layers"), and nothing
about what is trained: the loss comes from a `ddiloco.tasks.Task` (a bare language-model module is
still accepted and trained with `loss_fn`, the text task's loss).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddiloco.models import transformer
from ddiloco.parallel import partitioning
from ddiloco.tasks.base import RESERVED_METRICS, LossOutput, Task
from ddiloco.types import PyTree


@dataclasses.dataclass(frozen=True)
class InnerOptConfig:
  """The inner optimizer: AdamW with linear warm-up and cosine decay by default (DiLoCo's).

  Attributes:
    optimizer: builds the optimizer from the learning-rate schedule, as
      `optimizer(learning_rate=schedule)`: any optax transformation (e.g. `optax.sgd`, bound in gin
      as `@optax.sgd`). None: AdamW with `b1`, `b2`, `eps` and `weight_decay` below.
    peak_lr: learning rate after warm-up.
    warmup_steps: linear warm-up length.
    decay_steps: length of the cosine decay (including warm-up); the schedule stays at
      `peak_lr * final_lr_ratio` afterwards.
    final_lr_ratio: end of the cosine as a fraction of `peak_lr`.
    b1, b2, eps: Adam moments.
    weight_decay: decoupled weight decay, applied to tensors of rank >= 2 only (not norms).
    grad_clip_norm: global-norm gradient clipping; 0 disables it.
  """

  optimizer: Callable[..., optax.GradientTransformation] | None = None
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
    # `not x > 0` (not `x <= 0`) so NaN is refused too: it would train to NaN without a word.
    if not (self.peak_lr > 0 and math.isfinite(self.peak_lr)):
      raise ValueError(f"peak_lr must be finite and > 0, got {self.peak_lr}.")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
    if not (self.eps > 0 and math.isfinite(self.eps)):
      raise ValueError(f"eps must be finite and > 0, got {self.eps}.")
    for name in ("weight_decay", "grad_clip_norm"):
      value = getattr(self, name)
      if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}.")
    if self.warmup_steps < 0 or self.decay_steps < 1:
      raise ValueError("warmup_steps must be >= 0 and decay_steps >= 1.")
    if self.warmup_steps >= self.decay_steps:
      raise ValueError(
        f"warmup_steps ({self.warmup_steps}) must be < decay_steps ({self.decay_steps})."
      )
    if not 0 <= self.final_lr_ratio <= 1:
      raise ValueError(f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}.")


def make_inner_optimizer(config: InnerOptConfig) -> optax.GradientTransformation:
  """Returns clip -> the optimizer on the warm-up + cosine schedule.

  The default is AdamW with weight decay masked to rank >= 2 tensors; `config.optimizer` replaces it.

  Raises:
    TypeError: if `config.optimizer` does not return an optax transformation.
  """
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.peak_lr,
    warmup_steps=config.warmup_steps,
    decay_steps=config.decay_steps,
    end_value=config.peak_lr * config.final_lr_ratio,
  )
  if config.optimizer is None:
    opt = optax.adamw(
      schedule,
      b1=config.b1,
      b2=config.b2,
      eps=config.eps,
      weight_decay=config.weight_decay,
      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
  else:
    opt = config.optimizer(learning_rate=schedule)
    if not isinstance(opt, optax.GradientTransformation):
      raise TypeError(
        f"InnerOptConfig.optimizer returned {type(opt).__name__}, not an optax transformation."
      )
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), opt)
  return opt


def schedule_at_least(opt_state: Any, step: int) -> Any:
  """`opt_state` with every learning-rate schedule's step count raised to at least `step`.

  A learner that joins (or rejoins) a running fleet continues the fleet's schedule instead of
  starting its warm-up again; the moments (and Adam's bias-correction count) stay its own.
  Counts keep their dtype and sharding.
  """

  def raise_count(state):
    if not isinstance(state, optax.ScaleByScheduleState):
      return state
    count = state.count
    new = jnp.maximum(count, jnp.asarray(step, count.dtype))
    sharding = getattr(count, "sharding", None)
    return optax.ScaleByScheduleState(
      count=jax.device_put(new, sharding) if sharding is not None else new
    )

  return jax.tree.map(
    raise_count, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
  )


def loss_fn(
  model: nn.Module, params: PyTree, batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """Mean next-token loss of a dense language `model` on `batch` and the number of target tokens."""
  logits_BxLxV = model.apply({"params": params}, batch["inputs"])
  return transformer.lm_loss(logits_BxLxV, batch["targets"], batch.get("mask"))


def _task_loss(task: Task | nn.Module):
  """The (params, batch, train) -> (loss, count, aux) function of a task or a bare LM module."""
  if isinstance(task, Task):
    return lambda params, batch, train: task.loss(params, batch, train=train)

  def module_loss(params: PyTree, batch: dict[str, jax.Array], train: bool) -> LossOutput:
    del train
    loss, count = loss_fn(task, params, batch)
    return loss, count, {}

  return module_loss


def _check_aux(aux: dict[str, jax.Array]) -> None:
  clash = sorted(set(aux) & set(RESERVED_METRICS))
  if clash:
    raise ValueError(f"Task aux metrics {clash} clash with the train step's {RESERVED_METRICS}.")


class CompiledSteps:
  """A task's jitted train and eval steps on one mesh, with pinned shardings.

  Optimizer-state shardings follow the parameters' through `optax.tree_map_params`; non-parameter
  leaves (step counts) are replicated. Without pinning both sides, the second call recompiles.

  The train step's metrics are {"loss": the objective, "tokens": the batch's count of merge units
  (target tokens or examples; the name is kept because it feeds token-weighted merging, docs/algorithm.md
  §4.4), "grad_norm", **the task's aux metrics}.

  Args:
    task: a `ddiloco.tasks.Task`, or a bare language-model module (trained with `loss_fn`).
    optimizer: the inner optimizer.
    mesh: the learner's mesh.
    abstract_params: the params' shapes and dtypes.
    param_shardings: the params' shardings (same structure).
    rules: logical axis rules the model's activation constraints are traced with.

  Attributes:
    init_opt_state: params -> opt_state, created directly with its shardings.
    param_shardings, opt_shardings, batch_sharding: what the steps are pinned to.
  """

  def __init__(
    self,
    task: Task | nn.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    abstract_params: PyTree,
    param_shardings: PyTree,
    *,
    rules: partitioning.LogicalRules = partitioning.LOGICAL_AXIS_RULES,
  ):
    replicated = NamedSharding(mesh, PartitionSpec())
    task_loss = _task_loss(task)
    self.mesh = mesh
    self.rules = rules
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

    def objective(p, batch):
      loss, count, aux = task_loss(p, batch, True)
      return loss, (count, aux)

    def train(params, opt_state, batch):
      (loss, (count, aux)), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
      _check_aux(aux)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics = {"loss": loss, "tokens": count, "grad_norm": optax.global_norm(grads), **aux}
      return params, opt_state, metrics

    def evaluate(params, batch):
      # Sums over the batch's units (loss and each aux mean times the count), so several batches
      # combine into count-weighted means (`eval_metrics`).
      loss, count, aux = task_loss(params, batch, False)
      _check_aux(aux)
      sums = {"loss": loss * count, **{k: v * count for k, v in aux.items()}}
      return sums, count

    self._train = jax.jit(
      train,
      in_shardings=(param_shardings, self.opt_shardings, self.batch_sharding),
      out_shardings=(param_shardings, self.opt_shardings, replicated),
      donate_argnums=(0, 1),
    )
    # The same step keeping its input parameters (opt_state is still donated): after a snapshot
    # by reference (`Learner.snapshot_report` on CPU) the parameters a sender will read must
    # outlive the next step. Compiled only if used.
    self._train_keep = jax.jit(
      train,
      in_shardings=(param_shardings, self.opt_shardings, self.batch_sharding),
      out_shardings=(param_shardings, self.opt_shardings, replicated),
      donate_argnums=(1,),
    )
    self._evaluate = jax.jit(
      evaluate,
      in_shardings=(param_shardings, self.batch_sharding),
      out_shardings=replicated,
    )
    self.init_opt_state = jax.jit(optimizer.init, out_shardings=self.opt_shardings)

  # The model's activation constraints take effect only when traced under the mesh and the logical
  # rules (flax linen + jax.set_mesh), so every call enters that context.
  def train(
    self,
    params: PyTree,
    opt_state: PyTree,
    batch: dict[str, jax.Array],
    *,
    keep_params: bool = False,
  ):
    """One inner step; `opt_state` is donated, and `params` too unless `keep_params`."""
    step = self._train_keep if keep_params else self._train
    with partitioning.partitioning_context(self.mesh, self.rules):
      return step(params, opt_state, batch)

  def evaluate(self, params: PyTree, batch: dict[str, jax.Array]):
    """(sum of per-unit losses, number of units) of `params` on `batch`."""
    sums, count = self.evaluate_sums(params, batch)
    return sums["loss"], count

  def evaluate_sums(self, params: PyTree, batch: dict[str, jax.Array]):
    """({"loss" and each aux metric: its sum over the batch's units}, number of units)."""
    with partitioning.partitioning_context(self.mesh, self.rules):
      return self._evaluate(params, batch)

  def train_cache_size(self) -> int:
    """Compiled variants of the train step: stays 1 after any number of steps when pinned (2 once
    a step kept its parameters)."""
    return self._train._cache_size() + self._train_keep._cache_size()

  def put_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """Places a host batch on the mesh with the pinned batch sharding."""
    return jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, self.batch_sharding)


def eval_loss(steps: CompiledSteps, params: PyTree, batches: list[dict[str, Any]]) -> float:
  """Token-weighted mean loss of `params` over `batches`."""
  return eval_metrics(steps, params, batches)["loss"]


def eval_metrics(
  steps: CompiledSteps, params: PyTree, batches: list[dict[str, Any]]
) -> dict[str, float]:
  """Count-weighted means of the loss and of the task's aux metrics over `batches`.

  Args:
    steps: the compiled steps (their task decides the metrics).
    params: parameters placed with `steps.param_shardings`.
    batches: host batches.

  Returns:
    {"loss": ..., **aux} (e.g. "accuracy" for a vision task), each Σ_batches sum / Σ counts.
  """
  totals: dict[str, float] = {}
  count = 0.0
  for batch in batches:
    sums, n = steps.evaluate_sums(params, steps.put_batch(batch))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    count += float(n)
  return {k: v / max(count, 1.0) for k, v in totals.items()}
