"""`ChaosRun`: a `LocalCluster` driven through a fault schedule, recorded on an event tape.

The driver starts the syncer, a loopback proxy in front of it (learners reach the syncer only
through the proxy, so network faults hit them) and M learners; then it executes the schedule of
`ddiloco.chaos.schedule.make_schedule` at its times: SIGKILL and restart learners (a restarted
learner registers again and takes the global fragments; it restores its own checkpoint once learner
checkpoints land, docs/resilience.md), SIGSTOP/SIGCONT them, SIGKILL and restart the syncer on the
same port (it restores its checkpoint and journal), and delay, drop or partition the network. It
tails the syncer's metrics for merges and evaluations and writes everything to `tape.jsonl`. When
every learner has finished it stops the syncer gracefully, records final digests and the ledger, and
checks the invariants (`ddiloco.chaos.invariants`).
"""

import dataclasses
import json
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from ddiloco.chaos import invariants, replay
from ddiloco.chaos.proxy_process import ProxyProcess
from ddiloco.chaos.schedule import ChaosConfig, make_schedule
from ddiloco.chaos.tape import TapeWriter, read_tape
from ddiloco.checkpoint import syncer as syncer_ckpt
from ddiloco.faults import NETWORK_KINDS, FaultEvent, check_supported
from ddiloco.launch.job import JobConfig
from ddiloco.launch.local_cluster import LocalCluster
from ddiloco.launch.processes import Child


class _Tail:
  """Reads the complete new lines of a JSONL file (a process's metrics.jsonl) as it grows."""

  def __init__(self, path: str):
    self.path = path
    self.offset = 0

  def read(self) -> list[dict]:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return []
    end = data.rfind(b"\n") + 1
    self.offset += end
    out = []
    for line in data[:end].splitlines():
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
    return out


class _Fired(NamedTuple):
  """An executed fault: extra fields for its tape record, and the record that follows it."""

  fields: dict[str, Any] = {}
  then: tuple[str, dict[str, Any]] | None = None


_GRPC_ONLY = "--gin_bindings=ServiceConfig.bulk = False"


