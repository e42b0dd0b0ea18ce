"""`LearnerFleet`: the learners a local run manages, as they join, leave, finish or fail.

Elastic scavenging (docs/algorithm.md §6): learners can join a running job (`LearnerFleet.add`,
with their own device count, batch size and steps) and leave it again (`LearnerFleet.begin_remove`:
SIGTERM, so the learner saves, flushes, calls Leave and exits 0; `LearnerFleet.check` reaps it,
SIGKILLing it past its deadline). Every join, leave, finish and failure is an event of
`LearnerFleet.membership`, which summary.json keeps as "membership". Learner m reads data slot
m mod S (S = `RunConfig.the_data_slots()`, num_learners unless `data_slots` leaves room for
joiners): an added learner below S reads data no other learner reads, one beyond shares the slot
of learner m mod S and repeats what it reads (logged; its join event says `data_slot` and
`shares_data`; docs/resilience.md "Elastic scavenging (real processes)"). A learner the job
started with that fails fails the job; an added one that fails is recorded and the job goes on.

The fleet starts learners through the cluster that owns it (launch/local_cluster.py, whose
`start_learner` a backend may place elsewhere) and watches them as `processes.Child`ren. The
`ddiloco-fleet` command's channel is launch/fleet.py; launch/fleet_requests.py answers its requests.
"""

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddiloco.launch import fleet as fleet_lib
from ddiloco.launch import processes
from ddiloco.launch.job import JobConfig
from ddiloco.launch.run_summary import read_json

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FleetMember:
  """A learner of the fleet, and where it is in its life.

  `state`: "running", "removing" (SIGTERM sent), "finished" (exited 0 on its own), "removed"
  (by a removal) or "failed" (an added learner that crashed; the job goes on without it).
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


def syncer_alive(client) -> list[int] | None:
  """The learners the syncer lists alive; None if it does not answer."""
  import grpc

  try:
    return [int(i) for i in client.status().alive]
  except grpc.RpcError:
    return None


class LearnerFleet:
  """The learners of a run: their joins, removals and exits (module docstring).

  Args:
    workdir: the run's folder; learner i's is workdir/learner_i.
    num_learners: M, the learners the job starts with (ids 0 to M - 1).
    devices_per_learner: fake CPU devices per learner process, unless a learner says otherwise.
    processes_per_learner: processes forming each learner (its mesh spans all of them).
    learners: the cluster's learner children by id, the same dict the cluster's `start_learner`
      fills (read here, never rebound).
    start_learner: starts (or restarts) a learner: `start_learner(learner_id, extra_args=...,
      devices=...)`, the cluster's method.

  Attributes:
    members: the learners the run started or `add` added, by id.
    membership: join/leave/finish/fail events, in order, timed from `t0`.
    job: the job being run (set by the run): the default batch size and steps of a member.
    t0: time.time() the events' "t" counts from (the run's start).
  """

  def __init__(
    self,
    *,
    workdir: str,
    num_learners: int,
    devices_per_learner: int,
    processes_per_learner: int,
    learners: Mapping[int, processes.Child],
    start_learner: Callable[..., processes.Child],
  ):
    self.workdir = workdir
    self.num_learners = num_learners
    self.devices_per_learner = devices_per_learner
    self.processes_per_learner = processes_per_learner
    self.learners = learners
    self._start_learner = start_learner
    self.members: dict[int, FleetMember] = {}
    self.membership: list[dict[str, Any]] = []
    self.job: JobConfig | None = None
    self.t0 = time.time()

  def record(self, event: str, learner_id: int, **fields: Any) -> None:
    """Appends a membership event (learner_id -1: the syncer)."""
    now = time.time()
    head = {"t": round(now - self.t0, 3), "time": round(now, 3), "event": event}
    self.membership.append({**head, "learner_id": learner_id, **fields})

  def next_learner_id(self) -> int:
    """The smallest id above every id this fleet used (and M - 1) with no folder in the workdir.

    A folder would hold another learner's checkpoints, which a new learner must not restore.
    """
    i = max([self.num_learners - 1, *self.members, *self.learners]) + 1
    while os.path.exists(os.path.join(self.workdir, f"learner_{i}")):
      i += 1
    return i

  def join(
    self,
    learner_id: int,
    *,
    devices: int,
    batch_size: int | None,
    steps: int | None,
    elastic: bool,
    extra_args: Sequence[str] = (),
  ) -> FleetMember:
    """Starts a learner and records it as a running member (no checks: `add` makes them); its
    join event says its data slot and whether a learner the run started with reads it too."""
    # This learner's own bindings, after the run's: its make_learner_worker reads them.
    args = []
    if steps is not None:
      args.append(f"--gin_bindings=RunConfig.steps_per_learner = {steps}")
    if batch_size is not None:
      args.append(f"--gin_bindings=RunConfig.batch_size = {batch_size}")
    self._start_learner(learner_id, extra_args=[*args, *extra_args], devices=devices)
    member = FleetMember(
      learner_id=learner_id,
      devices=devices,
      batch_size=batch_size,
      steps=steps,
      elastic=elastic,
      started=time.time(),
    )
    self.members[learner_id] = member
    slots = self.job.run.the_data_slots() if self.job is not None else self.num_learners
    slot, shares = learner_id % slots, learner_id >= slots
    if shares:
      log.warning(
        "learner %d reads data slot %d, which learner %d reads too: set RunConfig.data_slots "
        "above %d to give learners that join data of their own.",
        learner_id,
        slot,
        slot,
        learner_id,
      )
    self.record(
      "join",
      learner_id,
      devices=devices,
      batch_size=batch_size,
      steps=steps,
      elastic=elastic,
      data_slot=slot,
      shares_data=shares,
    )
    return member

  def add(
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
    until `steps` or a removal. Its crash is recorded, not raised: spare compute may vanish.

    Args:
      learner_id: its id (None: `next_learner_id()`); an id that left may come back, and then
        restores its own checkpoint from its folder (docs/resilience.md).
      devices: its fake CPU devices (default `devices_per_learner`).
      batch_size: its examples per step (default the job's); must split evenly over `devices`.
      steps: its inner steps (default the job's steps_per_learner).
      extra_args: more flags for this learner only.

    Raises:
      ValueError: on a bad number, an id already in the fleet, or a batch that does not split over
        the devices (nothing is started then).
    """
    devices = self.devices_per_learner if devices is None else devices
    for name, value in (("devices", devices), ("batch_size", batch_size), ("steps", steps)):
      if value is not None:
        processes.check_count(name, value)
    if learner_id is None:
      learner_id = self.next_learner_id()
    elif isinstance(learner_id, bool) or not isinstance(learner_id, int) or learner_id < 0:
      raise ValueError(f"learner_id must be an integer >= 0, got {learner_id!r}.")
    member = self.members.get(learner_id)
    if member is not None and member.state in ("running", "removing"):
      raise ValueError(f"learner {learner_id} is already in the fleet ({member.state}).")
    child = self.learners.get(learner_id)
    if child is not None and child.proc.poll() is None:
      raise ValueError(f"learner {learner_id} is already running.")
    batch = batch_size or (self.job.run.learner_batch_size() if self.job is not None else None)
    total = devices * self.processes_per_learner  # The learner's mesh spans all its processes.
    if batch is not None and batch % total:
      where = f"{total} devices"
      if self.processes_per_learner > 1:
        where += f" ({self.processes_per_learner} processes x {devices})"
      raise ValueError(
        f"batch_size {batch} does not split over {where}: the batch is sharded along the "
        "learner's data axis."
      )
    self.join(
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
    """Sends SIGTERM to a running learner of the fleet; `check` (or `remove`) reaps it.

    Raises:
      ValueError: if the learner is not running in the fleet (nothing is signalled).
    """
    member = self.members.get(learner_id)
    if member is None:
      known = ", ".join(str(i) for i in sorted(self.members)) or "none"
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

  def reap_removal(self, member: FleetMember) -> dict[str, Any] | None:
    """Completes a removal once the learner exited (SIGKILL past its deadline); None until then."""
    child = self.learners[member.learner_id]
    forced = False
    if child.proc.poll() is None:
      if time.monotonic() < member.remove_deadline:
        return None
      forced = True
      processes.kill(child)
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
    self.record("leave", member.learner_id, exit_code=rc, graceful=left, forced=forced)
    return result

  def remove(
    self, learner_id: int, *, timeout_s: float = fleet_lib.DEFAULT_REMOVE_TIMEOUT_S
  ) -> dict[str, Any]:
    """Removes a learner gracefully and waits until it is gone (docs/algorithm.md §6: learners may
    leave).

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
    while (result := self.reap_removal(member)) is None:
      time.sleep(0.1)
    return result

  def check(
    self,
    progress: Callable[[str], None] | None = None,
    client=None,
    control: fleet_lib.ControlServer | None = None,
  ) -> bool:
    """Reaps exits and removals; True when no learner of the fleet is running or leaving.

    Args:
      progress: where fleet events are said, if anywhere.
      client: the syncer's; with it, the answer to a removal also says which learners the syncer
        lists alive right after it (a graceful leave is gone from there at once).
      control: the channel a removal requested through `ddiloco-fleet` is answered on.

    Raises:
      RuntimeError: if a learner the job started with exited with an error.
    """
    for i, m in sorted(self.members.items()):
      if m.state == "running":
        rc = self.learners[i].proc.poll()
        if rc is None:
          continue
        m.exit_code = rc
        if rc == 0:
          m.state = "finished"
          self.record("finish", i, exit_code=0)
        elif m.elastic:
          m.state = "failed"
          self.record("fail", i, exit_code=rc)
          if progress is not None:
            tail = processes.tail(self.learners[i], 10)
            progress(f"fleet: added learner {i} failed ({rc}), the job goes on:\n{tail}")
        else:
          raise RuntimeError(f"learner {i} exited with {rc}:\n{processes.tail(self.learners[i])}")
      elif m.state == "removing":
        result = self.reap_removal(m)
        if result is not None:
          if client is not None:
            result["syncer_alive"] = syncer_alive(client)
          if progress is not None:
            progress(f"fleet: learner {i} removed: {result}")
          if m.request_id is not None and control is not None:
            control.respond(m.request_id, ok=True, result=result)
            m.request_id = None
    return not any(m.state in ("running", "removing") for m in self.members.values())
