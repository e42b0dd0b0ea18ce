"""The TPU slice configs (gin_configs/clusters/) fit their slices: checked abstractly, on fake
CPU devices as many as the slice has chips, in a subprocess (the device count is fixed when jax
loads, and the suite's is 8).

For each config: the TPU topology has `processes_per_learner` hosts of `devices_per_learner`
chips; the learner mesh (data, model) spans them; every parameter's shards divide evenly; and
parameters, gradients and AdamW's two moments (fp32, 16 bytes a parameter) take at most half of a
chip's HBM, leaving the rest for activations (remat is on in the model configs).
"""

import glob
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "gin_configs", "clusters", "tpu_*.gin")))
HBM_GIB = {"v5p": 95, "v6e": 32}  # Per chip.

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_CHECK = r"""
import json, math, sys
import jax
from ddiloco.fragments import tree
from ddiloco.launch import configurables
from ddiloco.launch.job import JobConfig
from ddiloco.launch.ray_config import RayConfig
from ddiloco.parallel import mesh as mesh_lib, partitioning

root, path = sys.argv[1], sys.argv[2]
configurables.parse([path], search_paths=[root + "/gin_configs"])
job, ray = configurables.configured(JobConfig)(), configurables.configured(RayConfig)()
task = job.run.the_task()
mesh = mesh_lib.make_mesh(devices=jax.devices(), model_parallelism=job.model_parallelism)
abstract, _ = partitioning.abstract_params(task.model, mesh, inputs=task.dummy_inputs(1))
uneven, state_bytes, params = [], 0, 0
for name, leaf in tree.flatten(abstract).items():
  spec = leaf.sharding.spec
  shard = list(leaf.shape)
  for dim, axes in enumerate(spec):
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    ways = math.prod(mesh.shape[a] for a in axes)
    if leaf.shape[dim] % ways:
      uneven.append(f"{name} {leaf.shape} {spec}")
    shard[dim] = leaf.shape[dim] // ways
  state_bytes += 16 * math.prod(shard)  # fp32 params, grads, AdamW m and v.
  params += math.prod(leaf.shape)
print(json.dumps({
  "devices": len(jax.devices()), "mesh": dict(mesh.shape), "uneven": uneven,
  "state_gib": state_bytes / 2**30, "params": params, "version": ray.tpu_version,
  "topology": ray.tpu_topology, "hosts": job.processes_per_learner,
  "chips_per_host": job.devices_per_learner, "resources": dict(ray.learner_resources),
  "platform": ray.platform,
}))
"""


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_a_slice_config_fits_its_slice(path):
  with open(path) as f:
    text = f.read()
  chips = math.prod(int(x) for x in text.split('tpu_topology = "')[1].split('"')[0].split("x"))
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={chips}"
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [sys.executable, "-c", _CHECK, ROOT, path],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["platform"] == "tpu"
  assert got["hosts"] * got["chips_per_host"] == chips == got["devices"]
  assert got["resources"] == {"TPU": got["chips_per_host"]}
  assert got["uneven"] == []
  assert got["state_gib"] <= HBM_GIB[got["version"]] / 2, got
  assert got["mesh"]["data"] * got["mesh"]["model"] == chips


def test_there_are_slice_configs_for_each_large_model():
  names = " ".join(os.path.basename(p) for p in CONFIGS)
  for size in ("2b", "5b", "9b"):
    assert f"_{size}.gin" in names