class ChaosRun:
  """One chaos run (see module docstring).

  Args:
    job: the run's JobConfig (M, steps, syncer K).
    chaos: the fault schedule's config.
    cluster: a LocalCluster for the run's workdir (not started).
    progress: called with a line now and then.
  """

  def __init__(
    self,
    job: JobConfig,
    chaos: ChaosConfig,
    cluster: LocalCluster,
    *,
    progress: Callable[[str], None] | None = None,
  ):
    self.job, self.chaos, self.cluster = job, chaos, cluster
    if job is not None and job.syncer_shards > 1:  # Its proxy, kills and checks know one syncer.
      raise ValueError("ddiloco-chaos runs one syncer process: JobConfig.syncer_shards must be 1.")
    self.progress = progress or (lambda line: None)
    self.schedule: list[FaultEvent] = make_schedule(chaos, cluster.num_learners)
    self.tape_path = os.path.join(cluster.workdir, "tape.jsonl")
    self.proxy: ProxyProcess | None = None
    self._wall0 = 0.0
    self._killed: set[int] = set()  # Learners down by our hand, waiting for their restart.
    self._done: dict[int, int] = {}
    self._syncer_down = False
    self._syncer_starting = False  # Spawned by the schedule, not serving yet.
    self._tape: TapeWriter | None = None
    self._handlers = {
      "kill_learner": self._kill_learner,
      "start_learner": self._start_learner_event,
      "pause_learner": self._signal_learner,
      "resume_learner": self._signal_learner,
      "kill_syncer": self._kill_syncer,
      "start_syncer": self._start_syncer,
      **{kind: self._net for kind in NETWORK_KINDS},
    }
    self.kinds = frozenset(self._handlers)  # ddiloco.faults.FaultExecutor
    check_supported(self, self.schedule, "A chaos run")

  # -- helpers ----------------------------------------------------------------------------------

  def _t(self, wall: float) -> float:
    return wall - self._wall0

  def _learner_summary(self, i: int) -> dict | None:
    path = os.path.join(self.cluster.workdir, f"learner_{i}", "summary.json")
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  def _typical_step_time(self, i: int, fallback: float) -> float:
    """Median of learner i's logged step times over all its incarnations (its metrics.jsonl).

    The summary's own step time is measured over the last steps only, when the machine may be far
    less (or more) loaded than over the run: a learner finishing alone looked twice as fast.
    """
    path = os.path.join(self.cluster.workdir, f"learner_{i}", "metrics.jsonl")
    times = replay.logged_step_times(path) if os.path.exists(path) else []
    return statistics.median(times) if times else fallback

  def _start_learner(self, i: int) -> Child:
    # Over gRPC only: the syncer's bulk port is reached directly, past the proxy and its faults.
    return self.cluster.start_learner(i, address=self.proxy.address, extra_args=[_GRPC_ONLY])

  def _observe(self, tape: TapeWriter, syncer_tail: _Tail) -> None:
    for ev in syncer_tail.read():
      kind = ev.get("kind")
      if kind == "merge":
        tape.record(
          "merge",
          t=self._t(ev["time"]),
          fragment=ev["fragment"],
          version=ev["version"],
          contributors=ev["contributors"],
          tokens=ev["tokens"],
          digest=ev.get("digest"),
        )
      elif kind == "eval":
        tape.record("eval", t=self._t(ev["time"]), loss=ev["loss"], merges=ev["merges"])
      elif kind == "restore":  # A restarted syncer: what its checkpoint lacked.
        tape.record(
          "syncer_restore",
          t=self._t(ev["time"]),
          lost_merges=ev["lost_merges"],
          to_recover=ev.get("to_recover", {}),
        )
      elif kind == "recovery":  # A lost version handed back by a learner, or republished.
        tape.record(
          "syncer_recovery",
          t=self._t(ev["time"]),
          fragment=ev["fragment"],
          version=ev["version"],
          how=ev["how"],
        )
    for i, child in self.cluster.learners.items():
      if i in self._done or i in self._killed:
        continue
      rc = child.proc.poll()
      if rc is None:
        continue
      if rc != 0:
        raise RuntimeError(f"learner {i} exited with {rc} on its own:\n{self.cluster.tail(child)}")
      summary = self._learner_summary(i) or {}
      self._done[i] = int(summary.get("steps", -1))
      tape.record(
        "learner_done", learner=i, step=self._done[i], target=self.job.run.steps_per_learner
      )
    if self._syncer_starting and self.cluster.syncer_ready():  # Raises if it exited instead.
      self._syncer_starting = self._syncer_down = False
      tape.record("syncer_up", port=self.cluster.port)
    if not self._syncer_down and self.cluster.syncer.proc.poll() is not None:
      raise RuntimeError(f"The syncer exited on its own:\n{self.cluster.tail(self.cluster.syncer)}")

  # -- the fault executor (ddiloco.faults.FaultExecutor) --------------------------------------

  def execute(self, event: FaultEvent) -> bool:
    """Executes `event` now and records it on the tape with its lateness; False (nothing recorded)
    when it had nothing to act on: a learner that has finished or is down already, a syncer that is
    down already."""
    late_s = self._tape.now() - event.t  # Recorded with every fault fired: check_schedule_on_time.
    fired = self._handlers[event.kind](event)
    if fired is None:
      return False
    self._tape.record_event(event, **fired.fields, late_s=round(late_s, 3))
    if fired.then is not None:
      self._tape.record(fired.then[0], **fired.then[1])
    return True

  def _kill_learner(self, ev: FaultEvent) -> _Fired | None:
    i = ev.learner
    if i in self._done or i in self._killed:
      return None  # Finished (or already down): nothing to kill.
    self.cluster.kill(self.cluster.learners[i])
    self._killed.add(i)
    return _Fired(then=("learner_down", {"learner": i, "reason": "killed"}))

  def _start_learner_event(self, ev: FaultEvent) -> _Fired | None:
    i = ev.learner
    if i not in self._killed:
      return None
    self._killed.discard(i)
    self._start_learner(i)
    return _Fired(then=("learner_up", {"learner": i}))

  def _signal_learner(self, ev: FaultEvent) -> _Fired | None:
    c, i = self.cluster, ev.learner
    if i in self._done or i in self._killed:
      return None
    c.signal(c.learners[i], signal.SIGSTOP if ev.kind == "pause_learner" else signal.SIGCONT)
    return _Fired()

  def _kill_syncer(self, ev: FaultEvent) -> _Fired | None:
    c = self.cluster
    if c.syncer.proc.poll() is not None:
      return None  # Down already: nothing to kill. (One still starting up is killed: a real case.)
    self._syncer_down, self._syncer_starting = True, False
    c.kill(c.syncer)
    return _Fired(then=("syncer_down", {"port": c.port}))

  def _start_syncer(self, ev: FaultEvent) -> _Fired | None:
    if not self._syncer_down or self._syncer_starting:
      return None
    # Not waited for: restoring and compiling takes seconds, and the schedule goes on meanwhile.
    # `_observe` records syncer_up once it serves.
    self.cluster.spawn_syncer(port=self.cluster.port)
    self._syncer_starting = True
    return _Fired()

  def _net(self, ev: FaultEvent) -> _Fired | None:
    if ev.kind == "net_delay":
      self.proxy.set_latency(float(ev.params.get("latency_s", self.chaos.net_latency_s)))
    elif ev.kind == "net_clear":
      self.proxy.set_latency(0.0)
    elif ev.kind == "net_drop":
      return _Fired(fields={"connections": self.proxy.drop()})
    elif ev.kind == "net_partition":
      self.proxy.partition(mode=ev.params.get("mode", self.chaos.net_partition_mode))
    else:
      self.proxy.heal()
    return _Fired()

  # -- the run ----------------------------------------------------------------------------------

  def run(self, *, timeout_s: float = 3600.0) -> None:
    """Runs the schedule until every learner finished; `summary()` then checks the tape.

    Raises:
      RuntimeError: if a process fails on its own (everything is stopped first).
      TimeoutError: after `timeout_s`.
    """
    c = self.cluster
    c.clear_previous()
    os.makedirs(c.workdir, exist_ok=True)
    if os.path.exists(self.tape_path):
      os.remove(self.tape_path)
    tape = self._tape = TapeWriter(self.tape_path, clock=time.time)
    self._wall0 = time.time() - tape.now()
    try:
      tape.record(
        "run_start", learners=c.num_learners, min_quorum=self.job.run.the_syncer().min_quorum
      )
      c.start_syncer()
      tape.record("syncer_up", port=c.port)
      # A process of its own: traffic never waits for this driver's CPU share or GIL.
      self.proxy = ProxyProcess(c.port, log_path=os.path.join(c.workdir, "proxy.log"))
      self.proxy.start()
      for i in range(c.num_learners):
        self._start_learner(i)
        tape.record("learner_up", learner=i)
      syncer_tail = _Tail(os.path.join(c.workdir, "syncer", "metrics.jsonl"))
      # Schedule times count from here: the syncer's start (building and compiling the model) takes
      # a variable while, and faults before the fleet exists would test nothing.
      offset = tape.now()
      pending = [dataclasses.replace(ev, t=ev.t + offset) for ev in self.schedule]
      deadline = time.monotonic() + timeout_s
      next_line = 0.0
      while len(self._done) < c.num_learners:
        now = tape.now()
        while pending and pending[0].t <= now:
          self.execute(pending.pop(0))
        self._observe(tape, syncer_tail)
        if time.monotonic() > deadline:
          raise TimeoutError(f"The chaos run did not finish within {timeout_s} s.")
        if time.monotonic() >= next_line:
          self.progress(self._line(now))
          next_line = time.monotonic() + 5.0
        time.sleep(0.1)
      # Wake anything still paused and bring the syncer back if the run ended during an outage.
      if self._syncer_down:
        if not self._syncer_starting:
          c.spawn_syncer(port=c.port)
        deadline_up = time.monotonic() + 180
        while not c.syncer_ready():
          if time.monotonic() > deadline_up:
            raise TimeoutError(f"The syncer did not serve within 180 s:\n{c.tail(c.syncer)}")
          time.sleep(0.1)
        self._syncer_starting = self._syncer_down = False
        tape.record("syncer_up", port=c.port)
      self.proxy.heal()
      self.proxy.set_latency(0.0)
      self._syncer_down = True  # From here on its exit is ours.
      c.signal(c.syncer, signal.SIGTERM)  # Graceful: flush, final eval, checkpoint, summary.
      c.syncer.proc.wait(timeout=300)
      self._observe(tape, syncer_tail)
      self._finish(tape)
      tape.record("run_end")
    finally:
      if self.proxy is not None:
        self.proxy.stop()
      c.stop_all()
      tape.close()

  def _line(self, now: float) -> str:
    if self._syncer_starting:
      syncer = "starting"  # Restarted by the schedule, not serving yet.
    else:
      syncer = "down" if self._syncer_down else "up"
    return status_line(
      now, syncer=syncer, num_learners=self.cluster.num_learners, down=self._killed, done=self._done
    )

  def _finish(self, tape: TapeWriter) -> None:
    """Final eval, digests of every holder, and the token counters on the tape."""
    workdir = self.cluster.workdir
    with open(os.path.join(workdir, "syncer", "summary.json")) as f:
      syncer = json.load(f)
    tape.record("eval", loss=syncer["final_eval_loss"], final=True)
    journal = os.path.join(workdir, "syncer", syncer_ckpt.JOURNAL_NAME)
    newest: dict[str, dict] = {}
    with open(journal) as f:
      for line in f:
        e = json.loads(line)
        newest[str(e["fragment"])] = {"version": e["version"], "digest": e["digest"]}
    for key, digest in syncer["digests"].items():  # Newer than the journal: none expected.
      p, v = key.split(":")
      if int(v) >= newest.get(p, {"version": -1})["version"]:
        newest[p] = {"version": int(v), "digest": digest}
    tape.record("final_digests", role="syncer", digests=newest)
    for i in range(self.cluster.num_learners):
      s = self._learner_summary(i)
      if s is None:
        continue
      held = {}
      for p, v, d in s["applies"]:
        held[str(p)] = {"version": int(v), "digest": d}
      tape.record("final_digests", role="learner", learner=i, digests=held)
      if "ledger" in s:  # Exact token-fragment counts of its surviving history (ledger.py).
        book, num = s["ledger"]["token_fragments"], s["ledger"]["num_fragments"]
        tape.record(
          "ledger",
          role="learner",
          learner=i,
          trained=s["ledger"]["trained"] * num,
          merged=book["merged"],
          dropped=book["dropped"],
          in_flight=book["unsent"] + book["awaiting"] + book["pending"],
        )
    book = syncer.get("token_ledger")
    if book:
      tape.record("ledger", role="syncer", **{k: book[k] for k in _SYNCER_BOOK})

  def summary(self, baseline_loss: float | None = None) -> dict[str, Any]:
    """Invariants and headline figures from the tape and the processes' summaries.

    Goodput of a learner (the fraction of its time spent on steps that reached the global
    model) is `time_fraction` × `merged_fraction`: the time its surviving steps took (final step
    count times its median logged step time: repeated, paused, blocked and down time excluded) over its
    provisioned time (first start to done), times the share of those steps' work that its token
    ledger booked as merged (late, refused, lost or overwritten work excluded; ledger.py).
    `accepted_fraction` is the share of its pushes a round took (accepted or superseded).
    """
    tape = read_tape(self.tape_path)
    results = invariants.check_all(
      tape,
      min_quorum=self.job.run.the_syncer().min_quorum,
      max_gap_s=self.chaos.max_gap_s,
      baseline_loss=baseline_loss,
      eval_tolerance=self.chaos.eval_tolerance,
    )
    first_up = {}
    for r in tape:
      if r["kind"] == "learner_up":
        first_up.setdefault(r["learner"], r["t"])
    done_t = {r["learner"]: r["t"] for r in tape if r["kind"] == "learner_done"}
    learners, useful, provisioned, merged, trained = {}, 0.0, 0.0, 0, 0
    for i in range(self.cluster.num_learners):
      s = self._learner_summary(i)
      if s is None or i not in done_t:
        continue
      span = done_t[i] - first_up[i]
      work = s["steps"] * self._typical_step_time(i, s["step_time_s"])
      pushes = sum(s["push_status"].values())
      ledger = s.get("ledger", {})
      fraction = ledger.get("merged_fraction", 0.0)
      learners[str(i)] = {
        "steps": s["steps"],
        "goodput": fraction * work / span if span > 0 else 0.0,
        "time_fraction": work / span if span > 0 else 0.0,
        "merged_fraction": fraction,
        # Taken by a round: accepted, or superseded by its own newer push (K = M's open rounds).
        "accepted_fraction": (
          (s["push_status"].get("accepted", 0) + s["push_status"].get("superseded", 0)) / pushes
          if pushes
          else 0.0
        ),
        "restored_from": s.get("restored_from"),
      }
      useful += fraction * work
      provisioned += span
      if ledger:
        merged += ledger["token_fragments"]["merged"]
        trained += ledger["trained"] * ledger["num_fragments"]
    merges = [r for r in tape if r["kind"] == "merge"]
    gaps = invariants.merge_gaps(tape, min_quorum=self.job.run.the_syncer().min_quorum)
    final = [r for r in tape if r["kind"] == "eval" and r.get("final")]
    return {
      "invariants": [{"name": r.name, "ok": r.ok, "detail": r.detail} for r in results],
      "ok": invariants.all_ok(results),
      "merges": len(merges),
      "longest_gap_s": max((g.length for g in gaps), default=0.0),
      "final_eval_loss": final[-1]["loss"] if final else None,
      "baseline_loss": baseline_loss,
      "goodput": useful / provisioned if provisioned > 0 else 0.0,
      "merged_fraction": merged / trained if trained else 0.0,
      "learners": learners,
      "merges_lost_at_restarts": merges_lost_at_restarts(tape),
      "learner_kills": count(tape, "kill_learner"),
      "syncer_kills": count(tape, "kill_syncer"),
      "pauses": count(tape, "pause_learner"),
      "net_events": sum(count(tape, k) for k in ("net_delay", "net_drop", "net_partition")),
      "table": invariants.format_table(results),
    }


