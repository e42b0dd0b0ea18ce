"""A simulated cluster: M learners and the syncer in one process, on a virtual clock.

docs/architecture.md "two ways to run": the gradient steps are real (each learner is a real `Learner` with
its own mesh over a slice of the local devices), so model quality is real; time is virtual, so quorum,
grace window, stragglers, crashes and joins are reproducible on any machine. The syncer is driven
through an interface (interface.py); `simulate()` plugs in the distributed runtime's own service,
reached over the in-process transport with the runtime's client, messages and codecs
(service/virtual.py). Only the clock and the timing of events differ from the distributed
runtime: each learner does here what a learner process does (learner_process/worker.py), with the
network's latency (and bandwidth) as the time between sending and receiving.

At each of them a learner calls the step boundary a learner process calls (learner/boundary.py):
it applies what is ready, answers what is due and says whether to wait; the cluster sends the
answers over its virtual network.

Event loop (a heap ordered by virtual time):
  step_done(m)      learner m finished an inner step: train, heartbeat (its step paces the syncer's
                    clock), the step boundary, start the next step (or block, for synchronous
                    baselines)
  wake              the syncer's next deadline (a round due, a merge, liveness) -> syncer.advance()
  ask(m, round)     a round request reaches learner m          -> kernel.ask(), answered at once
                    with θ of its last step boundary (mid-step too, as a learner process does)
  arrive(answer)    an answer reaches the syncer               -> the learner's link pushes it
  announce(m, p)    a published version's announcement reaches learner m -> it pulls p
  deliver(m, frag)  the pulled fragment is in (after the bandwidth's time) -> kernel.receive()
  keepalive(m)      a blocked learner's heartbeat, every heartbeat interval
  fault             a fault event: kill / restart / add / remove / slow a learner
                    (ddiloco.faults; executed by ddiloco.simulation.faults)
  eval              evaluate the global model on the held-out split
"""

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ddiloco.faults import FaultEvent, check_supported, parse_faults
from ddiloco.fragments import tree
from ddiloco.fragments.layout import FragmentLayout
from ddiloco.learner.boundary import step_boundary
from ddiloco.learner.factory import LearnerFactory
from ddiloco.metrics.accounting import BLOCKED, BUSY, DOWN, GONE, TimeLedger
from ddiloco.metrics.writer import MetricsWriter
from ddiloco.protocol import Answer, FragmentState, ReportResult, RoundRequest
from ddiloco.run_config import RunConfig
from ddiloco.simulation import report
from ddiloco.simulation.clock import EventQueue, VirtualNetwork
from ddiloco.simulation.config import ClusterConfig
from ddiloco.simulation.faults import SimulatedFaults
from ddiloco.simulation.interface import Announcement, Syncer
from ddiloco.simulation.slot import LearnerSlot
from ddiloco.syncer.core import MergeEvent

log = logging.getLogger(__name__)


# Events that move a run on (`_stalled`): the others (evaluations, heartbeats of blocked
# learners, the syncer's wake-ups) happen whether or not anything can change.
_PRODUCTIVE = frozenset({"step_done", "ask", "arrive", "announce", "deliver", "fault"})


