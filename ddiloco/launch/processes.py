"""Child processes of the local launchers: started with PR_SET_PDEATHSIG, grouped into learners.

`Launch` is one process to start. `spawn` starts it in its own session (a terminal's Ctrl-C reaches
only the launcher, which then stops its children in order) with PR_SET_PDEATHSIG (so it dies with
the launcher even if that is SIGKILLed). `ProcessUnit` holds the N processes of a multi-process
learner (docs/algorithm.md §1, a learner on a multi-host slice) and acts as one Popen: `signal_group` reaches all
N; once one exits with an error or is killed, the rest are SIGKILLed at once (a process waiting in
a collective for a dead peer would hang forever), and once one exits 0 the others get
`ProcessUnit.exit_grace_s` to finish too. Used by launch/local_cluster.py.
"""

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
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


def free_port() -> int:
  """A port free on 127.0.0.1 now (a learner's jax.distributed coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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
