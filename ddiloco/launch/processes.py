"""Child processes of the local launchers: how they are started, watched, signalled and stopped.

`Launch` is one process to start, and `run_env` the variables the launcher sets for it. `spawn`
starts it in its own session (a terminal's Ctrl-C reaches only the launcher, which then stops its
children in order) with PR_SET_PDEATHSIG (so it dies with the launcher even if that is SIGKILLed).
`ProcessUnit` holds the N processes of a multi-process learner (docs/algorithm.md §1, a learner on
a multi-host slice) and acts as one Popen: `signal_group` reaches all N; once one exits with an
error or is killed, the rest are SIGKILLed at once (a process waiting in a collective for a dead
peer would hang forever), and once one exits 0 the others get `ProcessUnit.exit_grace_s` to finish
too; `start_unit` starts one. `Child` is a started program as the launcher watches it (its process
or unit, its log, the last train event of its metrics); `tail`, `kill` and `stop_in_order` act on
children. Used by launch/local_cluster.py and the fleet it manages (launch/elastic.py).
"""

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1
# Resolved in the parent: the child between fork and exec only makes one libc call (no imports, no
# allocation), which is what makes this preexec_fn safe although the launcher has threads (gRPC).
_PRCTL = (
  ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None
)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec.
  if _PRCTL is not None:
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Launch:
  """One process to start: its command line (after the interpreter), environment, log file, and
  what it is (where a cluster backend places it): its role ("syncer" or "learner"), and for a
  learner its id and its index among the learner's processes."""

  argv: list[str]
  env: dict[str, str]
  log_path: str
  role: str = "learner"
  learner_id: int | None = None
  process_index: int = 0


def spawn(python: str, launch: Launch) -> subprocess.Popen:
  """Starts `launch` with `python`, in its own session, dying with this process; output to its log
  (appended: a restarted process continues its predecessor's log)."""
  os.makedirs(os.path.dirname(launch.log_path), exist_ok=True)
  with open(launch.log_path, "a") as log:
    return subprocess.Popen(
      [python, *launch.argv],
      stdout=log,
      stderr=subprocess.STDOUT,
      env=launch.env,
      start_new_session=True,
      preexec_fn=_die_with_parent,  # noqa: PLW1509 - see _PRCTL.
    )


