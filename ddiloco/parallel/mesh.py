"""One learner's device mesh (docs/algorithm.md §1: each learner owns its own mesh).

A learner's mesh has two axes, `data` (batch sharding) and `model` (tensor/expert sharding), laid
out by `jax.experimental.mesh_utils` so that on TPU/GPU the `model` axis, which carries the most
traffic, maps to the closest devices. The axes are `AxisType.Auto` (GSPMD propagation from the
logical sharding annotations, t5x style), not the `Explicit` default of `jax.make_mesh`.

In the simulated cluster (docs/architecture.md "two ways to run") several learners live in one process;
`learner_devices` hands each a slice of `jax.devices()`.
"""

from collections.abc import Sequence

import jax
from jax.experimental import mesh_utils

from ddiloco.types import DATA_AXIS, MODEL_AXIS

MESH_AXES = (DATA_AXIS, MODEL_AXIS)


def make_mesh(
  *, devices: Sequence[jax.Device] | None = None, model_parallelism: int = 1
) -> jax.sharding.Mesh:
  """Builds a ("data", "model") mesh over `devices`.

  Args:
    devices: the learner's devices; defaults to `jax.devices()`.
    model_parallelism: size of the "model" axis; the "data" axis gets the rest.

  Returns:
    A `Mesh` of shape (len(devices) // model_parallelism, model_parallelism) with axis names
    ("data", "model") and `AxisType.Auto` axes.

  Raises:
    ValueError: if there are no devices, duplicates, or `model_parallelism` is not a positive
      divisor of the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh needs at least one device.")
  if len(set(devices)) != len(devices):
    raise ValueError(f"make_mesh got duplicate devices: {devices}.")
  if isinstance(model_parallelism, bool) or not isinstance(model_parallelism, int):
    raise ValueError(f"model_parallelism must be an int, got {model_parallelism!r}.")
  if model_parallelism < 1:
    raise ValueError(f"model_parallelism must be >= 1, got {model_parallelism}.")
  if len(devices) % model_parallelism:
    raise ValueError(
      f"model_parallelism={model_parallelism} does not divide the {len(devices)} devices; "
      f"pick a divisor of {len(devices)}."
    )
  shape = (len(devices) // model_parallelism, model_parallelism)
  # Topology-aware placement (a plain reshape on CPU). Splitting physical axes is allowed because a
  # learner may own an arbitrary slice of a pod, whose shape need not match the logical mesh.
  device_array = mesh_utils.create_device_mesh(
    shape, devices=devices, allow_split_physical_axes=True
  )
  auto = jax.sharding.AxisType.Auto
  return jax.sharding.Mesh(device_array, MESH_AXES, axis_types=(auto, auto))


def learner_devices(
  learner_index: int, devices_per_learner: int, devices: Sequence[jax.Device] | None = None
) -> list[jax.Device]:
  """The devices of learner `learner_index` when several learners share one process.

  Rule: the device list is cut into `S = len(devices) // devices_per_learner` consecutive,
  disjoint slots; learner i gets slot `i mod S`, i.e. `devices[s * n : (s + 1) * n]` with
  `s = i % S` and `n = devices_per_learner`. With at least `M * n` devices, learners 0..M-1 are
  disjoint. With fewer, learners wrap around and learner i shares its devices with learners
  i ± S, i ± 2S, ... (fine for the simulated cluster, whose learners take turns; their arrays stay
  separate). Devices beyond `S * n` are left unused.

  Args:
    learner_index: the learner's index, >= 0.
    devices_per_learner: devices per learner, between 1 and len(devices).
    devices: the pool; defaults to `jax.devices()`.

  Returns:
    The learner's `devices_per_learner` devices, in pool order.

  Raises:
    ValueError: for a negative index or a slot size that is not in [1, len(devices)].
  """
  pool = list(jax.devices() if devices is None else devices)
  if isinstance(learner_index, bool) or not isinstance(learner_index, int) or learner_index < 0:
    raise ValueError(f"learner_index must be an int >= 0, got {learner_index!r}.")
  if isinstance(devices_per_learner, bool) or not isinstance(devices_per_learner, int):
    raise ValueError(f"devices_per_learner must be an int, got {devices_per_learner!r}.")
  if not 1 <= devices_per_learner <= len(pool):
    raise ValueError(
      f"devices_per_learner must be in [1, {len(pool)}] (the pool size), got {devices_per_learner}."
    )
  num_slots = len(pool) // devices_per_learner
  slot = learner_index % num_slots
  return pool[slot * devices_per_learner : (slot + 1) * devices_per_learner]
