"""`LocalCluster`: one syncer and M learner subprocesses on 127.0.0.1, and their clean teardown.

Used by `ddiloco-local` and the integration tests. Children are started in their own session (so a
terminal's Ctrl-C reaches only the launcher, which then stops them in order) with PR_SET_PDEATHSIG
(so they die with the launcher even if it is SIGKILLed): launch/processes.py. `stop_all` sends
SIGTERM, waits, then SIGKILLs whatever is left.

Elastic scavenging (docs/algorithm.md §6): learners can join a running job (`add_learner`, with their own device
count, batch size and steps) and leave it again (`remove_learner`: SIGTERM, so the learner saves,
flushes, calls Leave and exits 0). `run` serves `ddiloco-fleet` requests (launch/fleet.py) from its
progress loop, ends when every learner still in the fleet has finished, and records every join and
leave in summary.json's "membership". An added learner with id m reads data shard m mod M (M =
JobConfig.num_learners): the shard of learner m mod M, so scavenged compute repeats data that the
fleet also reads (docs/resilience.md "Elastic scavenging (real processes)").

Multi-process learners (`JobConfig.processes_per_learner` = N > 1; docs/algorithm.md §1, a learner on a
multi-host slice): learner m is N `ddiloco-learner` processes joined by `jax.distributed` (a fresh
coordinator port per start), each with `devices_per_learner` fake CPU devices, process i writing to
`learner_m/process_i` (process 0 to `learner_m`). The learner is a unit (`processes.ProcessUnit`,
the `Child.proc` of the learner): signals reach all N, a failure takes all N down, and the unit's
exit code is 0 only if every process exited 0; restarts and removals then treat it as one learner.
Progress lines and summary.json read the leader's (process 0's) metrics and summary.
"""

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddiloco import storage
from ddiloco.launch import fleet as fleet_lib
from ddiloco.launch import processes
from ddiloco.launch.job import JobConfig
from ddiloco.launch.run_summary import plot, read_json, summarize
from ddiloco.metrics import progress as progress_fields


class RunInterrupted(KeyboardInterrupt):
  """Ctrl-C (SIGINT) stopped `LocalCluster.run`; `summary` is the partial run's, already written."""

  def __init__(self, summary: dict[str, Any]):
    super().__init__("interrupted")
    self.summary = summary


@dataclasses.dataclass
class Child:
  """A started subprocess (or a learner's `processes.ProcessUnit`), its log and the metrics file the launcher
  tails (process 0's for a unit)."""

  name: str
  proc: subprocess.Popen | processes.ProcessUnit
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


@dataclasses.dataclass
class FleetMember:
  """A learner of the fleet `run` manages, and where it is in its life.

  `state`: "running", "removing" (SIGTERM sent), "finished" (exited 0 on its own), "removed"
  (by `remove_learner`) or "failed" (an added learner that crashed; the job goes on without it).
  """

  learner_id: int
  devices: int
  batch_size: int | None  # None: the job's.
  steps: int | None  # None: the job's steps_per_learner.
  elastic: bool  # Added to a running job (its crash is not the job's failure).
  started: float  # time.time() at start.
  state: str = "running"
  exit_code: int | None = None
  remove_deadline: float | None = None  # Monotonic; SIGKILL after it.
  request_id: str | None = None  # A ddiloco-fleet request answered when the removal completes.

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    del out["remove_deadline"], out["request_id"]
    return out


