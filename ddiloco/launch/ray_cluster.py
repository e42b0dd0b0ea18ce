"""`RayBackend`: the job of `ddiloco-local` on a Ray cluster, with Ray restarting what fails.

`ddiloco-ray` (launch/ray_main.py) runs a `LocalCluster` with this backend (`make_cluster`). Every
program of the run is a Ray actor (launch/ray_actors.py):

- the syncer: one `ProgramActor` on a CPU node (the head node unless `RayConfig.syncer_on_head` is
  off), bound to that node's address on a port chosen there before it starts, so that a restart
  serves the same address;
- each learner: one `ProgramActor` per host of its slice (`JobConfig.processes_per_learner`),
  placed with the learner's resources (`RayConfig.learner_resources`: `{"TPU": 4}`, GPUs, or
  logical CPUs on this machine's fake devices).

A `ProgramActor` starts its program (`ddiloco-syncer` or `ddiloco-learner`, the same command line
as under `ddiloco-local`) as a child process on its node and watches it. That child is the JAX
program: it sees the accelerators Ray assigned to the actor (CUDA_VISIBLE_DEVICES, TPU chips),
imports JAX with the job's XLA flags set before, and a crashed XLA runtime never has to be
re-initialised inside a live interpreter. When the child dies without being asked to, the actor
exits with it, and Ray restarts that actor alone (`max_restarts`): its constructor starts the
program again with the same flags, and the learner restores its own checkpoint and rejoins (the
syncer restores its checkpoint and serves the same port). Nothing else stops: the other learners
keep training, which is the point of the method. A gang-restart policy (restart everything when
one fails) would defeat it.

A learner of several processes (a multi-host slice) is one JAX program across its actors, joined by
`jax.distributed`; its actors are reserved together (a placement group) and a failure of one takes
the whole learner down (`processes.ProcessUnit`), as under `ddiloco-local`. Its actors are not
restarted one by one (a lone restarted process cannot rejoin its peers' collectives): the launcher
starts the whole learner again, a fresh placement group and coordinator, up to
`RayConfig.max_restarts` times.

Everything else is `LocalCluster`'s (the backend is its collaborator, launch/backend.py): the
progress loop, `ddiloco-fleet add|remove|list` (an added
learner is a new actor on spare capacity), summary.json, loss.png and one log per process. The
driver reads the run's files from the workdir, so on a cluster of several machines the workdir is
storage every node and the driver share. Ctrl-C stops the programs (SIGTERM, then SIGKILL), kills
every actor and, for a Ray instance this launcher started, shuts it down.
"""

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

try:
  import ray
  from ray.util import scheduling_strategies
  from ray.util.placement_group import placement_group, remove_placement_group
except ImportError as e:  # pragma: no cover - depends on the installation.
  raise ImportError(
    "ddiloco's Ray backend needs Ray: pip install 'ddiloco[ray]' (scripts/setup.sh installs it)."
  ) from e