class SimulatedCluster:
  """Runs Decoupled DiLoCo (or a baseline) with real steps on a virtual clock.

  Args:
    factory: builds learners, the global initial parameters, the layout and the eval function.
    run: the run: M, the token budget, the fragment schedule (P, H, τ), the learners' protocol
      knobs (α, blocking), evaluation and logging periods.
    fleet: the virtual fleet: step times, stragglers, faults, latencies.
    syncer_fn: builds the `Syncer` given (fragment_keys, init_values, clock, embedding_keys,
      schedule, layout_digest), e.g. `service.virtual.VirtualSyncer` with its configs bound;
      None runs without a syncer (the data-parallel baseline).
    writer: where events go.
    heartbeat_interval_s: how often a blocked learner sends a heartbeat (a stepping one sends one
      at every step), in virtual seconds.
  """

  def __init__(
    self,
    *,
    factory: LearnerFactory,
    run: RunConfig,
    fleet: ClusterConfig,
    syncer_fn: Callable[..., Syncer] | None,
    writer: MetricsWriter | None = None,
    heartbeat_interval_s: float = 0.25,
  ):
    self.factory = factory
    self.run_config, self.fleet = run, fleet
    self.schedule = schedule = run.the_schedule()
    self.learner_config = run.the_learner()
    self.writer = writer
    self.now = 0.0
    self._queue = EventQueue()
    self._rng = np.random.default_rng(fleet.seed)
    self._net = VirtualNetwork(
      bandwidth_gbps=fleet.bandwidth_gbps,
      latency_jitter=fleet.latency_jitter,
      rng=np.random.default_rng([fleet.seed, 1]),  # Latency jitter: its own stream.
    )
    self.layout: FragmentLayout = factory.layout
    self.syncer: Syncer | None = None
    if syncer_fn is not None:
      self.syncer = syncer_fn(
        fragment_keys=self.layout.fragments,
        init_values=factory.global_init_values(),
        clock=lambda: self.now,
        embedding_keys=factory.embedding_keys(),
        schedule=schedule,
        layout_digest=self.layout.digest,
      )
    self.heartbeat_interval_s = heartbeat_interval_s
    self.ledger = TimeLedger()
    self.slots: dict[int, LearnerSlot] = {}
    self.token_budget = run.num_learners * run.steps_per_learner * factory.tokens_per_step
    self.tokens_trained = 0
    self.lost_reports = 0
    self.merge_events: list[MergeEvent] = []
    self._newest_round: dict[int, int] = {}  # Fragment -> newest round step announced.
    self.evals: list[tuple[float, float]] = []
    self._finished = False
    self._finish_time = math.inf

  # -- event plumbing -------------------------------------------------------------------------

  def _push(self, t: float, kind: str, *payload: Any) -> None:
    self._queue.push(t, kind, *payload)

  def _event(self, kind: str, **fields: Any) -> None:
    if self.writer is not None:
      self.writer.event(kind, time=round(self.now, 6), **fields)

  def _scalars(self, values: dict[str, float], *, step: int | None = None) -> None:
    """TensorBoard scalars against the fleet's tokens trained (metrics/writer.py)."""
    if self.writer is not None:
      self.writer.scalars(values, tokens=self.tokens_trained, step=step)

  def _wire_bytes(self, values: dict[str, np.ndarray], codec: str) -> int:
    return self._net.wire_bytes(values, codec, self.syncer.config.block_size)

  @property
  def bytes_up(self) -> int:
    """Bytes the learners pushed, as the syncer's door counted them on the (in-process) wire."""
    return self.syncer.traffic()[0] if self.syncer is not None else 0

  @property
  def bytes_down(self) -> int:
    """Bytes the learners pulled, as the syncer counted them."""
    return self.syncer.traffic()[1] if self.syncer is not None else 0

  @property
  def core(self):
    """The syncer's core (read-only views: versions, states, counters), None without a syncer."""
    return self.syncer.core if self.syncer is not None else None

  # -- learner lifecycle ----------------------------------------------------------------------

  def start_learner(self, index: int, *, rejoin: bool) -> None:
    """Starts learner `index`, or restarts it after a kill (`rejoin`): it registers and loads the
    global model."""
    slot = self.slots.get(index)
    if slot is None:
      run = self.run_config
      spec = self.fleet.spec_for(index, num_learners=run.num_learners, batch_size=run.batch_size)
      slot = LearnerSlot(index=index, spec=spec)
      self.slots[index] = slot
    if slot.learner is None:
      slot.learner = self.factory.make_learner(
        index, spec=slot.spec, schedule=self.schedule, config=self.learner_config
      )
      slot.data = self.factory.make_data(index, spec=slot.spec)
    slot.alive, slot.blocked = True, False
    slot.gen += 1
    slot.begin_life()  # It reads on from where its data iterator stopped (slot.py).
    if self.syncer is not None:
      # Register, then restore every fragment from the global copy (docs/algorithm.md §6 rejoin), as a
      # learner process does. The inner optimizer state is kept, as if restored from the learner's
      # own per-step checkpoint.
      self._connect(slot)
    self.ledger.set_state(index, BUSY, self.now)
    if not rejoin:
      self._event("start", learner=index, action="start")
    self._push(self.now + slot.draw_step_duration(self._rng), "step_done", index, slot.gen)

  def _connect(self, slot: LearnerSlot) -> None:
    """Registers slot's learner on a new link, loads the global fragments, joins the fleet's
    schedule and subscribes to its rounds (the rounds open now are asked at once)."""
    learner, kernel = slot.learner, slot.learner.kernel
    kernel.held.clear()  # A (re)started process holds no version.
    slot.link = link = self.syncer.link(slot.index, held=kernel.held)
    reg = link.register(num_devices=slot.spec.devices, batch_size=slot.spec.batch_size or 0)
    kernel.ledger.restored()  # Reports lost in a crash settle at the next heartbeat.
    learner.load_global([link.pull(p, -1) for p in range(self.layout.num_fragments)])
    # A (re)joining learner takes the fleet's step on the syncer's clock (docs/algorithm.md).
    if self.now > 0:
      kernel.align_phase(reg.fleet_step)
      learner.join_schedule(reg.fleet_step)
    for event in self._subscribe(slot):
      if isinstance(event, RoundRequest):
        kernel.ask(event)
    self._schedule_wake()

  def _subscribe(self, slot: LearnerSlot) -> list[Announcement]:
    """Subscribes slot's learner to its rounds and announcements, each later one delivered
    after the downlink latency; returns the open rounds and current versions."""
    index, gen = slot.index, slot.gen
    return self.syncer.subscribe(slot.link, lambda ev: self._on_announcement(index, gen, ev))

  def stop_learner(self, index: int, *, left: bool) -> None:
    """Takes a learner out: a crash (its slot stays provisioned, DOWN) or a leave (GONE). The
    syncer learns of a crash only from the learner's silence (its liveness timeout)."""
    slot = self.slots.get(index)
    if slot is None or not slot.alive:
      return
    slot.alive, slot.blocked = False, False
    slot.gen += 1
    slot.end_life()
    if self.syncer is not None:
      if left:
        slot.link.leave()
      self._schedule_wake()  # A departure may let a round close early.
    self.ledger.set_state(index, GONE if left else DOWN, self.now)

  # -- handlers -------------------------------------------------------------------------------

  def _on_step_done(self, index: int, gen: int) -> None:
    slot = self.slots[index]
    if not slot.alive or gen != slot.gen:
      return  # The step was lost in a crash.
    learner = slot.learner
    batch = next(slot.data)
    slot.last_metrics = learner.train_step(batch)
    ntok = int(np.prod(batch["targets"].shape))
    step_time = slot.count_step(ntok)
    self.tokens_trained += ntok
    if learner.kernel.step % self.run_config.log_every == 0:
      report.record_train(self, slot, step_time)
    if self.syncer is not None:
      # Per-step metadata: the syncer's clock runs at the fleet's measured step rate.
      self._heartbeat(slot)
      blocked = self._boundary(slot)
      self._schedule_wake()
    else:
      blocked = learner.kernel.blocked()
    if self.tokens_trained >= self.token_budget:
      self._finished = True
      self._finish_time = self.now
      self.ledger.close(self.now)
      if self.syncer is not None:
        # Every learner answers the rounds it was asked for with what it has trained, and the
        # syncer opens the rounds due at the steps trained.
        for other in self.slots.values():
          if other.alive and other is not slot:
            self._boundary(other)
        self._queue.schedule_once("wake", self.now, self.now)
      return
    self._continue(slot, blocked)

  def _heartbeat(self, slot: LearnerSlot) -> None:
    """Slot's learner reports its step; if the syncer forgot it (declared dead), it registers
    again and pulls what it announces, as a learner process's comm thread does."""
    hb = slot.link.heartbeat(slot.learner.kernel.schedule_step, slot.step_time_ema)
    if not hb.registered:
      self._event("reregister", learner=slot.index)
      slot.link.register(num_devices=slot.spec.devices, batch_size=slot.spec.batch_size or 0)
      for event in self._subscribe(slot):
        self._on_announcement(slot.index, slot.gen, event)
      return
    slot.learner.kernel.ledger.settle(list(hb.versions), list(hb.merged_steps))

  def _boundary(self, slot: LearnerSlot, *, at_boundary: bool = True) -> bool:
    """Learner `slot`'s step boundary (learner/boundary.py): applies what is ready (unless not
    `at_boundary`: a step would be running), answers the rounds it was asked for with θ of its
    last boundary and sends the answers; returns whether it must wait."""
    boundary = step_boundary(
      slot.learner, at_boundary=at_boundary, host_copies=True, step_time_s=slot.step_time_ema
    )
    for answer in boundary.answers:
      # Staleness: inner steps θ_p trained away from the last global version the learner applied.
      self._scalars({f"learner_{slot.index}/staleness_steps": answer.steps})
      codec = "fp32" if answer.anchor is None else self.syncer.config.uplink_codec
      at = self.now + self._net.transfer_s(
        self._wire_bytes(answer.theta(), codec), self._net.latency(self.fleet.uplink_latency_s)
      )
      self._push(at, "arrive", answer, slot.gen)
    return boundary.blocked

  def _schedule_wake(self, *, after_now: bool = False) -> None:
    """Schedules the syncer's next wake-up: a round coming due, a merge, a liveness deadline;
    after the token budget (the drain), merges only. `after_now`: not at this instant again."""
    at = self.core.closer.next_deadline() if self._finished else self.syncer.next_wakeup()
    if at is not None and after_now and at <= self.now:
      # The syncer just did what was due now; a deadline it still reports as now is a rounding
      # edge, and waking at this instant again would never move the clock.
      at = self.now + 1e-6
    self._queue.schedule_once("wake", at, self.now)

  def _on_wake(self) -> None:
    # The drain answers the rounds of the steps trained and opens no later one.
    self.syncer.advance(open_rounds=not (self._finished and self.now > self._finish_time))
    for ev in self.syncer.merge_log()[len(self.merge_events) :]:
      self._merged(ev)
    self._schedule_wake(after_now=True)

  def _merged(self, ev: MergeEvent) -> None:
    """Books a published merge (events, scalars) and its delivery time (ξ_sync)."""
    self.merge_events.append(ev)
    report.record_merge(self, ev)
    state = self.core.state(ev.fragment)
    codec = self.syncer.config.downlink_codec
    nbytes = self._wire_bytes(state.values, codec)
    # ξ_sync includes delivering the merge (docs/algorithm.md §4.2), which the core's clock cannot see here.
    self.syncer.observe_sync_time(self._net.transfer_s(nbytes, self.fleet.downlink_latency_s))

  def _on_announcement(self, index: int, gen: int, event: Announcement) -> None:
    """The syncer asked for a round or published a version (under its lock: schedule only)."""
    t = self.now + self._net.latency(self.fleet.downlink_latency_s)
    if isinstance(event, RoundRequest):
      p = event.fragment
      if event.round_step > self._newest_round.get(p, -1):  # Opened now: the first to hear it.
        self._newest_round[p] = event.round_step
        self._event(
          "round", fragment=event.fragment, step=event.round_step, base=event.base_version
        )
      self._push(t, "ask", index, gen, event)
    else:
      self._push(t, "announce", index, gen, *event)

  def _on_ask(self, index: int, gen: int, request: RoundRequest) -> None:
    slot = self.slots[index]
    if not slot.alive or gen != slot.gen:
      return
    slot.learner.kernel.ask(request)
    if self._finished:  # No step starts any more: rounds due at steps already trained are answered.
      self._boundary(slot)
    elif slot.blocked:  # Idle at a step boundary: it answers now.
      self._continue(slot, self._boundary(slot))
    else:  # Mid-step: answered at once with θ of the last step; applies wait for the boundary.
      self._boundary(slot, at_boundary=False)

  def _continue(self, slot: LearnerSlot, blocked: bool) -> None:
    """Learner `slot` waits (blocked by its last boundary) or starts its next step."""
    if blocked:
      if not slot.blocked:
        slot.blocked = True
        self.ledger.set_state(slot.index, BLOCKED, self.now)
        self._push(self.now + self.heartbeat_interval_s, "keepalive", slot.index, slot.gen)
      return
    if slot.blocked:
      slot.blocked = False
      self.ledger.set_state(slot.index, BUSY, self.now)
    self._push(self.now + slot.draw_step_duration(self._rng), "step_done", slot.index, slot.gen)

  def _on_keepalive(self, index: int, gen: int) -> None:
    """A blocked learner's heartbeat: it is alive, though it makes no steps."""
    slot = self.slots[index]
    if slot.alive and slot.blocked and gen == slot.gen and not self._finished:
      self._heartbeat(slot)
      self._schedule_wake()
      self._push(self.now + self.heartbeat_interval_s, "keepalive", index, gen)

  def _on_arrive(self, answer: Answer, gen: int) -> None:
    slot = self.slots[answer.learner_id]
    if not slot.alive or gen != slot.gen:
      self.lost_reports += 1  # Sent by a learner that crashed before the answer landed.
      return
    try:
      result = slot.link.push(answer)  # The door, the codec, the core: the service's path.
    except ValueError as e:  # θ_p cannot be encoded (NaN/Inf), as a learner process finds too.
      result = ReportResult("rejected", str(e), 0.0)
    slot.learner.kernel.on_result(answer.fragment, result)
    if result.status in ("late", "duplicate", "rejected"):
      self._event(
        "report", learner=answer.learner_id, fragment=answer.fragment, status=result.status
      )
      stats = self.core.stats()
      self._scalars(
        {"syncer/late_reports": stats["late"], "syncer/rejected_reports": stats["rejected"]}
      )
    self._schedule_wake()

  def _on_announce(self, index: int, gen: int, p: int, version: int) -> None:
    """Learner `index` pulls a version announced to it (a delta against the version it holds)."""
    slot = self.slots[index]
    if not slot.alive or gen != slot.gen:
      return
    received = slot.link.bytes_received
    state = slot.link.pull(p)
    if state is None:
      return  # Held already.
    delay = self._net.transfer_s(
      slot.link.bytes_received - received, 0.0
    )  # A delta, or full values.
    if delay > 0:
      self._push(self.now + delay, "deliver", index, gen, state)
    else:
      self._on_deliver(index, gen, state)

  def _on_deliver(self, index: int, gen: int, state: FragmentState) -> None:
    slot = self.slots[index]
    if not slot.alive or gen != slot.gen:
      return
    slot.learner.kernel.receive(state)
    if slot.blocked and not self._finished:
      self._continue(slot, self._boundary(slot))

  def log_fault(self, event: FaultEvent) -> None:
    self._event("fault", learner=event.learner, action=event.kind, **event.params)

  def _on_eval(self) -> None:
    report.record_eval(self)
    if not self._finished:
      self._push(self.now + self.run_config.eval_every_s, "eval")

  # -- public ---------------------------------------------------------------------------------

  def global_params_flat(self) -> dict[str, np.ndarray]:
    """The model the system has produced: the syncer's global copy, or learner 0 without one."""
    if self.core is not None:
      return self.layout.join([self.core.state(p).values for p in range(self.layout.num_fragments)])
    learner = self.slots[0].learner
    return {k: np.asarray(jax.device_get(v)) for k, v in tree.flatten(learner.params).items()}

  def run(self, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs until the token budget is trained (or `max_time_s` of virtual time); returns the summary."""
    wall0 = time.perf_counter()
    faults = SimulatedFaults(self)
    schedule = parse_faults(self.fleet.faults)
    check_supported(faults, schedule, "The simulator")
    for index in range(self.run_config.num_learners):
      self.start_learner(index, rejoin=False)
    for event in schedule:
      self._push(event.t, "fault", event)
    if self.run_config.eval_every_s > 0:
      self._push(self.run_config.eval_every_s, "eval")
    handlers = {
      "step_done": self._on_step_done,
      "wake": self._on_wake,
      "ask": self._on_ask,
      "arrive": self._on_arrive,
      "announce": self._on_announce,
      "deliver": self._on_deliver,
      "keepalive": self._on_keepalive,
      "fault": faults.execute,
      "eval": self._on_eval,
    }
    last_progress = wall0
    # Once the token budget is trained no step starts, but rounds due at the steps trained are
    # still opened and answered, and answers already sent land, merge and reach the learners (the
    # drain), so the final global model includes the last steps' work.
    drain_kinds = ("wake", "ask", "arrive", "announce", "deliver")
    self.stalled = False
    while self._queue:
      if not self._finished and self._stalled():
        # Every learner is blocked or down and nothing can change that: a synchronous quorum
        # waiting for a learner that will not come back. Stop rather than evaluate forever; the
        # stall counts as downtime up to the run's horizon when it has one.
        self.stalled = True
        if math.isfinite(self.fleet.max_time_s):
          self.now = self.fleet.max_time_s
        break
      popped = self._queue.pop()  # Superseded wake-ups never come out: they do not move the clock.
      if popped is None:
        break
      t, kind, payload = popped
      if t > self.fleet.max_time_s:
        break
      if self._finished and kind not in drain_kinds:
        continue
      self.now = t
      handlers[kind](*payload)
      if progress is not None and time.perf_counter() - last_progress > 2.0:
        last_progress = time.perf_counter()
        progress(self.progress_line(wall_s=time.perf_counter() - wall0))
    self.ledger.close(self.now)  # No-op for slots already closed when the budget was reached.
    final = report.record_eval(self, final=True)
    return report.summary(self, final, time.perf_counter() - wall0)

  def _stalled(self) -> bool:
    """Whether nothing can move the run on: no learner steps, no message or fault is on its way,
    no merge is due and no round can open (heartbeats of blocked learners, evaluations and the
    syncer's liveness wake-ups go on regardless)."""
    if self._queue.has_any(_PRODUCTIVE):
      return False
    return self.core is None or (
      self.core.closer.next_deadline() is None and self.core.pacer.next_tick_time() is None
    )

  def progress_line(self, wall_s: float | None = None) -> str:
    """One status line (`report.progress_line`)."""
    return report.progress_line(self, wall_s)

  def close(self) -> None:
    """Releases the syncer (its in-process server)."""
    if self.syncer is not None:
      self.syncer.close()
