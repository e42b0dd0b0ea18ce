"""`RayConfig`: where and how `ddiloco-ray` runs a job (launch/ray_cluster.py).

Apart from the backend so that every process of a run, which parses the same gin files, knows the
name without importing Ray.
"""

import dataclasses
import math
from typing import Any

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayConfig:
  """Where and how `ddiloco-ray` runs a job on Ray.

  Attributes:
    address: the Ray cluster to join ("auto", "host:6379"; a Ray Client "ray://host:10001" only
      where the workdir is mounted too); None: the one in RAY_ADDRESS, else a Ray instance started
      on this machine for the run and stopped after it.
    platform: "cpu": every learner process gets `JobConfig.devices_per_learner` fake CPU devices, as
      under `ddiloco-local`; "gpu" or "tpu": the devices Ray assigns to its actor.
    learner_num_cpus: logical CPUs each learner actor (one per host of its slice) reserves.
    learner_num_gpus: GPUs each learner actor reserves (a fraction shares a GPU between learners).
    learner_resources: further resources per learner actor, e.g. {"TPU": 4} for a TPU VM host.
    syncer_num_cpus: logical CPUs the syncer actor reserves.
    syncer_on_head: place the syncer on the Ray head node (a long-lived CPU machine); else anywhere
      with `syncer_resources`.
    syncer_resources: further resources for the syncer, e.g. {"syncer_node": 1} for a custom
      resource of the machine meant for it.
    syncer_port: the port the syncer serves on (0: one free on its node when the run starts; a
      fixed one is easier to open in a firewall). Its restarts keep it. Shard i of a sharded
      syncer serves on syncer_port + i, so with a fixed `ServiceConfig.bulk_port` (shard i's:
      bulk_port + i) the two ranges must not meet (`check_job`, at start).
    max_restarts: how often Ray restarts one program after it died (-1: without limit).
    crash_loop_restarts: a program restarted this often within `crash_loop_window_s` is failing
      at start (a bad config or environment on its node, say): the launcher stops restarting it
      and the run ends as if it failed, with the reason in its log (0: no such limit).
    crash_loop_window_s: the window of `crash_loop_restarts`.
    placement_strategy: how a multi-process learner's actors are placed ("STRICT_SPREAD": one per
      host, as the hosts of a slice; "PACK" or "SPREAD" elsewhere).
    tpu_topology: with `tpu_version`, each multi-process learner reserves a whole TPU slice of
      this topology ("4x4x4"; Ray's `ray.util.tpu.slice_placement_group`), one process per host;
      `JobConfig.processes_per_learner` must equal the slice's hosts.
    tpu_version: the TPU generation of those slices ("v5p", "v6e").
    local_num_cpus: logical CPUs of a Ray instance started here (None: enough for the whole fleet:
      learners here share the machine, as under `ddiloco-local`).
    start_timeout_s: how long an actor may take to be placed and start its program.
    runtime_env: Ray's runtime environment for every actor of the run, e.g.
      {"working_dir": "."} to ship your own task's module to the nodes: the programs start in
      that folder, so the gin file's `import` finds it (docs/custom_tasks.md). {}: none.
  """

  address: str | None = None
  platform: str = "cpu"
  learner_num_cpus: float = 1.0
  learner_num_gpus: float = 0.0
  learner_resources: dict[str, float] = dataclasses.field(default_factory=dict)
  syncer_num_cpus: float = 1.0
  syncer_on_head: bool = True
  syncer_resources: dict[str, float] = dataclasses.field(default_factory=dict)
  syncer_port: int = 0
  max_restarts: int = 20
  crash_loop_restarts: int = 3
  crash_loop_window_s: float = 300.0
  placement_strategy: str = "PACK"
  tpu_topology: str | None = None
  tpu_version: str | None = None
  local_num_cpus: int | None = None
  start_timeout_s: float = 600.0
  runtime_env: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}.")
    if self.max_restarts < -1:
      raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}.")
    if self.crash_loop_restarts < 0 or not self.crash_loop_window_s > 0:
      raise ValueError("crash_loop_restarts must be >= 0 and crash_loop_window_s > 0.")
    if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
      raise ValueError(f"unknown placement_strategy {self.placement_strategy!r}.")
    for name in ("learner_num_cpus", "learner_num_gpus", "syncer_num_cpus"):
      value = getattr(self, name)
      if not (value >= 0 and math.isfinite(value)):  # Ray refuses NaN or inf only at placement.
        raise ValueError(f"{name} must be finite and >= 0, got {value}.")
    for name in ("learner_resources", "syncer_resources"):
      for key, value in dict(getattr(self, name)).items():
        if not isinstance(key, str) or not isinstance(value, int | float) or not value >= 0:
          raise ValueError(f"{name} maps names to amounts >= 0, got {key!r}: {value!r}.")
    if not 0 <= self.syncer_port <= 65535:
      raise ValueError(f"syncer_port must be in [0, 65535], got {self.syncer_port}.")
    if bool(self.tpu_topology) != bool(self.tpu_version):
      raise ValueError("tpu_topology and tpu_version go together.")
    if self.tpu_topology and self.platform != "tpu":
      raise ValueError(f"tpu_topology needs platform 'tpu', got {self.platform!r}.")
    if self.local_num_cpus is not None and self.local_num_cpus < 1:
      raise ValueError(f"local_num_cpus must be >= 1, got {self.local_num_cpus}.")
    if not isinstance(self.runtime_env, dict):
      raise ValueError(f"runtime_env must be a dict, got {self.runtime_env!r}.")
    if not self.start_timeout_s > 0:
      raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}.")

  def check_job(self, job: Any) -> None:
    """Refuses a fixed `syncer_port` the job's shards cannot all use: shard i serves on
    `syncer_port + i` and, with a fixed `ServiceConfig.bulk_port`, its bulk port on
    `bulk_port + i`, all on the syncer's node, so the two ranges must fit and must not meet.

    Raises:
      ValueError: naming both settings.
    """
    shards = job.syncer_shards
    if not self.syncer_port:
      return
    if self.syncer_port + shards - 1 > 65535:
      raise ValueError(
        f"RayConfig.syncer_port={self.syncer_port} with syncer_shards={shards}: shard i serves "
        "on syncer_port + i, past 65535."
      )
    bulk_port = job.run.the_service().bulk_port
    grpc_ports = range(self.syncer_port, self.syncer_port + shards)
    if bulk_port and set(grpc_ports) & set(range(bulk_port, bulk_port + shards)):
      raise ValueError(
        f"RayConfig.syncer_port={self.syncer_port} and ServiceConfig.bulk_port={bulk_port} with "
        f"syncer_shards={shards}: shard i serves on syncer_port + i and bulk_port + i, and the "
        "two ranges meet on the syncer's node."
      )
