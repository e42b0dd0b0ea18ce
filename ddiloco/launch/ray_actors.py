"""The two halves of a program run by Ray (launch/ray_cluster.py): `ProgramActor` on its node, and
`ActorProcess`, the launcher's Popen-like view of it.

A `ProgramActor` starts its program (a `processes.Launch`: `ddiloco-syncer` or one process of a
`ddiloco-learner`) as a child process from a thread that lives as long as the program, so
PR_SET_PDEATHSIG ties the program to the actor. A program that exits with an error nobody asked
for takes its actor down, and Ray restarts the actor (and so the program) if it may. Each start
writes a line to the program's log. `ActorProcess` asks the actor in the background, so nothing
in the launcher blocks on Ray.
"""

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

try:
  import ray
except ImportError as e:  # pragma: no cover - depends on the installation.
  raise ImportError(
    "ddiloco's Ray backend needs Ray: pip install 'ddiloco[ray]' (scripts/setup.sh installs it)."
  ) from e

from ddiloco.launch import processes

# Exit code of a program whose actor Ray will not restart any more (died, node lost, restarts spent).
ACTOR_DIED = -int(signal.SIGKILL)


# -- on the nodes ----------------------------------------------------------------------------------


def _node_address() -> tuple[str, int]:
  """This node's address as Ray knows it, and a port free on it now."""
  ip = ray.util.get_node_ip_address()
  with socket.socket() as s:
    s.bind(("", 0))
    return ip, s.getsockname()[1]


probe = ray.remote(num_cpus=0)(_node_address)


class ProgramActor:
  """Runs one program of the run (a `processes.Launch`) on its node and watches it.

  The program is started by a thread of this actor that lives as long as the program does, so
  PR_SET_PDEATHSIG (processes.spawn) ties the program's life to this actor's process: a killed
  actor takes its program along. When the program exits with an error that nobody asked for
  (`signal_group`), the actor exits too, and Ray restarts it if it may (module docstring).
  """

  def __init__(self, launch: processes.Launch, restart_on_failure: bool):
    env = {**os.environ, **launch.env}
    self._launch = dataclasses.replace(launch, env=env)
    self._restart_on_failure = restart_on_failure
    self._expected_exit = False
    self._returncode: int | None = None
    self._started = threading.Event()
    self._error: BaseException | None = None
    self._incarnation = time.time_ns()
    self._reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
    threading.Thread(target=self._run, name="program", daemon=True).start()
    self._started.wait()
    if self._error is not None:
      raise self._error

  def _run(self) -> None:
    try:
      self._proc = processes.spawn(sys.executable, self._launch)
    except BaseException as e:  # Handed to the constructor, which raises it.
      self._error = e
      self._started.set()
      return
    self._started.set()
    with open(self._launch.log_path, "a") as log:
      again = "restarted" if self._reconstructed else "started"
      log.write(
        f"[ddiloco-ray] {again} by actor pid {os.getpid()} on {ray.util.get_node_ip_address()} "
        f"(program pid {self._proc.pid}, nice {os.nice(0)})\n"
      )
    rc = self._proc.wait()
    self._returncode = rc
    if rc != 0 and not self._expected_exit and self._restart_on_failure:
      with open(self._launch.log_path, "a") as log:
        log.write(
          f"\n[ddiloco-ray] the program exited with {rc}; its actor exits for Ray to restart\n"
        )
      os._exit(1)  # A crash of the actor, which Ray answers with a restart.

  def info(self) -> dict[str, Any]:
    """{"pid" of the program, "actor_pid" (this actor's process), "node" address, "incarnation"
    (a new one at each restart), "restarted" (this incarnation is a restart), "returncode" (None
    while it runs)}."""
    return {
      "pid": self._proc.pid,
      "actor_pid": os.getpid(),
      "node": ray.util.get_node_ip_address(),
      "incarnation": self._incarnation,
      "restarted": self._reconstructed,
      "returncode": self._returncode,
    }

  def signal_group(self, sig: int) -> None:
    """Sends `sig` to the program's process group. SIGTERM, SIGINT and SIGKILL are asked-for
    exits: the actor then stays, with the program's exit code, and is not restarted."""
    if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
      self._expected_exit = True
    processes.signal_group(self._proc, sig)


