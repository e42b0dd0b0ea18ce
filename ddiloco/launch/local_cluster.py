"""`LocalCluster`: one syncer and M learner subprocesses on 127.0.0.1, and their clean teardown.

Used by `ddiloco-local` and the integration tests. The cluster starts the job's programs (their
command lines, environments and ports) and `run`s the job; the rest it composes:

- launch/processes.py: child processes, started in their own session (so a terminal's Ctrl-C
  reaches only the launcher, which then stops them in order) with PR_SET_PDEATHSIG (so they die
  with the launcher even if it is SIGKILLed), and watched as `Child`ren. `stop_all` sends SIGTERM,
  waits, then SIGKILLs whatever is left.
- launch/elastic.py: `fleet`, the learners `run` manages as they join and leave (elastic
  scavenging, docs/algorithm.md §6; `add_learner`, `remove_learner`), with summary.json's
  "membership". `run` ends when every learner still in the fleet has finished.
- launch/fleet_requests.py: the `ddiloco-fleet` requests `run` serves from its loop.
- launch/progress_lines.py: the line `run` reports every few seconds.

Multi-process learners (`JobConfig.processes_per_learner` = N > 1; docs/algorithm.md §1, a learner
on a multi-host slice): learner m is N `ddiloco-learner` processes joined by `jax.distributed`
(`learner_launches`), held as one `processes.ProcessUnit` (its `Child.proc`), so that restarts and
removals treat it as one learner; progress lines and summary.json read process 0's files.

Where and how each program runs is its `backend`'s (launch/backend.py): `LocalProcesses`, child
processes of this launcher, unless another is given (`RayBackend`, launch/ray_cluster.py).
"""

import contextlib
import os
import pathlib
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddiloco import storage
from ddiloco.launch import elastic, fleet_requests, processes, progress_lines, syncer_shards
from ddiloco.launch import fleet as fleet_lib
from ddiloco.launch.backend import LocalProcesses, ProgramBackend
from ddiloco.launch.job import JobConfig
from ddiloco.launch.processes import Child
from ddiloco.launch.run_summary import plot, summarize


class RunInterrupted(KeyboardInterrupt):
  """Ctrl-C (SIGINT) stopped `LocalCluster.run`; `summary` is the partial run's, already written."""

  def __init__(self, summary: dict[str, Any]):
    super().__init__("interrupted")
    self.summary = summary


