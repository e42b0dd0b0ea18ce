"""Outer optimizers shipped beside optax's own (docs/algorithm.md §4.6).

Any optax transformation is an outer optimizer (`SyncerConfig.outer_optimizer`). This module
holds the ones optax has no single constructor for.

`nesterov_warmup`: SGD with Nesterov momentum whose coefficient ramps linearly from 0 to its final
value over the first outer steps of each fragment. Why: with momentum μ, SGD's step settles at
lr / (1 − μ) times the outer gradient (7 for DiLoCo's 0.7 / 0.9) after about 1 / (1 − μ) outer
steps. A run with hundreds of outer steps per fragment spends a few percent of them ramping up;
a short run (the quick start has 4 outer steps per fragment, the main job 10) spends all of them
there and ends on a step several times larger than plain averaging, while its inner learning rate
has decayed. Measured on the quick-start run file (docs/results/short_horizon.md) and at 192 outer
steps (docs/results/scaling_table.md).

A long run wants a smaller learning rate under full momentum than a short run wants while the
momentum is still low (the two horizons' best values differ), so the ramp may also bring the
learning rate down, from `initial_learning_rate` to `learning_rate`, over the same outer steps.
"""

import optax


def nesterov_warmup(
  learning_rate: float,
  momentum: float = 0.9,
  warmup_steps: int = 20,
  initial_learning_rate: float | None = None,
) -> optax.GradientTransformation:
  """Nesterov SGD whose momentum ramps linearly from 0 to `momentum` over `warmup_steps` steps.

  Step t (from 0) uses momentum μ_t = momentum · min(t / warmup_steps, 1) and, with an
  `initial_learning_rate` lr_0, the learning rate lr_0 + (learning_rate − lr_0) · min(t /
  warmup_steps, 1); warmup_steps = 0 is plain Nesterov SGD. The state (per fragment, in the
  syncer's checkpoint) holds the step count.

  Args:
    learning_rate: the outer learning rate (after the warm-up, with `initial_learning_rate`).
    momentum: the momentum after the warm-up, in [0, 1).
    warmup_steps: outer steps of the ramp.
    initial_learning_rate: the learning rate of the first outer step, or None for
      `learning_rate` throughout.

  Raises:
    ValueError: for a learning rate that is not > 0, a momentum outside [0, 1) or a negative
      warm-up.
  """
  _check_rate("learning_rate", learning_rate)
  if initial_learning_rate is not None:
    _check_rate("initial_learning_rate", initial_learning_rate)
  if not 0 <= momentum < 1:
    raise ValueError(f"momentum must be in [0, 1), got {momentum}.")
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}.")
  if warmup_steps and initial_learning_rate is not None:
    learning_rate = optax.linear_schedule(initial_learning_rate, learning_rate, warmup_steps)
  return optax.inject_hyperparams(optax.sgd)(
    learning_rate=learning_rate,
    momentum=optax.linear_schedule(0.0, momentum, warmup_steps) if warmup_steps else momentum,
    nesterov=True,
  )


def _check_rate(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
    raise ValueError(f"{name} must be > 0, got {value!r}.")