RemoteProgramActor = ray.remote(ProgramActor)


# -- in the launcher -------------------------------------------------------------------------------


class ActorProcess:
  """A program run by a `ProgramActor`, seen from the launcher as a `subprocess.Popen`.

  Nothing here blocks: the actor is asked in the background and `poll` answers from its last reply,
  so every program of a run starts at once. `pid` (the program's), `actor_pid` and `node` are None
  until the actor first answered. While Ray restarts the actor the program counts as running;
  `restarts` counts the restarts seen. An actor that Ray could not place and start within
  `timeout_s`, or that died for good, ends the program with `ACTOR_DIED`, and its log says why.
  """

  def __init__(self, actor: Any, launch: processes.Launch, *, timeout_s: float):
    self.actor = actor
    self.args = launch.argv
    self.returncode: int | None = None
    self.restarts = 0
    self.restart_times: list[float] = []  # time.monotonic() at each restart seen.
    self.pid: int | None = None
    self.actor_pid: int | None = None
    self.node: str | None = None
    self._log_path = launch.log_path
    self._role = launch.role
    self._timeout_s = timeout_s
    self._start_deadline: float | None = time.monotonic() + timeout_s
    self._incarnation: int | None = None
    self._pending: Any = actor.info.remote()

  def _update(self, info: dict[str, Any]) -> None:
    if self._incarnation is not None and info["incarnation"] != self._incarnation:
      self.restarts += 1
      self.restart_times.append(time.monotonic())
    self._incarnation = info["incarnation"]
    self._start_deadline = None
    self.pid, self.actor_pid, self.node = info["pid"], info["actor_pid"], info["node"]
    if info["returncode"] is not None:
      self.returncode = info["returncode"]

  def end(self, why: str) -> None:
    """Counts the program as ended for good (`ACTOR_DIED`) and says `why` in its log."""
    self.returncode = ACTOR_DIED
    os.makedirs(os.path.dirname(self._log_path), exist_ok=True)
    with open(self._log_path, "a") as log:
      log.write(f"\n[ddiloco-ray] {why}\n")

  def poll(self) -> int | None:
    if self.returncode is not None:
      return self.returncode
    if self._pending is None:
      self._pending = self.actor.info.remote()
    ready, _ = ray.wait([self._pending], timeout=0)
    if not ready:
      if self._start_deadline is not None and time.monotonic() > self._start_deadline:
        ray.kill(self.actor, no_restart=True)
        self.end(
          f"Ray did not start this {self._role} within {self._timeout_s} s: are the resources "
          "it asks for (RayConfig) in the cluster?"
        )
      return self.returncode
    ref, self._pending = self._pending, None
    try:
      self._update(ray.get(ref))
    except ray.exceptions.ActorUnavailableError:
      pass  # Being restarted.
    except ray.exceptions.ActorDiedError as e:  # Ray will not restart it.
      self.end(f"its actor died for good: {str(e).strip().splitlines()[0]}")
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    return processes.poll_until_exit(self, timeout)

  def signal_group(self, sig: int) -> None:
    if self.poll() is not None:
      return
    if self._incarnation is None:  # Never answered: not placed yet, or still starting.
      if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        ray.kill(self.actor, no_restart=True)
        self.end(f"stopped ({signal.Signals(sig).name}) before Ray started it")
      return
    # Gone or being restarted: `release` kills what is left.
    with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
      ray.get(self.actor.signal_group.remote(sig), timeout=30)

  def release(self) -> None:
    """Kills the actor (and so its program) for good."""
    ray.kill(self.actor, no_restart=True)