_SYNCER_BOOK = ("received", "merged", "dropped", "pending")


def merges_lost_at_restarts(tape: Sequence[dict]) -> list[int]:
  """Per syncer restart, the merges it lost: those its checkpoint lacked, less the ones the
  learners handed back (a fragment not handed back by the run's end counts as lost)."""
  out: list[int] = []
  recovered: set[str] = set()
  restore = None
  for r in sorted(tape, key=lambda r: r["t"]):
    if r["kind"] == "syncer_restore":
      if restore is not None:
        out.append(_lost(restore, recovered))
      restore, recovered = r, set()
    elif r["kind"] == "syncer_recovery" and r["how"] == "recovered":
      recovered.add(str(r["fragment"]))
  if restore is not None:
    out.append(_lost(restore, recovered))
  return out


def _lost(restore: dict, recovered: set[str]) -> int:
  back = sum(v[3] for p, v in restore["to_recover"].items() if p in recovered and len(v) > 3)
  return int(restore["lost_merges"]) - back


def count(tape: Sequence[dict], kind: str) -> int:
  """Records of `kind` on a tape."""
  return sum(1 for r in tape if r["kind"] == kind)


def status_line(
  now: float, *, syncer: str, num_learners: int, down: Iterable[int], done: Iterable[int]
) -> str:
  """The chaos driver's progress line: the syncer's state ("up", "down", "starting") and which
  learners train, are down by the schedule's hand, or have finished."""
  down, done = sorted(down), sorted(done)
  up = [i for i in range(num_learners) if i not in down and i not in done]
  return f"t={now:6.1f}s syncer {syncer} | learners up {up} down {down} done {done}"
