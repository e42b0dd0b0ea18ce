"""`ChaosRun`: a `LocalCluster` driven through a fault schedule, recorded on an event tape.

The driver starts the syncer, a loopback proxy in front of each of its ports (its gRPC port and its
bulk port, which it advertises as the proxy's: learners reach the syncer, control and data, only
through the proxies, so network faults hit both) and M learners; then it executes the schedule of
`ddiloco.faults.schedule.make_schedule` at its times: SIGKILL and restart learners (a restarted
learner registers again and takes the global fragments; it restores its own checkpoint once learner
checkpoints land, docs/resilience.md), SIGSTOP/SIGCONT them, SIGKILL and restart the syncer on the
same port (it restores its checkpoint and journal), and delay, drop or partition the network. It
tails the syncer's metrics for merges and evaluations and writes everything to `tape.jsonl`. When
every learner has finished it stops the syncer gracefully, records final digests and the ledger, and
checks the invariants (`ddiloco.chaos.invariants`).

A sharded syncer (`JobConfig.syncer_shards` = S > 1) gets two proxies per shard (`ProxySet`), and
every shard advertises the proxies at Register, so learners reach each shard through its proxies.
A syncer event kills or restarts the shard it names (`FaultEvent.shard`) or every shard; a network
event hits that shard's proxies or every proxy. Each shard's merges, restores, digests and
ledger go on the tape with its `shard`, and the invariants hold per shard.
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
from ddiloco.chaos import records as chaos_records
from ddiloco.chaos.proxy_set import ProxySet
from ddiloco.chaos.tape import TapeWriter, read_tape
from ddiloco.faults import NETWORK_KINDS, FaultEvent, check_supported
from ddiloco.faults.schedule import ChaosConfig, make_schedule
from ddiloco.launch import processes
from ddiloco.launch.job import JobConfig
from ddiloco.launch.local_cluster import LocalCluster
from ddiloco.launch.processes import Child


class _Fired(NamedTuple):
  """An executed fault: extra fields for its tape record, and the records that follow it."""

  fields: dict[str, Any] = {}
  then: tuple[tuple[str, dict[str, Any]], ...] = ()


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
    self.num_shards = 1 if job is None else job.syncer_shards  # No job: a test of `execute`.
    self.progress = progress or (lambda line: None)
    self.schedule: list[FaultEvent] = make_schedule(chaos, cluster.num_learners, self.num_shards)
    self.tape_path = os.path.join(cluster.workdir, "tape.jsonl")
    self.proxies: ProxySet | None = None
    self._wall0 = 0.0
    self._killed: set[int] = set()  # Learners down by our hand, waiting for their restart.
    self._done: dict[int, int] = {}
    self._down: set[int] = set()  # Syncer shards down by our hand (or being stopped at the end).
    self._starting: set[int] = set()  # Shards respawned by the schedule, not serving yet.
    self._tails = [  # Each shard's metrics: its merges, restores and recoveries.
      chaos_records.Tail(
        os.path.join(chaos_records.syncer_folder(cluster.workdir, s), "metrics.jsonl")
      )
      for s in range(self.num_shards)
    ]
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
    return self.cluster.start_learner(i, address=self.proxies.address)

  def _port(self, shard: int) -> int:
    c = self.cluster
    return c.shard_ports[shard] if c.shard_ports else c.port

  def _shards(self, ev: FaultEvent) -> list[int]:
    if ev.shard is not None and ev.shard >= self.num_shards:
      raise ValueError(f"{ev}: the syncer has {self.num_shards} shard(s).")
    return list(range(self.num_shards)) if ev.shard is None else [ev.shard]

  def _observe(self, tape: TapeWriter) -> None:
    for shard, tail in enumerate(self._tails):
      chaos_records.record_syncer_events(tape, tail.read(), shard=shard, t=self._t)
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
    for shard in sorted(self._starting):
      if self.cluster.syncer_ready(shard):  # Raises if it exited instead.
        self._starting.discard(shard)
        self._down.discard(shard)
        tape.record("syncer_up", shard=shard, port=self._port(shard))
    for shard in range(self.num_shards):
      child = self.cluster.syncer_child(shard)
      if shard not in self._down and child.proc.poll() is not None:
        raise RuntimeError(
          f"The syncer (shard {shard}) exited on its own:\n{self.cluster.tail(child)}"
        )

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
    for kind, fields in fired.then:
      self._tape.record(kind, **fields)
    return True

  def _kill_learner(self, ev: FaultEvent) -> _Fired | None:
    i = ev.learner
    if i in self._done or i in self._killed:
      return None  # Finished (or already down): nothing to kill.
    self.cluster.kill(self.cluster.learners[i])
    self._killed.add(i)
    return _Fired(then=(("learner_down", {"learner": i, "reason": "killed"}),))

  def _start_learner_event(self, ev: FaultEvent) -> _Fired | None:
    i = ev.learner
    if i not in self._killed:
      return None
    self._killed.discard(i)
    self._start_learner(i)
    return _Fired(then=(("learner_up", {"learner": i}),))

  def _signal_learner(self, ev: FaultEvent) -> _Fired | None:
    c, i = self.cluster, ev.learner
    if i in self._done or i in self._killed:
      return None
    c.signal(c.learners[i], signal.SIGSTOP if ev.kind == "pause_learner" else signal.SIGCONT)
    return _Fired()

  def _kill_syncer(self, ev: FaultEvent) -> _Fired | None:
    c, then = self.cluster, []
    for shard in self._shards(ev):
      child = c.syncer_child(shard)
      if child.proc.poll() is not None:
        continue  # Down already: nothing to kill. (One still starting up is killed: a real case.)
      self._down.add(shard)
      self._starting.discard(shard)
      c.kill(child)
      then.append(("syncer_down", {"shard": shard, "port": self._port(shard)}))
    return _Fired(then=tuple(then)) if then else None

  def _start_syncer(self, ev: FaultEvent) -> _Fired | None:
    shards = [s for s in self._shards(ev) if s in self._down and s not in self._starting]
    for shard in shards:
      # Not waited for: restoring and compiling takes seconds, and the schedule goes on meanwhile.
      # `_observe` records syncer_up once it serves. Same ports: the proxies' upstreams stay.
      self.cluster.spawn_syncer(port=self._port(shard), shard=shard)
      self._starting.add(shard)
    return _Fired() if shards else None

  def _net(self, ev: FaultEvent) -> _Fired | None:
    proxies, shard = self.proxies, ev.shard
    if ev.kind == "net_delay":
      latency = float(ev.params.get("latency_s", self.chaos.net_latency_s))
      proxies.set_latency(latency, shard=shard)
    elif ev.kind == "net_clear":
      proxies.set_latency(0.0, shard=shard)
    elif ev.kind == "net_drop":
      return _Fired(fields={"connections": proxies.drop(shard=shard)})
    elif ev.kind == "net_partition":
      proxies.partition(mode=ev.params.get("mode", self.chaos.net_partition_mode), shard=shard)
    else:
      proxies.heal(shard=shard)
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
      self._start_syncer_and_proxies(tape)
      for i in range(c.num_learners):
        self._start_learner(i)
        tape.record("learner_up", learner=i)
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
        self._observe(tape)
        if time.monotonic() > deadline:
          raise TimeoutError(f"The chaos run did not finish within {timeout_s} s.")
        if time.monotonic() >= next_line:
          self.progress(self._line(now))
          next_line = time.monotonic() + 5.0
        time.sleep(0.1)
      self._bring_back(tape)
      self.proxies.heal()
      self.proxies.set_latency(0.0)
      self._record_traffic(tape)
      self._down = set(range(self.num_shards))  # From here on their exits are ours.
      # Graceful, every shard at once (shard 0 waits for the others' final values): flush, final
      # eval, checkpoint, summary.
      for shard in range(self.num_shards):
        c.signal(c.syncer_child(shard), signal.SIGTERM)
      for shard in range(self.num_shards):
        c.syncer_child(shard).proc.wait(timeout=300)
      self._observe(tape)
      learners = {i: self._learner_summary(i) for i in range(c.num_learners)}
      chaos_records.record_final(
        tape, c.workdir, num_shards=self.num_shards, learner_summaries=learners
      )
      tape.record("run_end")
    finally:
      if self.proxies is not None:
        self.proxies.stop()
      c.stop_all()
      tape.close()

  def _start_syncer_and_proxies(self, tape: TapeWriter) -> None:
    """Starts a proxy in front of each port of each shard, then the syncer's shards on those
    ports, advertising the proxies (module docstring)."""
    c, shards = self.cluster, self.num_shards
    chosen = processes.free_ports(2 * shards)
    ports, bulk_ports = chosen[:shards], chosen[shards:]  # Kept across restarts.
    # Processes of their own: traffic never waits for this driver's CPU share or GIL.
    self.proxies = ProxySet(ports, bulk_ports, log_dir=c.workdir)
    self.proxies.start()
    c.bulk_ports = list(zip(bulk_ports, self.proxies.bulk_ports, strict=True))
    if shards == 1:
      c.start_syncer(port=ports[0])
    else:
      c.shard_ports, c.shard_addresses = ports, self.proxies.addresses
      c.start_syncers(shards)
    for shard in range(shards):
      tape.record("syncer_up", shard=shard, port=self._port(shard))

  def _record_traffic(self, tape: TapeWriter) -> None:
    """What each proxy forwarded: learners reached both ports of every shard through them."""
    for shard in range(self.num_shards):
      for port, proxy in (
        ("control", self.proxies.proxies[shard]),
        ("data", self.proxies.bulk[shard]),
      ):
        stats = proxy.stats()
        tape.record(
          "proxy_traffic",
          shard=shard,
          port=port,
          bytes_up=stats.bytes_up,
          bytes_down=stats.bytes_down,
          connections=stats.connections,
          resets=stats.resets,
        )

  def _bring_back(self, tape: TapeWriter, timeout_s: float = 180.0) -> None:
    """Restarts the shards the run ended without (it ended during an outage) and waits for them."""
    c = self.cluster
    for shard in sorted(self._down - self._starting):
      c.spawn_syncer(port=self._port(shard), shard=shard)
      self._starting.add(shard)
    deadline = time.monotonic() + timeout_s
    for shard in sorted(self._starting):
      while not c.syncer_ready(shard):
        if time.monotonic() > deadline:
          log = c.tail(c.syncer_child(shard))
          raise TimeoutError(
            f"The syncer (shard {shard}) did not serve within {timeout_s} s:\n{log}"
          )
        time.sleep(0.1)
      tape.record("syncer_up", shard=shard, port=self._port(shard))
    self._starting.clear()
    self._down.clear()

  def _line(self, now: float) -> str:
    states = [
      "starting" if s in self._starting else "down" if s in self._down else "up"
      for s in range(self.num_shards)
    ]
    return status_line(
      now,
      syncer="/".join(states),
      num_learners=self.cluster.num_learners,
      down=self._killed,
      done=self._done,
    )

  def summary(self, baseline_loss: float | None = None) -> dict[str, Any]:
    """Invariants and headline figures from the tape and the processes' summaries (`shards`: each
    syncer shard's merges and the merges each of its restarts lost).

    Goodput of a learner (the fraction of its time spent on steps that reached the global
    model) is `time_fraction` × `merged_fraction`: the time its surviving steps took (final step
    count times its median logged step time: repeated, paused, blocked and down time excluded) over its
    provisioned time (first start to done), times the share of those steps' work that its token
    ledger booked as merged (late, refused, lost or overwritten work excluded; ledger.py).
    `accepted_fraction` is the share of its pushes a round took (accepted or superseded).
    """
    tape = read_tape(self.tape_path)
    quorum = self.job.run.the_syncer().min_quorum
    results = invariants.check_all(
      tape,
      min_quorum=quorum,
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
    gaps = [
      g
      for s in range(self.num_shards)
      for g in invariants.merge_gaps(tape, min_quorum=quorum, shard=s)
    ]
    final = [r for r in tape if r["kind"] == "eval" and r.get("final")]
    return {
      "invariants": [{"name": r.name, "ok": r.ok, "detail": r.detail} for r in results],
      "ok": invariants.all_ok(results),
      "merges": len(merges),
      "shards": [
        {
          "merges": sum(1 for r in merges if r.get("shard", 0) == s),
          "merges_lost_at_restarts": invariants.merges_lost_at_restarts(
            [r for r in tape if r.get("shard", 0) == s]
          ),
        }
        for s in range(self.num_shards)
      ],
      "longest_gap_s": max((g.length for g in gaps), default=0.0),
      "final_eval_loss": final[-1]["loss"] if final else None,
      "baseline_loss": baseline_loss,
      "goodput": useful / provisioned if provisioned > 0 else 0.0,
      "merged_fraction": merged / trained if trained else 0.0,
      "learners": learners,
      "merges_lost_at_restarts": invariants.merges_lost_at_restarts(tape),
      "learner_kills": count(tape, "kill_learner"),
      "syncer_kills": count(tape, "kill_syncer"),
      "pauses": count(tape, "pause_learner"),
      "net_events": sum(count(tape, k) for k in ("net_delay", "net_drop", "net_partition")),
      "proxy_traffic": {
        f"{r['port']}_{r['shard']}": {k: r[k] for k in ("bytes_up", "bytes_down", "resets")}
        for r in tape
        if r["kind"] == "proxy_traffic"
      },
      "table": invariants.format_table(results),
    }


def count(tape: Sequence[dict], kind: str) -> int:
  """Records of `kind` on a tape."""
  return sum(1 for r in tape if r["kind"] == kind)


def status_line(
  now: float, *, syncer: str, num_learners: int, down: Iterable[int], done: Iterable[int]
) -> str:
  """The chaos driver's progress line: the syncer's state ("up", "down", "starting"; each shard's,
  joined by "/", for a sharded syncer) and which learners train, are down by the schedule's hand,
  or have finished."""
  down, done = sorted(down), sorted(done)
  up = [i for i in range(num_learners) if i not in down and i not in done]
  return f"t={now:6.1f}s syncer {syncer} | learners up {up} down {down} done {done}"
