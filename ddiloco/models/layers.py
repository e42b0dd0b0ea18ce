"""Parameter helpers shared by the models: fan-in initialisation and a named projection kernel.

Every parameter is created through `nn.with_logical_partitioning`, so that `ddiloco.parallel` can map
its logical axis names onto a learner's mesh (see `ddiloco.parallel.partitioning`).
"""

from typing import Any

import flax.linen as nn
import jax

Axes = int | tuple[int, ...]


def fan_in_init(
  in_axis: Axes, out_axis: Axes, batch_axis: Axes = ()
) -> nn.initializers.Initializer:
  """Unit-variance-preserving (LeCun normal) init over all input axes.

  Args:
    in_axis: the input (contracted) axes, e.g. (heads, kv) for an attention output kernel.
    out_axis: the output axes.
    batch_axis: axes of independent matrices (an MoE's experts): each slice along them is
      initialised as its own [in, out] matrix.

  Returns:
    A truncated-normal variance-scaling initializer.
  """
  return nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
  )


class Kernel(nn.Module):
  """Holds one projection kernel as `<name>/kernel`, so paths read "attn/query/kernel".

  Attributes:
    shape: the kernel's shape.
    axes: one logical axis name (or None: never sharded) per dimension.
    in_axis, out_axis, batch_axis: as in `fan_in_init`.
    param_dtype: storage dtype.
  """

  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  in_axis: Axes
  out_axis: Axes
  param_dtype: Any
  batch_axis: Axes = ()

  @nn.compact
  def __call__(self) -> jax.Array:
    init = nn.with_logical_partitioning(
      fan_in_init(self.in_axis, self.out_axis, self.batch_axis), self.axes
    )
    return self.param("kernel", init, self.shape, self.param_dtype)