def run_env(token: str, workdir: str, devices: int | None) -> dict[str, str]:
  """The variables the launcher sets for a program (over the environment it runs in).

  Args:
    token: the run's token (DDILOCO_TOKEN).
    workdir: the run's folder; the compile cache defaults to workdir/jax_cache.
    devices: fake CPU devices (--xla_force_host_platform_device_count), None for XLA's default.
  """
  env = {
    "DDILOCO_TOKEN": token,
    "JAX_PLATFORMS": "cpu",
    "JAX_COMPILATION_CACHE_DIR": os.environ.get(
      "JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax_cache")
    ),
    # Every compile: a restarted process beside busy learners finds even its small programs (the
    # syncer's outer steps, quick on an idle machine) instead of compiling them slowly again.
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get(
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"
    ),
    "PYTHONUNBUFFERED": "1",
  }
  flags_ = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f
  ]
  if devices is not None:
    flags_.append(f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(flags_)
  return env


def free_port() -> int:
  """A port free on 127.0.0.1 now (a learner's jax.distributed coordinator)."""
  return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
  """`n` distinct ports free on 127.0.0.1 now: each is held until all are chosen."""
  with contextlib.ExitStack() as held:
    ports = []
    for _ in range(n):
      s = held.enter_context(socket.socket())
      s.bind(("127.0.0.1", 0))
      ports.append(s.getsockname()[1])
    return ports


def tls_files(tls: Sequence[str]) -> tuple[str, str, str]:
  """(certificate chain, private key, CA) PEM files made absolute (programs may run in another
  folder).

  Raises:
    ValueError: unless there are three, all existing files.
  """
  files = tuple(os.path.abspath(p) for p in tls)
  missing = [p for p in files if not os.path.isfile(p)]
  if len(files) != 3 or missing:
    raise ValueError(f"tls takes (cert, key, CA) PEM files; missing: {missing}")
  return files


def check_count(name: str, value: Any) -> None:
  """Raises ValueError unless `value` is an int >= 1 (not a bool)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


class ProcessUnit:
  """The processes of one multi-process learner, watched and signalled as one (module docstring).

  Popen-like where LocalCluster and the chaos driver use a learner's process (`pid` and `args` are
  process 0's, `poll`, `wait`, `returncode`), so a `Child` may hold either.

  Args:
    procs: the learner's processes, process 0 first.
    log_paths: their log files, in the same order.
    exit_grace_s: how long the others may still run after one exited 0 before they are killed. A
      process that exited 0 passed the learner's last collective, so the others only have local
      work left: summaries, and the leader's bounded flush of its pushes and its Leave RPC.
  """

  def __init__(
    self,
    procs: Sequence[subprocess.Popen],
    *,
    log_paths: Sequence[str],
    exit_grace_s: float = 120.0,
  ):
    if len(procs) < 2 or len(log_paths) != len(procs):
      raise ValueError("A ProcessUnit needs >= 2 processes and one log path each.")
    self.procs = list(procs)
    self.log_paths = list(log_paths)
    self.exit_grace_s = exit_grace_s
    self.first_exit: int | None = None  # Index of the process seen exiting first.
    self._first_exit_at = 0.0  # Monotonic.
    self.killed_rest = False  # The unit SIGKILLed processes that were still running.

  @property
  def pid(self) -> int:
    return self.procs[0].pid

  @property
  def args(self) -> Any:
    return self.procs[0].args

  @property
  def returncode(self) -> int | None:
    return self._code() if all(p.returncode is not None for p in self.procs) else None

  def poll(self) -> int | None:
    """None while the learner runs; its exit code once every process is gone.

    Kills the rest of the unit once a process failed, or exited 0 more than `exit_grace_s` ago.
    """
    codes = [p.poll() for p in self.procs]
    if all(c is None for c in codes):
      return None
    if self.first_exit is None:
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      self.first_exit = failed[0] if failed else next(i for i, c in enumerate(codes) if c == 0)
      self._first_exit_at = time.monotonic()
    if any(c is None for c in codes):
      failed = any(c not in (None, 0) for c in codes)
      if not failed and time.monotonic() - self._first_exit_at < self.exit_grace_s:
        return None
      self.kill_rest()
    return self._code()

  def kill_rest(self) -> None:
    """SIGKILLs (and reaps) every process of the unit still running."""
    for p in self.procs:
      if p.poll() is None:
        self.killed_rest = True
        signal_group(p, signal.SIGCONT)  # A stopped process must not stay stopped in the kernel.
        signal_group(p, signal.SIGKILL)
    for p in self.procs:
      p.wait(timeout=30)

  def wait(self, timeout: float | None = None) -> int:
    """Waits until every process exited (as `poll` decides); returns the unit's exit code.

    Raises:
      subprocess.TimeoutExpired: after `timeout` seconds.
    """
    return poll_until_exit(self, timeout)

  def _code(self) -> int:
    """0 if every process exited 0; else the first failure's code (the others' were our kill)."""
    codes = [p.returncode for p in self.procs]
    if all(c == 0 for c in codes):
      return 0
    first = codes[self.first_exit] if self.first_exit is not None else 0
    return first if first != 0 else next(c for c in codes if c != 0)


def poll_until_exit(proc: Any, timeout: float | None) -> int:
  """Polls a Popen-like `proc` until it has an exit code (`wait` for handles without a real one).

  Raises:
    subprocess.TimeoutExpired: after `timeout` seconds.
  """
  deadline = None if timeout is None else time.monotonic() + timeout
  while (rc := proc.poll()) is None:
    if deadline is not None and time.monotonic() > deadline:
      raise subprocess.TimeoutExpired(proc.args, timeout)
    time.sleep(0.05)
  return rc


def signal_group(proc: Any, sig: int) -> None:
  """Sends `sig` to a child's process group, or to each of a unit's (all N processes).

  A handle of a process that runs elsewhere (launch/ray_cluster.py) has its own `signal_group`.
  """
  for p in proc.procs if isinstance(proc, ProcessUnit) else [proc]:
    if hasattr(p, "signal_group"):
      p.signal_group(sig)
    elif p.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)  # The child leads its own session and process group.


def start_unit(launches: Sequence[Launch], popen: Callable[[Launch], Any]) -> Any:
  """Starts a learner's processes with `popen`: its one process, or a `ProcessUnit` of all of them.

  If a start fails, the processes already started are SIGKILLed and reaped: never half a learner.
  """
  if len(launches) == 1:
    return popen(launches[0])
  procs = []
  try:
    for launch in launches:
      procs.append(popen(launch))
  except BaseException:
    for p in procs:  # Never half a learner.
      signal_group(p, signal.SIGKILL)
      p.wait(timeout=30)
    raise
  return ProcessUnit(procs, log_paths=[launch.log_path for launch in launches])


# -- the launcher's view of its children ----------------------------------------------------------


@dataclasses.dataclass
class Child:
  """A started subprocess (or a learner's `ProcessUnit`), its log and the metrics file the launcher
  tails (process 0's for a unit)."""

  name: str
  proc: subprocess.Popen | ProcessUnit
  log_path: str
  metrics_path: str
  offset: int = 0
  last: dict = dataclasses.field(default_factory=dict)  # Last train event.

  def poll_metrics(self) -> None:
    """Reads new complete lines of metrics.jsonl; keeps the last `train` event."""
    try:
      with open(self.metrics_path) as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return
    end = data.rfind("\n") + 1
    self.offset += end
    for line in data[:end].splitlines():
      try:
        ev = json.loads(line)
      except json.JSONDecodeError:
        continue
      if ev.get("kind") == "train":
        self.last = ev


def tail(child: Child, lines: int = 30) -> str:
  """The end of a child's log; for a failed unit, also that of the process that exited first."""
  paths = [child.log_path]
  unit = child.proc
  if isinstance(unit, ProcessUnit) and unit.first_exit not in (None, 0):
    paths.insert(0, unit.log_paths[unit.first_exit])
  out = []
  for path in paths:
    try:
      with open(path) as f:
        text = "".join(f.readlines()[-lines:])
    except FileNotFoundError:
      text = ""
    out.append(text if len(paths) == 1 else f"== {path} ==\n{text}")
  return "\n".join(out)


def kill(child: Child, *, timeout_s: float = 10.0) -> int | None:
  """SIGKILLs a child (a crash) and reaps it; returns its exit code (None if it did not go)."""
  signal_group(child.proc, signal.SIGCONT)  # A stopped process must not stay stopped in the kernel.
  signal_group(child.proc, signal.SIGKILL)
  try:
    return child.proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return None


def stop_in_order(groups: Sequence[Sequence[Child]], grace_s: float) -> None:
  """Stops the live children group by group: SIGTERM, then SIGKILL after `grace_s`. Idempotent."""
  for group in groups:
    live = [c for c in group if c.proc.poll() is None]
    for c in live:
      signal_group(c.proc, signal.SIGCONT)  # A paused (SIGSTOPped) child could not handle SIGTERM.
      signal_group(c.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in live:
      try:
        c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        signal_group(c.proc, signal.SIGKILL)
        c.proc.wait(timeout=10)


def terminate_all(children: Sequence[Child], what: str, *, timeout_s: float) -> None:
  """SIGTERMs every child's group at once, then waits for each.

  Raises:
    RuntimeError: `what` with the log's tail of a child that exited with a non-zero status.
  """
  for c in children:
    signal_group(c.proc, signal.SIGTERM)
  for c in children:
    c.proc.wait(timeout=timeout_s)
    if c.proc.returncode != 0:
      raise RuntimeError(f"{what}:\n{tail(c)}")


def remove_folders(workdir: str, prefixes: tuple[str, ...]) -> list[str]:
  """Removes the folders of `workdir` whose names start with one of `prefixes`; returns their names."""
  removed = []
  if not os.path.isdir(workdir):
    return removed
  for name in sorted(os.listdir(workdir)):
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and name.startswith(prefixes):
      shutil.rmtree(path)
      removed.append(name)
  return removed