class LocalCluster:
  """Starts, watches and stops a syncer and learners (see module docstring).

  Args:
    workdir: output folder; the syncer writes to workdir/syncer, learner i to workdir/learner_i.
    gin_args: gin flags forwarded to every child.
    num_learners: M.
    devices_per_learner: fake CPU devices per learner process.
    python: the interpreter for the children.
    extra_learner_args: flags for every learner, after the shared gin flags.
    processes_per_learner: processes forming each learner (module docstring).
    tls: (certificate chain, private key, CA) PEM files: the syncer serves TLS with the first two
      and the learners (and the launcher's own status calls) trust the CA. The certificate must
      name the address the learners dial (127.0.0.1 here; the head node's under Ray). None:
      plaintext, with the run's token.
  """

  def __init__(
    self,
    *,
    workdir: str,
    gin_args: Sequence[str],
    num_learners: int,
    devices_per_learner: int = 1,
    python: str = sys.executable,
    extra_learner_args: Sequence[str] = (),
    processes_per_learner: int = 1,
    tls: tuple[str, str, str] | None = None,
  ):
    processes.check_count("processes_per_learner", processes_per_learner)
    self.tls = None if tls is None else processes.tls_files(tls)
    storage.require_local(
      workdir, who="LocalCluster", why="it reads its programs' files while they run"
    )
    self.workdir = os.path.abspath(workdir)
    self.gin_args = list(gin_args)
    self.num_learners = num_learners
    self.devices_per_learner = devices_per_learner
    self.processes_per_learner = processes_per_learner
    self.python = python
    self.extra_learner_args = list(extra_learner_args)
    self.token = secrets.token_hex(16)
    self.syncer: Child | None = None
    self.learners: dict[int, Child] = {}
    self.port: int | None = None
    self.syncer_host = "127.0.0.1"  # Where learners and the launcher reach the syncer.
    self.fleet: dict[int, FleetMember] = {}  # The learners `run` started or `add_learner` added.
    self.membership: list[dict[str, Any]] = []  # Join/leave/finish/fail events, in order.
    self.job: JobConfig | None = None  # Set by `run`; lets `add_learner` check the batch size.
    self.control: fleet_lib.ControlServer | None = None  # ddiloco-fleet requests, while `run` runs.
    self.syncer_alive_at_end: list[int] | None = None
    self._t0 = time.time()

  # -- processes --------------------------------------------------------------------------------

  def _run_env(self, devices: int | None) -> dict[str, str]:
    """The variables this launcher sets for a program, over the environment it runs in."""
    env = {
      "DDILOCO_TOKEN": self.token,
      "JAX_PLATFORMS": "cpu",
      "JAX_COMPILATION_CACHE_DIR": os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", os.path.join(self.workdir, "jax_cache")
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

  def _env(self, devices: int | None) -> dict[str, str]:
    return {**os.environ, **self._run_env(devices)}

  def _spawn(
    self,
    name: str,
    module: str,
    args: Sequence[str],
    env: dict[str, str],
    overrides: Sequence[str] = (),
  ) -> Child:
    """Starts `module`; `overrides` come after the shared gin flags, so that they win there."""
    folder = os.path.join(self.workdir, name)
    log_path = os.path.join(folder, "log.txt")
    argv = ["-m", module, f"--workdir={folder}", *args, *self.gin_args, *overrides]
    role = "syncer" if name == "syncer" else "learner"
    proc = self._popen(processes.Launch(argv, env, log_path, role))
    return Child(name, proc, log_path, os.path.join(folder, "metrics.jsonl"))

  def _popen(self, launch: processes.Launch) -> subprocess.Popen:
    return processes.spawn(self.python, launch)

  def start_syncer(self, timeout_s: float = 180.0, *, port: int = 0) -> int:
    """Starts the syncer and waits until it serves; returns its port.

    A restart passes the previous `port` so that learners reconnect to the same address; the syncer
    restores its checkpoint from its workdir (docs/resilience.md).
    """
    self.spawn_syncer(port=port)
    deadline = time.monotonic() + timeout_s
    while not self.syncer_ready():
      if time.monotonic() > deadline:
        raise TimeoutError(
          f"The syncer did not serve within {timeout_s} s:\n{self.tail(self.syncer)}"
        )
      time.sleep(0.1)
    return self.port

  def spawn_syncer(self, *, port: int = 0) -> None:
    """Starts the syncer without waiting: `syncer_ready` tells when it serves (a chaos driver
    keeps its schedule meanwhile)."""
    port_file = self._port_file()
    if os.path.exists(port_file):
      os.remove(port_file)
    self.syncer = self._spawn(
      "syncer",
      "ddiloco.launch.syncer_main",
      [
        f"--port_file={port_file}",
        f"--host={self.syncer_host}",
        f"--port={port}",
        *([f"--tls_cert_file={self.tls[0]}", f"--tls_key_file={self.tls[1]}"] if self.tls else []),
      ],
      self._env(1),
    )

  def syncer_ready(self) -> bool:
    """Whether the syncer started by `spawn_syncer` serves; sets `port` when it does.

    Raises:
      RuntimeError: if it exited instead.
    """
    port_file = self._port_file()
    if not os.path.exists(port_file):
      if self.syncer.proc.poll() is not None:
        raise RuntimeError(
          f"The syncer exited with {self.syncer.proc.returncode}:\n{self.tail(self.syncer)}"
        )
      return False
    with open(port_file) as f:
      text = f.read()
    if not text.strip():
      return False  # Being written.
    self.port = int(text)
    return True

  def _port_file(self) -> str:
    return os.path.join(self.workdir, "syncer", "port")

  def start_learner(
    self,
    learner_id: int,
    *,
    extra_args: Sequence[str] = (),
    devices: int | None = None,
    address: str | None = None,
  ) -> Child:
    """Starts (or restarts) learner `learner_id` on `devices` fake CPU devices.

    Args:
      learner_id: its id; a restarted learner keeps its id, workdir and data shard.
      extra_args: flags for this learner only (e.g. `--gin_bindings=JobConfig.batch_size = 8`);
        they come last on its command line, after the shared gin flags, so their bindings win.
      devices: fake CPU devices (default `devices_per_learner`): fleets may be heterogeneous.
      address: where it reaches the syncer (default the syncer's port; a chaos proxy's otherwise).

    Returns:
      The learner's child; with `processes_per_learner` > 1 its `proc` is a `processes.ProcessUnit`.
    """
    name = f"learner_{learner_id}"
    launches = self.learner_launches(
      learner_id, extra_args=extra_args, devices=devices, address=address
    )
    if len(launches) == 1:
      proc = self._popen(launches[0])
    else:
      procs = []
      try:
        for launch in launches:
          procs.append(self._popen(launch))
      except BaseException:
        for p in procs:  # Never half a learner.
          processes.signal_group(p, signal.SIGKILL)
          p.wait(timeout=30)
        raise
      proc = processes.ProcessUnit(procs, log_paths=[launch.log_path for launch in launches])
    folder = os.path.join(self.workdir, name)
    child = Child(name, proc, launches[0].log_path, os.path.join(folder, "metrics.jsonl"))
    self.learners[learner_id] = child
    return child

  def learner_launches(
    self,
    learner_id: int,
    *,
    extra_args: Sequence[str] = (),
    devices: int | None = None,
    address: str | None = None,
  ) -> list[processes.Launch]:
    """The processes `start_learner` starts for learner `learner_id`: one, or one per process of
    a multi-process learner (process i's log in `learner_<id>/process_<i>`, where learner_main
    writes), all with the same flags plus their slice identity and a fresh coordinator port."""
    folder = os.path.join(self.workdir, f"learner_{learner_id}")
    argv = [
      "-m",
      "ddiloco.launch.learner_main",
      f"--workdir={folder}",
      f"--learner_id={learner_id}",
      f"--syncer_address={address or f'{self.syncer_host}:{self.port}'}",
      *([f"--tls_ca_file={self.tls[2]}"] if self.tls else []),
    ]
    tail = [*self.gin_args, *self.extra_learner_args, *extra_args]
    env = self._env(devices or self.devices_per_learner)
    n = self.processes_per_learner
    if n == 1:
      return [
        processes.Launch(
          [*argv, *tail], env, os.path.join(folder, "log.txt"), learner_id=learner_id
        )
      ]
    slice_args = [
      f"--num_processes={n}",
      f"--coordinator_address={self._coordinator_address(learner_id)}",
    ]
    return [
      processes.Launch(
        [*argv, *slice_args, f"--process_id={i}", *tail],
        env,
        os.path.join(folder, *([f"process_{i}"] if i else []), "log.txt"),
        learner_id=learner_id,
        process_index=i,
      )
      for i in range(n)
    ]

  def _coordinator_address(self, learner_id: int) -> str:
    """host:port of a multi-process learner's jax.distributed coordinator (its process 0), fresh
    at every start."""
    del learner_id  # Every process of every learner runs on this host.
    return f"127.0.0.1:{processes.free_port()}"

  # -- elastic membership (docs/algorithm.md §6 scavenging) ---------------------------------------------------

  def _record(self, event: str, learner_id: int, **fields: Any) -> None:
    now = time.time()
    head = {"t": round(now - self._t0, 3), "time": round(now, 3), "event": event}
    self.membership.append({**head, "learner_id": learner_id, **fields})

  def next_learner_id(self) -> int:
    """The smallest id above every id this cluster used (and M - 1) with no folder in the workdir.

    A folder would hold another learner's checkpoints, which a new learner must not restore.
    """
    i = max([self.num_learners - 1, *self.fleet, *self.learners]) + 1
    while os.path.exists(os.path.join(self.workdir, f"learner_{i}")):
      i += 1
    return i

  def _join(
    self,
    learner_id: int,
    *,
    devices: int,
    batch_size: int | None,
    steps: int | None,
    elastic: bool,
    extra_args: Sequence[str] = (),
  ) -> FleetMember:
    args = [f"--steps={steps}"] if steps is not None else []
    if batch_size is not None:  # Read by make_learner_worker through JobConfig.batch_size.
      args.append(f"--gin_bindings=JobConfig.batch_size = {batch_size}")
    self.start_learner(learner_id, extra_args=[*args, *extra_args], devices=devices)
    member = FleetMember(
      learner_id=learner_id,
      devices=devices,
      batch_size=batch_size,
      steps=steps,
      elastic=elastic,
      started=time.time(),
    )
    self.fleet[learner_id] = member
    self._record(
      "join", learner_id, devices=devices, batch_size=batch_size, steps=steps, elastic=elastic
    )
    return member

  def add_learner(
    self,
    *,
    learner_id: int | None = None,
    devices: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    extra_args: Sequence[str] = (),
  ) -> int:
    """Adds a learner to the running job (scavenging, docs/algorithm.md §6); returns its id.

    The new learner registers with the syncer, takes the current global fragments and trains
    until `steps` or `remove_learner`. Its crash is recorded, not raised: spare compute may vanish.

    Args:
      learner_id: its id (None: `next_learner_id()`); an id that left may come back, and then
        restores its own checkpoint from its folder (docs/resilience.md).
      devices: its fake CPU devices (default `devices_per_learner`).
      batch_size: its examples per step (default the job's); must split evenly over `devices`.
      steps: its inner steps (default the job's steps_per_learner).
      extra_args: more flags for this learner only.

    Raises:
      RuntimeError: if the syncer is not started.
      ValueError: on a bad number, an id already in the fleet, or a batch that does not split over
        the devices (nothing is started then).
    """
    if self.port is None:
      raise RuntimeError("Start the syncer before adding learners.")
    devices = self.devices_per_learner if devices is None else devices
    for name, value in (("devices", devices), ("batch_size", batch_size), ("steps", steps)):
      if value is not None:
        processes.check_count(name, value)
    if learner_id is None:
      learner_id = self.next_learner_id()
    elif isinstance(learner_id, bool) or not isinstance(learner_id, int) or learner_id < 0:
      raise ValueError(f"learner_id must be an integer >= 0, got {learner_id!r}.")
    member = self.fleet.get(learner_id)
    if member is not None and member.state in ("running", "removing"):
      raise ValueError(f"learner {learner_id} is already in the fleet ({member.state}).")
    child = self.learners.get(learner_id)
    if child is not None and child.proc.poll() is None:
      raise ValueError(f"learner {learner_id} is already running.")
    batch = batch_size or (self.job.learner_batch_size() if self.job is not None else None)
    total = devices * self.processes_per_learner  # The learner's mesh spans all its processes.
    if batch is not None and batch % total:
      where = f"{total} devices"
      if self.processes_per_learner > 1:
        where += f" ({self.processes_per_learner} processes x {devices})"
      raise ValueError(
        f"batch_size {batch} does not split over {where}: the batch is sharded along the "
        "learner's data axis."
      )
    self._join(
      learner_id,
      devices=devices,
      batch_size=batch_size,
      steps=steps,
      elastic=True,
      extra_args=extra_args,
    )
    return learner_id

  def begin_remove(
    self, learner_id: int, *, timeout_s: float = fleet_lib.DEFAULT_REMOVE_TIMEOUT_S
  ) -> FleetMember:
    """Sends SIGTERM to a running learner of the fleet; `run` (or `remove_learner`) reaps it.

    Raises:
      ValueError: if the learner is not running in the fleet (nothing is signalled).
    """
    member = self.fleet.get(learner_id)
    if member is None:
      known = ", ".join(str(i) for i in sorted(self.fleet)) or "none"
      raise ValueError(f"learner {learner_id} is not in the fleet (learners: {known}).")
    if member.state != "running":
      raise ValueError(f"learner {learner_id} is not running ({member.state}).")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    child = self.learners[learner_id]
    processes.signal_group(child.proc, signal.SIGCONT)  # A paused learner could not handle SIGTERM.
    processes.signal_group(
      child.proc, signal.SIGTERM
    )  # learner_main: stop after this step, save, Leave, exit 0.
    member.state = "removing"
    member.remove_deadline = time.monotonic() + timeout_s
    return member

  def _reap_removal(self, member: FleetMember) -> dict[str, Any] | None:
    """Completes a removal once the learner exited (SIGKILL past its deadline); None until then."""
    child = self.learners[member.learner_id]
    forced = False
    if child.proc.poll() is None:
      if time.monotonic() < member.remove_deadline:
        return None
      forced = True
      self.kill(child)
    rc = child.proc.poll()
    summary_path = os.path.join(os.path.dirname(child.log_path), "summary.json")
    # The summary is written after the Leave RPC: a fresh one means the learner left on its own.
    left = (
      rc == 0 and os.path.exists(summary_path) and os.path.getmtime(summary_path) >= member.started
    )
    member.state, member.exit_code = "removed", rc
    result = {"learner_id": member.learner_id, "exit_code": rc, "graceful": left, "forced": forced}
    if left:
      s = read_json(summary_path)
      result |= {"steps": s["steps"], "tokens": s["tokens"], "push_status": s["push_status"]}
    self._record("leave", member.learner_id, exit_code=rc, graceful=left, forced=forced)
    return result

  def remove_learner(
    self, learner_id: int, *, timeout_s: float = fleet_lib.DEFAULT_REMOVE_TIMEOUT_S
  ) -> dict[str, Any]:
    """Removes a learner gracefully and waits until it is gone (docs/algorithm.md §6: learners may leave).

    SIGTERM makes the learner finish its step, save a checkpoint, flush its pushes, call Leave
    (the syncer drops it from its membership at once) and exit 0; after `timeout_s` it is
    SIGKILLed (the syncer then drops it after `ServiceConfig.liveness_timeout_s`). Either way its
    exit is not a failure of the job.

    Returns:
      {"learner_id", "exit_code", "graceful" (it left and wrote its summary), "forced" (SIGKILL),
      and, if graceful, its "steps", "tokens" and "push_status"}.

    Raises:
      ValueError: if the learner is not running in the fleet.
    """
    member = self.begin_remove(learner_id, timeout_s=timeout_s)
    while (result := self._reap_removal(member)) is None:
      time.sleep(0.1)
    return result

  def check_fleet(self, progress: Callable[[str], None] | None = None, client=None) -> bool:
    """Reaps exits and removals; True when no learner of the fleet is running or leaving.

    With a syncer `client`, the answer to a ddiloco-fleet removal also says which learners the
    syncer lists alive right after it (a graceful leave is gone from there at once).

    Raises:
      RuntimeError: if a learner the job started with exited with an error.
    """
    for i, m in sorted(self.fleet.items()):
      if m.state == "running":
        rc = self.learners[i].proc.poll()
        if rc is None:
          continue
        m.exit_code = rc
        if rc == 0:
          m.state = "finished"
          self._record("finish", i, exit_code=0)
        elif m.elastic:
          m.state = "failed"
          self._record("fail", i, exit_code=rc)
          if progress is not None:
            tail = self.tail(self.learners[i], 10)
            progress(f"fleet: added learner {i} failed ({rc}), the job goes on:\n{tail}")
        else:
          raise RuntimeError(f"learner {i} exited with {rc}:\n{self.tail(self.learners[i])}")
      elif m.state == "removing":
        result = self._reap_removal(m)
        if result is not None:
          if client is not None:
            result["syncer_alive"] = self._syncer_alive(client)
          if progress is not None:
            progress(f"fleet: learner {i} removed: {result}")
          if m.request_id is not None and self.control is not None:
            self.control.respond(m.request_id, ok=True, result=result)
            m.request_id = None
    return not any(m.state in ("running", "removing") for m in self.fleet.values())

  def signal(self, child: Child, sig: int) -> None:
    """Sends `sig` to a child's process group (SIGKILL, SIGSTOP, SIGCONT, SIGTERM) if it runs."""
    processes.signal_group(child.proc, sig)

  def kill(self, child: Child, *, timeout_s: float = 10.0) -> int | None:
    """SIGKILLs a child (a crash) and reaps it; returns its exit code."""
    processes.signal_group(
      child.proc, signal.SIGCONT
    )  # A stopped process must not stay stopped in the kernel.
    processes.signal_group(child.proc, signal.SIGKILL)
    try:
      return child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      return None

  def clear_previous(self) -> list[str]:
    """Removes a previous run's process folders (state, checkpoints, logs); returns what it removed.

    The compile cache stays. Without this, a restarted syncer or learner resumes from the
    checkpoints it finds in its folder (docs/resilience.md).
    """
    removed = []
    if not os.path.isdir(self.workdir):
      return removed
    for name in sorted(os.listdir(self.workdir)):
      path = os.path.join(self.workdir, name)
      if os.path.isdir(path) and (name == "syncer" or name.startswith("learner_")):
        shutil.rmtree(path)
        removed.append(name)
    return removed

  def children(self) -> list[Child]:
    return [*self.learners.values(), *([self.syncer] if self.syncer else [])]

  def stop_all(self, grace_s: float = 15.0) -> None:
    """SIGTERM to every live child (learners first), then SIGKILL after `grace_s`. Idempotent."""
    for group in (list(self.learners.values()), [self.syncer] if self.syncer else []):
      live = [c for c in group if c.proc.poll() is None]
      for c in live:
        processes.signal_group(
          c.proc, signal.SIGCONT
        )  # A paused (SIGSTOPped) child could not handle SIGTERM.
        processes.signal_group(c.proc, signal.SIGTERM)
      deadline = time.monotonic() + grace_s
      for c in live:
        try:
          c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          processes.signal_group(c.proc, signal.SIGKILL)
          c.proc.wait(timeout=10)

  @staticmethod
  def tail(child: Child, lines: int = 30) -> str:
    """The end of a child's log; for a failed unit, also that of the process that exited first."""
    paths = [child.log_path]
    unit = child.proc
    if isinstance(unit, processes.ProcessUnit) and unit.first_exit not in (None, 0):
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

  # -- the whole run ----------------------------------------------------------------------------

  def run(
    self,
    job: JobConfig,
    *,
    timeout_s: float = 1800.0,
    progress_every_s: float = 2.0,
    progress: Callable[[str], None] | None = None,
    resume: bool = False,
    control: bool = True,
  ) -> dict[str, Any]:
    """Starts everything, waits for the fleet to finish, stops the syncer, summarizes.

    Unless `resume`, a previous run's folders in the workdir are removed first (`clear_previous`);
    with it, the syncer and learners restore their checkpoints from there. With `control`, the
    loop also serves `ddiloco-fleet` requests (launch/fleet.py); `progress` may call
    `add_learner` and `begin_remove` too. The run ends when every learner still in the fleet has
    finished; removed learners and crashed added ones are not waited for.

    Raises:
      RunInterrupted: on Ctrl-C (a KeyboardInterrupt), after everything was stopped and the partial
        run's summary.json and loss.png were written ("interrupted": true).
      RuntimeError: if the syncer or a learner the job started with fails (everything is stopped
        first).
      TimeoutError: after `timeout_s` (everything is stopped first).
    """
    from ddiloco.transport.client import SyncerClient

    t0 = self._t0 = time.time()
    self.job = job
    interrupted = False
    try:
      # The channel first: it refuses a second launcher on this workdir before anything is removed,
      # and requests made while the syncer starts wait rather than fail.
      if control:
        self.control = fleet_lib.ControlServer(self.workdir)
        self.control.open()
      if not resume:
        removed = self.clear_previous()
        if removed and progress is not None:
          progress(
            f"fresh run: removed the previous run's {', '.join(removed)} (--resume keeps them)"
          )
      self.start_syncer()
      for i in range(self.num_learners):
        self._join(i, devices=self.devices_per_learner, batch_size=None, steps=None, elastic=False)
      client = SyncerClient(
        f"{self.syncer_host}:{self.port}",
        token=self.token,
        tls_ca_file=self.tls[2] if self.tls else None,
        deadline_s=2.0,
      )
      deadline = time.monotonic() + timeout_s
      next_progress = 0.0
      while True:
        done = self.check_fleet(progress, client)
        if self.syncer.proc.poll() is not None:
          raise RuntimeError(f"The syncer exited early:\n{self.tail(self.syncer)}")
        if done:
          break
        if time.monotonic() > deadline:
          raise TimeoutError(f"The run did not finish within {timeout_s} s.")
        if self.control is not None:
          for request in self.control.poll():
            self._serve_request(request, client, progress)
        if progress is not None and time.monotonic() >= next_progress:
          progress(self.progress_line(client, t0))
          next_progress = time.monotonic() + progress_every_s
        time.sleep(0.2)
      self.syncer_alive_at_end = self._syncer_alive(client)
      client.close()
      processes.signal_group(
        self.syncer.proc, signal.SIGTERM
      )  # Graceful: flush merges, final eval, summary.
      self.syncer.proc.wait(timeout=300)
      if self.syncer.proc.returncode != 0:
        raise RuntimeError(f"The syncer failed at shutdown:\n{self.tail(self.syncer)}")
    except KeyboardInterrupt:
      interrupted = True
    finally:
      if self.control is not None:
        self.control.close()
        self.control = None
      self.stop_all()  # SIGTERM first: the syncer and learners write their summaries.
      if interrupted and progress is not None:
        progress("interrupted: every process stopped; summarizing the partial run")
    summary = summarize(
      self.workdir,
      job,
      num_learners=self.num_learners,
      wall_time_s=time.time() - t0,
      learner_ids=sorted(self.fleet),
      membership=self.membership,
      syncer_alive_at_end=self.syncer_alive_at_end,
      interrupted=interrupted,
    )
    plot(self.workdir, interrupted=interrupted)
    if interrupted:
      raise RunInterrupted(summary)
    return summary

  @staticmethod
  def _syncer_alive(client) -> list[int] | None:
    import grpc

    try:
      return [int(i) for i in client.status().alive]
    except grpc.RpcError:
      return None

  def fleet_status(self, client) -> dict[str, Any]:
    """What `ddiloco-fleet list` shows: the fleet, the syncer's membership, the events so far."""
    learners = []
    for i, m in sorted(self.fleet.items()):
      child = self.learners[i]
      child.poll_metrics()
      last = {"step": child.last.get("step"), "loss": child.last.get("loss")}
      learners.append({**m.to_json(), "pid": child.proc.pid, **last, "log": child.log_path})
    return {
      "learners": learners,
      "syncer_alive": self._syncer_alive(client),
      "membership": list(self.membership),
    }

  def _serve_request(
    self,
    request: fleet_lib.FleetRequest,
    client,
    progress: Callable[[str], None] | None,
  ) -> None:
    """Acts on one ddiloco-fleet request and answers it (a removal answers once it is done)."""
    control = self.control
    try:
      if request.action == "list":
        control.respond(request.id, ok=True, result=self.fleet_status(client))
      elif request.action == "add":
        i = self.add_learner(
          learner_id=request.learner_id,
          devices=request.devices,
          batch_size=request.batch_size,
          steps=request.steps,
          extra_args=[f"--gin_bindings={b}" for b in request.gin_bindings],
        )
        m = self.fleet[i]
        result = {
          "learner_id": i,
          "devices": m.devices,
          "batch_size": m.batch_size or self.job.learner_batch_size(),
          "steps": m.steps or self.job.steps_per_learner,
          "data_shard": i % self.job.num_learners,  # LearnerFactory.make_data.
          "log": self.learners[i].log_path,
        }
        if progress is not None:
          progress(f"fleet: added {result}")
        control.respond(request.id, ok=True, result=result)
      else:
        timeout = request.timeout_s or fleet_lib.DEFAULT_REMOVE_TIMEOUT_S
        member = self.begin_remove(request.learner_id, timeout_s=timeout)
        member.request_id = request.id  # Answered by check_fleet once the learner is gone.
        if progress is not None:
          progress(f"fleet: removing learner {request.learner_id} (SIGTERM)")
    except (ValueError, OSError) as e:  # Refused (or could not start): nothing changed.
      control.respond(request.id, ok=False, error=str(e))

  def progress_line(self, client, t0: float) -> str:
    import grpc

    try:
      st = client.status()
      hist = list(st.quorum_histogram)
      merges = int(sum(hist))
      mean_q = sum(q * n for q, n in enumerate(hist)) / merges if merges else 0.0
      head = (
        f"t={time.time() - t0:6.1f}s v_sum {sum(st.versions):4d} merges {st.merges:4d} "
        f"quorum {mean_q:.2f} alive {list(st.alive)}"
      )
    except grpc.RpcError as e:
      head = f"t={time.time() - t0:6.1f}s syncer {e.code().name}"
    parts, paces = [], []
    for i, c in sorted(self.learners.items()):
      member = self.fleet.get(i)
      if member is not None and member.state in ("removed", "failed"):
        parts.append(f"L{i}:{member.state}")
        continue
      c.poll_metrics()
      rc = c.proc.poll()
      state = "up" if rc is None else ("done" if rc == 0 else "down")
      if member is not None and member.state == "removing":
        state = "leaving"
      if not c.last:
        parts.append(f"L{i}:{state} starting")
      else:
        parts.append(progress_fields.learner(i, state, c.last.get("step"), c.last.get("loss")))
      if rc is None:
        paces.append(self._pace(c, member))
    if paces and None not in paces:
      steps_per_s = sum(p[0] for p in paces)
      rates = progress_fields.throughput(
        steps_per_s, sum(p[1] for p in paces), max(p[2] for p in paces)
      )
    else:  # A running learner is still compiling (or none runs): the fleet's pace is unknown.
      rates = progress_fields.throughput(None, None, None)
    return f"{head} | {rates} | " + " ".join(parts)

  def _pace(self, child: Child, member: FleetMember | None) -> tuple[float, float, float] | None:
    """A running learner's (steps/s, tokens/s, seconds left), from the step time it logged over its
    last steps; None while that is unknown (no train event yet, or 0 while it compiles)."""
    step_time = child.last.get("step_time_s") or 0.0
    if step_time <= 0 or self.job is None:
      return None
    target = (member.steps if member else None) or self.job.steps_per_learner
    batch = (member.batch_size if member else None) or self.job.batch_size
    left = max(0, target - child.last.get("step", 0)) * step_time
    return 1.0 / step_time, self.job.the_task().units_per_step(batch) / step_time, left