from ddiloco.launch import processes, ray_actors
from ddiloco.launch.local_cluster import LocalCluster
from ddiloco.launch.ray_config import RayConfig


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
  """SIGINT ignored meanwhile (children started then inherit that); only in the main thread."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _in_bundle(group: Any, index: int) -> Any:
  return scheduling_strategies.PlacementGroupSchedulingStrategy(
    group, placement_group_bundle_index=index
  )


def make_cluster(*, ray_config: RayConfig | None = None, **kwargs: Any) -> LocalCluster:
  """A `LocalCluster` whose programs are Ray actors (module docstring).

  Args:
    ray_config: where and how (RayConfig).
    **kwargs: LocalCluster's, but its backend.
  """
  backend = RayBackend(
    ray_config or RayConfig(),
    num_learners=kwargs["num_learners"],
    processes_per_learner=kwargs.get("processes_per_learner", 1),
  )
  return LocalCluster(backend=backend, **kwargs)


class RayBackend:
  """A `ProgramBackend` (launch/backend.py) that runs each program as a Ray actor.

  Args:
    ray_config: where and how (RayConfig).
    num_learners: the cluster's M, for the CPUs of a Ray instance started here.
    processes_per_learner: the cluster's processes per learner.
  """

  def __init__(self, ray_config: RayConfig, *, num_learners: int, processes_per_learner: int):
    self.ray_config = ray_config
    self.num_learners = num_learners
    self.processes_per_learner = processes_per_learner
    self._handles: list[ray_actors.ActorProcess] = []
    self._started_ray = False
    self._restarts_seen: dict[str, int] = {}
    self._unit_restarts: dict[int, int] = {}
    # Multi-process learners' reservations: learner id -> (placement group, release).
    self._reservations: dict[int, tuple[Any, Callable[[], None]]] = {}

  # -- the Ray instance -------------------------------------------------------------------------

  def connect(self) -> None:
    """Joins the configured Ray cluster, or starts one on this machine (stopped by `disconnect`)."""
    if ray.is_initialized():
      return
    cfg = self.ray_config
    address = cfg.address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if cfg.runtime_env:
      kwargs["runtime_env"] = dict(cfg.runtime_env)
    starting = address is None
    if starting:
      fleet = self.num_learners * self.processes_per_learner
      needed = fleet * cfg.learner_num_cpus + cfg.syncer_num_cpus
      kwargs["num_cpus"] = cfg.local_num_cpus or max(os.cpu_count() or 1, int(needed) + 2)
      # Ray runs its workers, and so our programs, at nice 15 by default; on one machine that puts
      # the syncer and learners below every other process (the launcher included).
      os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray's own processes are started in this process group; a terminal's Ctrl-C reaches the
    # whole group and would kill them under the running programs. They inherit an ignored SIGINT
    # instead, and the launcher stops the run in order (LocalCluster.run).
    with _sigint_ignored() if starting else contextlib.nullcontext():
      ray.init(address=address, **kwargs)
    self._started_ray = starting

  def disconnect(self) -> None:
    if self._started_ray and ray.is_initialized():
      ray.shutdown()
      self._started_ray = False

  # -- placing programs -------------------------------------------------------------------------

  def environment(self, run_env: dict[str, str]) -> dict[str, str]:
    """Only the run's variables: the rest is the environment of the node (ProgramActor)."""
    env = dict(run_env)
    if self.ray_config.platform != "cpu":  # The devices Ray assigns; the syncer sets CPU itself.
      del env["JAX_PLATFORMS"], env["XLA_FLAGS"]
    return env

  def _syncer_strategy(self) -> Any:
    if not self.ray_config.syncer_on_head:
      return "DEFAULT"
    head = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    if not head:
      raise RuntimeError("The Ray cluster reports no live head node for the syncer.")
    return scheduling_strategies.NodeAffinitySchedulingStrategy(head[0]["NodeID"], soft=False)

  def _learner_options(self) -> dict[str, Any]:
    cfg = self.ray_config
    return {
      "num_cpus": cfg.learner_num_cpus,
      "num_gpus": cfg.learner_num_gpus,
      "resources": dict(cfg.learner_resources),
    }

  def _actor(self, launch: processes.Launch, options: dict[str, Any], *, restart: bool) -> Any:
    handle = ray_actors.ActorProcess(
      ray_actors.RemoteProgramActor.options(
        max_restarts=self.ray_config.max_restarts if restart else 0, **options
      ).remote(launch, restart),
      launch,
      timeout_s=self.ray_config.start_timeout_s,
    )
    self._handles.append(handle)
    return handle

  def syncer_shards(self, host: str, ports: list[int], num_shards: int) -> tuple[str, list[int]]:
    """A sharded syncer's shards on the syncer's node: each on the configured port + its index,
    or on one found free there; Ray restarts each shard alone."""
    del host, ports  # Chosen on the syncer's node.
    strategy = self._syncer_strategy()
    probes = [
      ray.get(
        ray_actors.probe.options(scheduling_strategy=strategy).remote(),
        timeout=self.ray_config.start_timeout_s,
      )
      for _ in range(num_shards)
    ]
    base = self.ray_config.syncer_port
    return probes[0][0], [base + i if base else free for i, (_, free) in enumerate(probes)]

  def syncer_port(self, host: str, port: int) -> tuple[str, int]:
    """The configured port, or one free on the syncer's node; its restarts keep it."""
    del host, port  # Chosen on the syncer's node.
    node, free = ray.get(
      ray_actors.probe.options(scheduling_strategy=self._syncer_strategy()).remote(),
      timeout=self.ray_config.start_timeout_s,
    )
    return node, self.ray_config.syncer_port or free

  def start(self, launch: processes.Launch) -> ray_actors.ActorProcess:
    if launch.role == "syncer":
      options = {
        "num_cpus": self.ray_config.syncer_num_cpus,
        "resources": dict(self.ray_config.syncer_resources),
        "scheduling_strategy": self._syncer_strategy(),
      }
      return self._actor(launch, options, restart=True)
    options = self._learner_options()
    if self.processes_per_learner == 1:
      return self._actor(launch, options, restart=True)
    # A process of a multi-process learner, in its bundle of the learner's reservation; the
    # launcher restarts the whole learner (supervise), never one process.
    group, _ = self._reservations[launch.learner_id]
    options["scheduling_strategy"] = _in_bundle(group, launch.process_index)
    return self._actor(launch, options, restart=False)

  def coordinator_address(self, learner_id: int, num_processes: int) -> str:
    """Reserves the hosts of a multi-process learner (a fresh reservation at every start) and
    returns a free port on its process 0's host."""
    group, release = self._reserve(learner_id, num_processes, self._learner_options())
    self._reservations[learner_id] = (group, release)
    host, port = ray.get(
      ray_actors.probe.options(scheduling_strategy=_in_bundle(group, 0)).remote(),
      timeout=self.ray_config.start_timeout_s,
    )
    return f"{host}:{port}"

  def _reserve(
    self, learner_id: int, n: int, opts: dict[str, Any]
  ) -> tuple[Any, Callable[[], None]]:
    """Reserves the hosts of a multi-process learner: a placement group of n bundles (a whole TPU
    slice with `RayConfig.tpu_topology`), and how to release it.

    Raises:
      ValueError: if the TPU slice has not `processes_per_learner` hosts.
      TimeoutError: if Ray cannot reserve it within `start_timeout_s`.
    """
    cfg = self.ray_config
    if cfg.tpu_topology:
      from ray.util import tpu

      reservation = tpu.slice_placement_group(cfg.tpu_topology, cfg.tpu_version)
      group, release = reservation.placement_group, reservation.shutdown
      if reservation.num_hosts != n:
        release()
        raise ValueError(
          f"A {cfg.tpu_version} {cfg.tpu_topology} slice has {reservation.num_hosts} hosts; "
          f"JobConfig.processes_per_learner is {n} (one process per host)."
        )
      what = f"a {cfg.tpu_version} {cfg.tpu_topology} slice"
    else:
      bundle = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}
      bundle = {k: v for k, v in bundle.items() if v}
      group = placement_group([bundle] * n, strategy=cfg.placement_strategy)

      def release() -> None:
        remove_placement_group(group)

      what = f"{n} x {bundle}"
    if not group.wait(timeout_seconds=cfg.start_timeout_s):
      release()
      raise TimeoutError(f"Ray could not reserve {what} for learner {learner_id}.")
    return group, release

  # -- restarts ---------------------------------------------------------------------------------

  def supervise(self, cluster: LocalCluster, progress: Callable[[str], None] | None) -> None:
    """Records Ray's restarts, ends crash loops, and restarts failed multi-process learners as a
    whole (module docstring); the cluster's fleet is checked next."""
    cfg = self.ray_config
    if cfg.crash_loop_restarts:
      now = time.monotonic()
      for handle in list(self._handles):
        recent = sum(now - t < cfg.crash_loop_window_s for t in handle.restart_times)
        if handle.returncode is None and recent >= cfg.crash_loop_restarts:
          handle.release()
          handle.end(
            f"restarted {recent} times within {cfg.crash_loop_window_s:g} s, a crash loop: not "
            "restarted again (the lines above say why it fails)"
          )
    for name, n in self.restarts(cluster).items():
      if n > self._restarts_seen.get(name, 0):
        self._restarts_seen[name] = n
        learner_id = -1 if name.startswith("syncer") else int(name.split("_")[1])
        cluster.fleet.record("restart", learner_id, program=name, restarts=n)
        if progress is not None:
          progress(f"ray: {name} restarted after it died ({n} so far)")
    if self.processes_per_learner > 1:
      for i, member in sorted(cluster.fleet.members.items()):
        child = cluster.learners[i]
        if member.state != "running" or child.proc.poll() in (None, 0):
          continue
        limit = self.ray_config.max_restarts
        if limit != -1 and self._unit_restarts.get(i, 0) >= limit:
          continue  # LocalCluster reports the failure.
        self._unit_restarts[i] = self._unit_restarts.get(i, 0) + 1
        self._release_learner(i, child)
        cluster.restart_learner(i)  # Recorded as a restart at the next check.
        if progress is not None:
          progress(
            f"ray: learner {i} failed ({child.proc.returncode}); restarted all its processes"
          )

  def _release_learner(self, learner_id: int, child: processes.Child) -> None:
    for p in child.proc.procs:
      p.release()
      self._handles.remove(p)
    _, release = self._reservations.pop(learner_id)
    release()

  # -- stopping ---------------------------------------------------------------------------------

  def release(self) -> None:
    """Every actor and placement group is released (after the cluster's orderly stop)."""
    for handle in self._handles:
      handle.release()
    for _, release in self._reservations.values():
      release()
    self._handles.clear()
    self._reservations.clear()

  def restarts(self, cluster: LocalCluster) -> dict[str, int]:
    """Restarts made, per program of `cluster` that had any ("syncer", "syncer_<i>",
    "learner_<i>")."""
    out = {}
    if cluster.syncer is not None and cluster.syncer.proc.restarts:
      out["syncer"] = cluster.syncer.proc.restarts
    for i, child in sorted(cluster.shards.items()):  # A sharded syncer's other shards.
      if child.proc.restarts:
        out[f"syncer_{i}"] = child.proc.restarts
    for i, child in sorted(cluster.learners.items()):
      n = self._unit_restarts.get(i, 0)
      if isinstance(child.proc, ray_actors.ActorProcess):
        n += child.proc.restarts
      if n:
        out[f"learner_{i}"] = n
    return out