class LocalCluster:
  """Starts, watches and stops a syncer and learners (see module docstring).

  Args:
    workdir: output folder; the syncer writes to workdir/syncer, learner i to workdir/learner_i.
    gin_args: gin flags forwarded to every child.
    num_learners: M.
    devices_per_learner: fake CPU devices per learner process.
    python: the interpreter for the children (of the default backend).
    extra_learner_args: flags for every learner, after the shared gin flags.
    processes_per_learner: processes forming each learner (module docstring).
    tls: (certificate chain, private key, CA) PEM files: the syncer serves TLS with the first two
      and the learners (and the launcher's own status calls) trust the CA. The certificate must
      name the address the learners dial (127.0.0.1 here; the head node's under Ray). None:
      plaintext, with the run's token.
    backend: where and how the programs run (launch/backend.py); default `LocalProcesses(python)`.
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
    backend: ProgramBackend | None = None,
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
    self.backend: ProgramBackend = backend or LocalProcesses(python)
    self.extra_learner_args = list(extra_learner_args)
    self.token = secrets.token_hex(16)
    self.syncer: Child | None = None
    self.shards: dict[int, Child] = {}  # Shards 1.. of a sharded syncer (JobConfig.syncer_shards).
    self.shard_ports: list[int] = []
    self.shard_addresses: list[str] = []  # Advertised instead of the shards' own (chaos proxies).
    self.bulk_ports: list[tuple[int, int]] = []  # Per shard (bound, advertised): chaos proxies.
    self.learners: dict[int, Child] = {}  # Shared with `fleet`: filled in place, never rebound.
    self._starts: dict[int, dict[str, Any]] = {}  # start_learner's arguments, per learner.
    self.port: int | None = None
    self.syncer_host = "127.0.0.1"  # Where learners and the launcher reach the syncer.
    # The learners `run` started or `add_learner` added, their events, and the job (set by `run`).
    self.fleet = elastic.LearnerFleet(
      workdir=self.workdir,
      num_learners=num_learners,
      devices_per_learner=devices_per_learner,
      processes_per_learner=processes_per_learner,
      learners=self.learners,
      start_learner=self.start_learner,
    )
    self.control: fleet_lib.ControlServer | None = None  # ddiloco-fleet requests, while `run` runs.
    self.syncer_alive_at_end: list[int] | None = None

  # -- starting programs ------------------------------------------------------------------------

  def _env(self, devices: int | None) -> dict[str, str]:
    """A program's environment: the variables this launcher sets, as its backend passes them."""
    return self.backend.environment(processes.run_env(self.token, self.workdir, devices))

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
    role = "syncer" if name.startswith("syncer") else "learner"
    proc = self.backend.start(processes.Launch(argv, env, log_path, role))
    return Child(name, proc, log_path, os.path.join(folder, "metrics.jsonl"))

  def start_syncer(self, timeout_s: float = 180.0, *, port: int = 0, shard: int = 0) -> int:
    """Starts the syncer (or one shard of it) and waits until it serves; returns its port. A
    restart passes the previous `port` so that learners reconnect to the same address; the syncer
    restores its checkpoint from its workdir (docs/resilience.md)."""
    self.spawn_syncer(port=port, shard=shard)
    return self.wait_syncer(timeout_s, shard=shard)

  def wait_syncer(self, timeout_s: float = 180.0, *, shard: int = 0) -> int:
    """Waits until a syncer shard started by `spawn_syncer` serves; returns its port."""
    deadline = time.monotonic() + timeout_s
    while not self.syncer_ready(shard):
      if time.monotonic() > deadline:
        log = self.tail(self.syncer_child(shard))
        raise TimeoutError(f"The syncer did not serve within {timeout_s} s:\n{log}")
      time.sleep(0.1)
    return self.shard_ports[shard] if self.shard_ports else self.port

  def start_syncers(self, num_shards: int, timeout_s: float = 180.0) -> None:
    """Starts the syncer, or its `num_shards` shards on ports its backend chooses, and waits for
    all."""
    if num_shards > 1:
      self.syncer_host, self.shard_ports = self.backend.syncer_shards(
        self.syncer_host, self.shard_ports, num_shards
      )
    for shard in range(num_shards):
      self.spawn_syncer(shard=shard)
    [self.wait_syncer(timeout_s, shard=shard) for shard in range(num_shards)]

  def syncer_child(self, shard: int = 0) -> Child:
    return self.syncer if shard == 0 else self.shards[shard]

  def spawn_syncer(self, *, port: int = 0, shard: int = 0) -> None:
    """Starts the syncer (or shard `shard` of it) without waiting: `syncer_ready` tells when it
    serves (a chaos driver keeps its schedule meanwhile)."""
    port_file = self._port_file(shard)
    with contextlib.suppress(FileNotFoundError):
      os.remove(port_file)
    own = [f"{self.syncer_host}:{p}" for p in self.shard_ports]
    addresses = ",".join(self.shard_addresses or own)  # For learners to learn at Register.
    sharded = [f"--shard={shard}", f"--shard_addresses={addresses}"] if self.shard_ports else []
    bulk = self.bulk_ports[shard] if self.bulk_ports else None  # Kept across restarts.
    if (
      port == 0 and not self.shard_ports
    ):  # The first start: the backend's port (restarts keep it).
      self.syncer_host, port = self.backend.syncer_port(self.syncer_host, port)
    sharded += [f"--bulk_port={bulk[0]}", f"--advertise_bulk_port={bulk[1]}"] if bulk else []
    port = port or (self.shard_ports[shard] if self.shard_ports else 0)
    child = self._spawn(
      "syncer" if shard == 0 else f"syncer_{shard}",
      "ddiloco.launch.syncer_main",
      [
        f"--port_file={port_file}",
        f"--host={self.syncer_host}",
        f"--port={port}",
        *sharded,
        *([f"--tls_cert_file={self.tls[0]}", f"--tls_key_file={self.tls[1]}"] if self.tls else []),
      ],
      self._env(1),
    )
    self.shards[shard] = child
    self.syncer = self.shards.pop(0, self.syncer)

  def syncer_ready(self, shard: int = 0) -> bool:
    """Whether the syncer (shard) started by `spawn_syncer` serves; sets `port` when shard 0 does.

    Raises:
      RuntimeError: if it exited instead.
    """
    port_file, child = self._port_file(shard), self.syncer_child(shard)
    text = pathlib.Path(port_file).read_text() if os.path.exists(port_file) else ""
    if not text.strip():  # Not written yet, or being written.
      if child.proc.poll() is not None:
        raise RuntimeError(f"The syncer exited with {child.proc.returncode}:\n{self.tail(child)}")
      return False
    if shard == 0:
      self.port = int(text)
    return True

  def _port_file(self, shard: int = 0) -> str:
    return os.path.join(self.workdir, "syncer" if shard == 0 else f"syncer_{shard}", "port")

  def syncers(self) -> list[Child]:  # The syncer's processes: one, or one per shard.
    return [*([self.syncer] if self.syncer else []), *self.shards.values()]

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
      extra_args: flags for this learner only (e.g. `--gin_bindings=RunConfig.batch_size = 8`);
        they come last on its command line, after the shared gin flags, so their bindings win.
      devices: fake CPU devices (default `devices_per_learner`): fleets may be heterogeneous.
      address: where it reaches the syncer (default the syncer's port; a chaos proxy's otherwise).

    Returns:
      The learner's child; with `processes_per_learner` > 1 its `proc` is a `processes.ProcessUnit`.
    """
    self._starts[learner_id] = {"extra_args": extra_args, "devices": devices, "address": address}
    name = f"learner_{learner_id}"
    launches = self.learner_launches(
      learner_id, extra_args=extra_args, devices=devices, address=address
    )
    proc = processes.start_unit(launches, self.backend.start)
    folder = os.path.join(self.workdir, name)
    child = Child(name, proc, launches[0].log_path, os.path.join(folder, "metrics.jsonl"))
    self.learners[learner_id] = child
    return child

  def restart_learner(self, learner_id: int) -> Child:
    """Starts learner `learner_id` again as `start_learner` last started it."""
    return self.start_learner(learner_id, **self._starts[learner_id])

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
      log = os.path.join(folder, "log.txt")
      return [processes.Launch([*argv, *tail], env, log, learner_id=learner_id)]
    slice_args = [
      f"--num_processes={n}",
      f"--coordinator_address={self.backend.coordinator_address(learner_id, n)}",
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

  # -- the learners' fleet (launch/elastic.py) --------------------------------------------------

  def add_learner(
    self,
    *,
    learner_id: int | None = None,
    devices: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    extra_args: Sequence[str] = (),
  ) -> int:
    """Adds a learner to the running job once the syncer serves; returns its id
    (`LearnerFleet.add`).

    Raises:
      RuntimeError: if the syncer is not started.
      ValueError: as `LearnerFleet.add` (nothing is started then).
    """
    if self.port is None:
      raise RuntimeError("Start the syncer before adding learners.")
    return self.fleet.add(
      learner_id=learner_id,
      devices=devices,
      batch_size=batch_size,
      steps=steps,
      extra_args=extra_args,
    )

  def check_fleet(self, progress: Callable[[str], None] | None = None, client=None) -> bool:
    """Lets the backend supervise its programs (`ProgramBackend.supervise`), then reaps exits and
    removals, answering removals asked for on `control`; True when no learner of the fleet is
    running or leaving (`LearnerFleet.check`).

    Raises:
      RuntimeError: if a learner the job started with exited with an error.
    """
    self.backend.supervise(self, progress)
    return self.fleet.check(progress, client, self.control)

  # -- watching and stopping children (launch/processes.py) --------------------------------------

  def signal(self, child: Child, sig: int) -> None:
    """Sends `sig` to a child's process group (SIGKILL, SIGSTOP, SIGCONT, SIGTERM) if it runs."""
    processes.signal_group(child.proc, sig)

  def kill(self, child: Child, *, timeout_s: float = 10.0) -> int | None:
    """SIGKILLs a child (a crash) and reaps it; returns its exit code."""
    return processes.kill(child, timeout_s=timeout_s)

  def clear_previous(self) -> list[str]:
    """Removes a previous run's process folders (state, checkpoints, logs); returns what it removed.

    The compile cache stays. Without this, a restarted syncer or learner resumes from the
    checkpoints it finds in its folder (docs/resilience.md).
    """
    return processes.remove_folders(self.workdir, ("syncer", "learner_"))

  def children(self) -> list[Child]:
    return [*self.learners.values(), *self.syncers()]

  def stop_all(self, grace_s: float = 15.0) -> None:
    """SIGTERM to every live child (learners first), then SIGKILL after `grace_s`; then the backend
    frees what it held for them (`ProgramBackend.release`). Idempotent."""
    try:
      processes.stop_in_order([list(self.learners.values()), self.syncers()], grace_s)
    finally:
      self.backend.release()

  @staticmethod
  def tail(child: Child, lines: int = 30) -> str:
    """The end of a child's log (`processes.tail`)."""
    return processes.tail(child, lines)

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
    `add_learner` and `fleet.begin_remove` too. The run ends when every learner still in the fleet has
    finished; removed learners and crashed added ones are not waited for.

    Raises:
      RunInterrupted: on Ctrl-C (a KeyboardInterrupt), after everything was stopped and the partial
        run's summary.json and loss.png were written ("interrupted": true).
      RuntimeError: if the syncer or a learner the job started with fails (everything is stopped
        first).
      TimeoutError: after `timeout_s` (everything is stopped first).
    """
    from ddiloco.transport.client import SyncerClient

    t0 = self.fleet.t0 = time.time()
    self.fleet.job = job
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
      self.start_syncers(job.syncer_shards)
      for i in range(self.num_learners):
        self.fleet.join(
          i, devices=self.devices_per_learner, batch_size=None, steps=None, elastic=False
        )
      client = syncer_shards.status_client(
        [f"{self.syncer_host}:{p}" for p in self.shard_ports or [self.port]],
        lambda address: SyncerClient(
          address, token=self.token, tls_ca_file=self.tls[2] if self.tls else None, deadline_s=2.0
        ),
      )
      deadline = time.monotonic() + timeout_s
      next_progress = 0.0
      while True:
        done = self.check_fleet(progress, client)
        for c in self.syncers():
          if c.proc.poll() is not None:
            raise RuntimeError(f"The syncer exited early:\n{self.tail(c)}")
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
      self.syncer_alive_at_end = elastic.syncer_alive(client)
      client.close()
      # Graceful: flush merges, final eval, summary.
      processes.terminate_all(self.syncers(), "The syncer failed at shutdown", timeout_s=300)
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
      learner_ids=sorted(self.fleet.members),
      membership=self.fleet.membership,
      syncer_alive_at_end=self.syncer_alive_at_end,
      interrupted=interrupted,
    )
    plot(self.workdir, interrupted=interrupted)
    if interrupted:
      raise RunInterrupted(summary)
    return summary

  def _serve_request(
    self,
    request: fleet_lib.FleetRequest,
    client,
    progress: Callable[[str], None] | None,
  ) -> None:
    """Acts on one ddiloco-fleet request and answers it (a removal answers once it is done)."""
    fleet_requests.serve_request(
      request,
      control=self.control,
      fleet=self.fleet,
      add_learner=self.add_learner,
      client=client,
      progress=progress,
    )

  def progress_line(self, client, t0: float) -> str:
    """The progress line `run` reports (launch/progress_lines.py)."""
    return progress_lines.progress_line(client, t0, learners=self.learners, fleet=self.fleet)
