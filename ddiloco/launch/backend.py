"""Where a cluster's programs run: `ProgramBackend`, and `LocalProcesses`, this machine's.

`LocalCluster` (launch/local_cluster.py) decides what runs: the syncer (or its shards) and the
learners, their command lines, ports and folders, and when each starts, restarts and stops. A
backend decides where and how: the environment a program gets, the hosts and ports the syncer
serves on, how a process is started and what it returns to watch it (a `subprocess.Popen` or an
object with its `poll`, `wait`, `returncode` and `signal_group`), a multi-process learner's
coordinator, and what it does at each check of the fleet and after everything stopped.
`LocalProcesses` runs every program as a child process of the launcher; `RayBackend`
(launch/ray_cluster.py) runs each as a Ray actor, with Ray restarting what fails.
"""

import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ddiloco.launch import processes

if TYPE_CHECKING:
  from ddiloco.launch.local_cluster import LocalCluster


class ProgramBackend(Protocol):
  """How and where a `LocalCluster` starts its programs (module docstring)."""

  def environment(self, run_env: dict[str, str]) -> dict[str, str]:
    """The whole environment of a program, given the variables the launcher sets for it."""
    ...

  def syncer_shards(self, host: str, ports: list[int], num_shards: int) -> tuple[str, list[int]]:
    """(host, one port per shard) a sharded syncer serves on, given the launcher's so far."""
    ...

  def syncer_port(self, host: str, port: int) -> tuple[str, int]:
    """(host, port) an unsharded syncer first serves on; port 0 lets the syncer choose."""
    ...

  def start(self, launch: processes.Launch) -> Any:
    """Starts one process; returns what `LocalCluster` watches it through."""
    ...

  def coordinator_address(self, learner_id: int, num_processes: int) -> str:
    """host:port of a multi-process learner's jax.distributed coordinator, fresh at every start."""
    ...

  def supervise(self, cluster: "LocalCluster", progress: Callable[[str], None] | None) -> None:
    """What the backend does at each check of the fleet, before the fleet is checked."""
    ...

  def release(self) -> None:
    """Frees what the backend holds for programs that were stopped (after every stop)."""
    ...


class LocalProcesses:
  """Every program a child process of the launcher on this machine (launch/processes.py).

  Args:
    python: the interpreter for the children.
  """

  def __init__(self, python: str = sys.executable):
    self.python = python

  def environment(self, run_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **run_env}

  def syncer_shards(self, host: str, ports: list[int], num_shards: int) -> tuple[str, list[int]]:
    if len(ports) == num_shards:  # Chosen already (chaos proxies advertise them).
      return host, ports
    return host, [processes.free_port() for _ in range(num_shards)]

  def syncer_port(self, host: str, port: int) -> tuple[str, int]:
    return host, port

  def start(self, launch: processes.Launch) -> subprocess.Popen:
    return processes.spawn(self.python, launch)

  def coordinator_address(self, learner_id: int, num_processes: int) -> str:
    del learner_id, num_processes  # Every process of every learner runs on this host.
    return f"127.0.0.1:{processes.free_port()}"

  def supervise(self, cluster: "LocalCluster", progress: Callable[[str], None] | None) -> None:
    del cluster, progress  # A failed child is the fleet's to report.

  def release(self) -> None:
    pass  # Stopped children hold nothing.
