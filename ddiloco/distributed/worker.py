"""A learner process's loop: train without ever waiting on the network (docs/algorithm.md §3, docs/architecture.md).

Five threads share one `Learner`, which only the training thread touches:

- the training thread steps, feeds round requests, received fragments and push answers to the
  learner, applies merged fragments τ steps after it answered their round (`Learner.apply_ready`),
  checking each apply's digest, and hands each round it answers to the sender as a device-side
  snapshot (`Learner.snapshot_report`);
- the rounds thread holds the syncer's `Rounds` stream: it queues every round request for the
  training thread and hands every announced version to the puller, so that a pull never delays a
  request;
- the puller pulls each announced version at once (a delta against the version held);
- two sender threads (`senders`) copy snapshots to host memory, encode the outer gradient
  Θ^(anchor) − θ with the uplink codec and push it, at most one push per fragment in flight;
- the comm thread sends heartbeats (the learner's step, from which the syncer's step clock takes the
  fleet's pace), announces any version it sees that the stream missed, and re-registers when the
  syncer forgot this learner.

With `LearnerConfig.blocking` (the synchronous baselines) the training thread waits at answer + τ
until the round's merge has arrived, as the simulated cluster does.

If the syncer is unreachable the learner keeps training; both background threads retry with
exponential backoff (and gRPC's channel reconnects with its own). Only the first registration, which
fetches the global model, waits (up to `connect_timeout_s`).

With a `LearnerCheckpointer`, `connect` first restores the step, inner optimizer state and data
position (own checkpoint, a peer's, or fresh: checkpoint/learner.py), then loads the global fragments,
which overwrite every parameter (docs/algorithm.md §6). The training thread saves every `save_every_steps` steps
(asynchronously) and once more when it stops gracefully; docs/resilience.md states what a crash
repeats and loses.
"""

import collections
import dataclasses
import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import jax
import numpy as np

from ddiloco.checkpoint.learner import LearnerCheckpointer
from ddiloco.distributed.link import SyncerLink
from ddiloco.distributed.step_wait import StepWaiter
from ddiloco.learner.learner import Learner
from ddiloco.metrics.writer import MetricsWriter, quantiles
from ddiloco.protocol import FragmentState, Report, ReportResult, RoundRequest
from ddiloco.transport import wire
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.errors import WireError

log = logging.getLogger(__name__)

# Failures after which the call is simply retried later (the syncer is down, slow or restarting).
_TRANSIENT = (
  grpc.StatusCode.UNAVAILABLE,
  grpc.StatusCode.DEADLINE_EXCEEDED,
  grpc.StatusCode.CANCELLED,
  grpc.StatusCode.RESOURCE_EXHAUSTED,
  grpc.StatusCode.UNKNOWN,
  grpc.StatusCode.INTERNAL,
)
# The syncer does not know this learner (restarted, or declared it dead), or no longer takes its
# session (another registration of the id replaced it): register again.
_UNREGISTERED = (
  grpc.StatusCode.NOT_FOUND,
  grpc.StatusCode.FAILED_PRECONDITION,
  grpc.StatusCode.PERMISSION_DENIED,
)


_WARMUP_STEPS = 2  # Steps left out of the step-time EMA (compilation).


class Backoff:
  """Exponential backoff with full jitter: delays grow from `initial_s` to `max_s`."""

  def __init__(self, initial_s: float = 0.1, max_s: float = 5.0, seed: int = 0):
    self.initial_s, self.max_s = initial_s, max_s
    self._attempt = 0
    self._rng = np.random.default_rng(seed)

  def reset(self) -> None:
    self._attempt = 0

  def next_delay(self) -> float:
    cap = min(self.max_s, self.initial_s * 2**self._attempt)
    self._attempt = min(self._attempt + 1, 30)
    return float(self._rng.uniform(0.5 * cap, cap))


@dataclasses.dataclass
class _Job:
  report: Report  # Without values.
  fetch: Any  # () -> host values
  anchor_values: Mapping[str, np.ndarray] | None
  asked_at: float | None = None  # Monotonic times: the round request's arrival, the answer's
  answered_at: float | None = None  # snapshot (for `answer_latency`).
  picked_at: float | None = None  # The sender took it; its host copy was ready at `copied_at`.
  copied_at: float | None = None


def _fold(older: _Job, newer: _Job) -> _Job:
  """`newer` carrying `older`'s ledger tokens too (the token ledger, learner/ledger.py)."""
  report = dataclasses.replace(
    newer.report, new_tokens=newer.report.new_tokens + older.report.new_tokens
  )
  return dataclasses.replace(newer, report=report)


class LearnerWorker:
  """Runs one learner against the syncer service (see module docstring).

  Args:
    learner: the learner (params, optimizer state, protocol state).
    data: training batches.
    client: the syncer client.
    layout_digest: the fragment layout's digest, checked by the syncer at Register.
    layouts: per fragment, {key: (shape, dtype)} (transport.client.fragment_layouts).
    writer: metrics writer for this learner (train, push, apply, connection events).
    batch_size: sequences per step (informational at Register).
    log_every: steps between logged training losses.
    connect_timeout_s: how long the first registration may take.
    checkpointer: saves and restores this learner's state (None: never checkpoints). `data` must
      then be checkpointable (`get_state`/`set_state`, as the grain iterators are).
    senders: sender threads, each with one push in flight (of different fragments): with one, an
      answer waits behind every slower push before it.

  Raises:
    ValueError: if a checkpointer is given but `data` cannot report and restore its position.
  """

  def __init__(
    self,
    *,
    learner: Learner,
    data: Iterator[dict[str, np.ndarray]],
    client: SyncerClient,
    layout_digest: str,
    layouts: list[wire.Layout],
    writer: MetricsWriter | None = None,
    batch_size: int = 0,
    log_every: int = 10,
    connect_timeout_s: float = 120.0,
    checkpointer: LearnerCheckpointer | None = None,
    senders: int = 2,
  ):
    if checkpointer is not None and not (hasattr(data, "get_state") and hasattr(data, "set_state")):
      raise ValueError(
        "Checkpointing needs a data iterator with get_state/set_state: without its position a "
        "restarted learner would repeat or skip data."
      )
    self.learner = learner
    # The training loop checks apply digests when the arrays are ready (Learner.defer_digests).
    learner.defer_digests = True
    self.id = learner.learner_id
    self._data = data
    self._client = client
    # Registration, held versions (bases and anchors) with their digests, pulls and pushes.
    self._link = SyncerLink(
      client, learner_id=self.id, layouts=layouts, layout_digest=layout_digest
    )
    self._layouts = layouts
    self._writer = writer
    self._batch_size = batch_size
    self._log_every = log_every
    self._connect_timeout_s = connect_timeout_s
    self._lock = threading.Lock()
    self._received: queue.Queue[FragmentState] = queue.Queue()
    # From the Rounds stream: (request, monotonic arrival time).
    self._requests: queue.Queue[tuple[RoundRequest, float]] = queue.Queue()
    self._asked_at: dict[tuple[int, int], float] = {}  # (p, round step) -> arrival, until answered.
    # Seconds from a request's arrival to the answer's snapshot, and from the snapshot to the
    # syncer's reply: where an answer that misses its round's grace window lost its time.
    # `to_reply` splits into `queued` (waiting for the sender), `host_copy` and `push` (encoding,
    # the stream and the syncer's filing).
    self._latency: dict[str, collections.deque[float]] = {
      k: collections.deque(maxlen=4096)
      for k in ("to_snapshot", "to_reply", "queued", "host_copy", "push")
    }
    self._announced: dict[int, int] = {}  # Fragment -> newest version announced, not yet pulled.
    self._announce_cv = threading.Condition(self._lock)
    # (fragment, report step, answer), or (fragment, report step, step of the newer report it was
    # folded into): a report whose push failed after a newer snapshot of p was queued.
    self._results: queue.Queue[tuple[int, int, ReportResult | int]] = queue.Queue()
    self._settle: tuple[list[int], list[int]] | None = None  # Newest (versions, merged_steps).
    self._jobs: dict[int, _Job] = {}
    self._jobs_cv = threading.Condition(self._lock)
    self._in_flight = 0
    if senders < 1:
      raise ValueError(f"senders must be >= 1, got {senders}.")
    self._senders = senders
    self._sending: set[int] = set()  # Fragments with a push in flight (one push per fragment).
    self._stop = threading.Event()
    self._need_register = threading.Event()
    self._threads: list[threading.Thread] = []
    self._stream: Any = None  # The current Rounds subscription (cancelled at the end).
    # Waits for each step in flight, woken by round requests (`_await_step`); made by `start`.
    self._step_waiter: StepWaiter | None = None
    self._newest_round_step = -1  # The newest round step asked for (`_standby`).
    self.codec = "fp32"
    self.heartbeat_interval_s = 0.25
    self.step_time_s = 0.0
    self.push_status: collections.Counter[str] = collections.Counter()
    self.applies: list[tuple[int, int, str]] = []
    self.digest_mismatches = 0
    self.tokens_trained = 0
    self.train_start = self.train_end = 0.0
    self._stop_requested = False
    self.fleet_step = -1  # The syncer's step clock, as last heard.
    self.rounds_asked = 0
    self.blocked_s = 0.0  # Time waiting for merges (`blocking` only).
    self._waits = 0  # Iterations of `_wait_for_merges` (a multi-process learner shares at each).
    self.registrations = 0
    self.recoveries = 0  # Fragments handed back to a restarted syncer that had lost them.
    self.last_staleness_steps = 0
    self.unreachable_s = 0.0
    self.losses: list[tuple[int, float, float]] = []  # (step, time, loss)
    # Accepted with weight 0 (docs/algorithm.md §3: not received since registering).
    self.zero_weight_pushes = 0
    self.checkpointer = checkpointer
    # "own:<step>", "peer:<id>:<step>" or "fresh" once restored; None before.
    self.restored_from: str | None = None
    self.resumed_step = 0
    self._t0 = time.time()

  # -- connection -----------------------------------------------------------------------------

  def restore(self) -> str:
    """Restores step, inner optimizer state, data position and token count (docs/algorithm.md §6).

    Along the checkpointer's chain own → peer → fresh (checkpoint/learner.py); without a
    checkpointer the learner starts fresh. The parameters are not restored: `connect` loads the
    syncer's global fragments over all of them. Call before training (`connect` calls it once).

    Returns:
      "own:<step>", "peer:<id>:<step>" or "fresh".
    """
    if self.checkpointer is None:
      self.restored_from = "fresh"
      return self.restored_from
    restored = self.checkpointer.restore()
    if restored.opt_state is not None:
      self.learner.opt_state = restored.opt_state
    if restored.data_state is not None:
      self._data.set_state(restored.data_state)
    self.learner.step = restored.step  # Only "own" moves it: a peer's step is not this learner's.
    self.tokens_trained = restored.tokens_trained
    if restored.ledger is not None:  # Otherwise (fresh, peer) the ledger books from here.
      self.learner.ledger.load_state(restored.ledger)
      self.learner.ledger.restored()
    self.restored_from, self.resumed_step = restored.restored_from, restored.step
    self._event(
      "restore",
      restored_from=restored.restored_from,
      step=restored.step,
      tokens=restored.tokens_trained,
      directory=self.checkpointer.directory,
      discarded_steps=list(restored.discarded_steps),
    )
    log.info(
      "learner %d: restored from %s at step %d", self.id, restored.restored_from, restored.step
    )
    return self.restored_from

  def connect(self) -> None:
    """Restores (once), registers and loads the global model (blocking, the only wait; docs/algorithm.md §6).

    Raises:
      TimeoutError: if the syncer did not answer within `connect_timeout_s`.
      grpc.RpcError: if the syncer refused the registration (e.g. layout mismatch).
    """
    if self.restored_from is None:
      self.restore()  # Before align_phase below, which reads the restored step.
    resp, loaded = self._fetch_global()
    self._adopt_global(loaded, int(resp.fleet_step), list(resp.versions))

  def _fetch_global(self) -> tuple[Any, list[FragmentState]]:
    """The network half of `connect`: registers and pulls every fragment, with retries.

    Returns:
      The RegisterResponse and the fragments the syncer holds.
    """
    deadline = time.monotonic() + self._connect_timeout_s
    backoff = Backoff()
    while True:
      try:
        self._client.wait_ready(max(0.1, min(5.0, deadline - time.monotonic())))
        resp = self.register()
        states = [self._pull(p, -1) for p in range(len(self._layouts))]
        break
      except (grpc.RpcError, grpc.FutureTimeoutError) as e:
        code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
        if code not in _TRANSIENT or time.monotonic() > deadline:
          if code in _TRANSIENT:
            raise TimeoutError(
              f"Syncer at {self._client.address} unreachable for {self._connect_timeout_s} s."
            ) from e
          raise
        time.sleep(backoff.next_delay())
    return resp, [s for s in states if s is not None]

  def _adopt_global(
    self, loaded: list[FragmentState], fleet_step: int, versions: list[int]
  ) -> None:
    """The device half of `connect`: loads the global fragments and joins the fleet's cadence.

    Separate from `_fetch_global` so that a multi-process learner's other processes, which never
    talk to the syncer, load the same fragments (distributed/multihost.py).
    """
    self.learner.load_global(loaded)
    # What the devices now hold must be the syncer's bits (docs/algorithm.md §4.7).
    for state in loaded:
      if self.learner.applied_digest.get(state.fragment) != state.digest:
        self.digest_mismatches += 1
        log.error("learner %d: global fragment %d digest mismatch", self.id, state.fragment)
    self.learner.align_phase(fleet_step)
    self.learner.join_schedule(fleet_step)  # A late joiner continues the fleet's LR schedule.
    self._event("connected", versions=versions, fleet_step=fleet_step)

  def register(self):
    """Registers with the syncer: a new epoch there, so nothing counts as delivered until pulled.

    Until this learner has pulled fragment p again, its reports of p weigh 0 (docs/algorithm.md §3). `connect`
    registers and pulls everything; the comm thread re-registers when the syncer forgot us.

    Returns:
      The RegisterResponse (versions, cadence, codecs).
    """
    resp = self._link.register(
      num_devices=len(self.learner.steps.mesh.devices.flat),
      batch_size=self._batch_size,
      host=socket.gethostname(),
    )
    for p, version, adopted in resp.recovered:  # Versions a restarted syncer had lost.
      self.recoveries += int(adopted)
      self._event("recover", fragment=p, version=version, adopted=adopted)
    self.codec = resp.uplink_codec
    self.heartbeat_interval_s = resp.heartbeat_interval_s
    if resp.overlap != self.learner.schedule.overlap:
      raise ValueError(
        f"The syncer's overlap τ={resp.overlap} differs from this learner's "
        f"{self.learner.schedule.overlap}: check the gin configs."
      )
    self.registrations += 1
    self._need_register.clear()
    return resp

  def _unregistered(self, error: grpc.RpcError, epoch: int) -> bool:
    """Whether a failed call means this learner must register again.

    A call refused PERMISSION_DENIED carried a stale session; if this learner registered since the
    call began (`epoch`: `registrations` then), the new session already fixes it, and registering
    once more would only void the session of the calls now in flight.
    """
    if error.code() == grpc.StatusCode.PERMISSION_DENIED:
      return self.registrations == epoch
    return error.code() in _UNREGISTERED

  def _announce(self, p: int, version: int) -> None:
    """Asks the puller for version `version` of p (or newer), unless it is held already."""
    if not 0 <= p < len(self._layouts):
      return
    with self._announce_cv:
      if version > self._link.newest(p) and version > self._announced.get(p, -1):
        self._announced[p] = version
        self._announce_cv.notify_all()

  def _pull(self, p: int, known: int) -> FragmentState | None:
    return self._link.pull(p, known)

  # -- background threads ---------------------------------------------------------------------

  def start(self) -> None:
    if self.learner.answers_mid_step and self._step_waiter is None:
      self._step_waiter = StepWaiter(name=f"learner{self.id}-step")
    loops = (
      *((functools.partial(self._send_loop, k), f"sender{k}") for k in range(self._senders)),
      (self._comm_loop, "comm"),
      (self._round_loop, "rounds"),
      (self._pull_loop, "puller"),
    )
    for target, name in loops:
      t = threading.Thread(target=target, name=f"learner{self.id}-{name}", daemon=True)
      t.start()
      self._threads.append(t)

  def _comm_loop(self) -> None:
    backoff = Backoff(seed=self.id)
    down_since = None
    while not self._stop.is_set():
      try:
        if self._need_register.is_set():
          self.register()
        hb = self._client.heartbeat(
          self.id, step=self.learner.schedule_step, step_time_s=self.step_time_s
        )
        if not hb.registered:
          self._need_register.set()
          continue
        self.fleet_step = int(hb.fleet_step)
        with self._lock:  # The training thread settles the ledger with it (_drain).
          self._settle = (list(hb.versions), list(hb.merged_steps))
        for p, version in enumerate(hb.versions):
          self._announce(p, int(version))  # Missed by the Rounds stream (e.g. reconnecting).
        if down_since is not None:
          self.unreachable_s += time.monotonic() - down_since
          self._event("reconnected", after_s=round(time.monotonic() - down_since, 3))
          down_since = None
        backoff.reset()
        self._stop.wait(self.heartbeat_interval_s)
      except grpc.RpcError as e:
        if e.code() in _UNREGISTERED:
          self._need_register.set()
          self._stop.wait(backoff.next_delay())
          continue
        if down_since is None:
          down_since = time.monotonic()
          self._event("unreachable", code=e.code().name, details=e.details())
        self._stop.wait(backoff.next_delay())

  def _round_loop(self) -> None:
    """Holds the Rounds stream: queues round requests, pulls announced versions (docs/algorithm.md §3)."""
    backoff = Backoff(seed=2000 + self.id)
    while not self._stop.is_set():
      if self._need_register.is_set():
        self._stop.wait(0.05)  # The comm thread registers; a stream before that is refused.
        continue
      epoch = self.registrations
      stream = self._client.rounds(self.id)
      self._stream = stream
      try:
        for event in stream:
          if self._stop.is_set():
            break
          if isinstance(event, RoundRequest):
            self._requests.put((event, time.monotonic()))
            waiter = self._step_waiter
            if waiter is not None:
              waiter.poke()  # Answered at once, with θ of the last step (`_await_step`).
          else:
            self._announce(*event)
          backoff.reset()
      except grpc.RpcError as e:
        if self._stop.is_set():
          break
        if self._unregistered(e, epoch):
          self._need_register.set()
        elif e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # A subscription's end: renew it.
          self._stop.wait(backoff.next_delay())
      finally:
        stream.cancel()

  def _pull_loop(self) -> None:
    """Pulls every announced version, newest first per fragment, in announcement order."""
    backoff = Backoff(seed=3000 + self.id)
    while not self._stop.is_set():
      with self._announce_cv:
        while not self._announced and not self._stop.is_set():
          self._announce_cv.wait(0.5)
        announced, self._announced = self._announced, {}
        known = {p: self._link.newest(p) for p in announced}
      epoch = self.registrations
      try:
        for p, version in announced.items():
          if version > known[p]:
            state = self._pull(p, known[p])
            if state is not None:
              self._received.put(state)
        backoff.reset()
      except grpc.RpcError as e:  # The heartbeat announces the version again once it answers.
        if self._unregistered(e, epoch):
          self._need_register.set()
        self._stop.wait(backoff.next_delay())
      except WireError as e:  # A corrupt or mismatching fragment: fetch it in full next time.
        log.error("learner %d: bad fragment from the syncer: %s", self.id, e)
        self._event("bad_fragment", error=str(e))
        self._link.forget_deliveries()
        self._stop.wait(backoff.next_delay())

  def _ready_jobs(self) -> list[int]:
    """Fragments with a queued push and none in flight (caller holds the lock)."""
    return [q for q in self._jobs if q not in self._sending]

  def _send_loop(self, k: int = 0) -> None:
    """One of `senders` threads: pushes the oldest queued answer whose fragment has no push in
    flight. Several pushes in flight keep answers from queueing behind a slow one."""
    backoff = Backoff(seed=1000 + 100 * k + self.id)
    while True:
      with self._jobs_cv:
        while not self._ready_jobs() and not self._stop.is_set():
          self._jobs_cv.wait()
        ready = self._ready_jobs()
        if not ready:  # Stopping: what is left is another sender's to finish.
          return
        p = min(ready, key=lambda q: self._jobs[q].report.step)
        job = self._jobs.pop(p)
        self._sending.add(p)
        self._in_flight += 1
      epoch = self.registrations
      try:
        result = self._push(job)
        self._record_latency(job, late=result.status == "late")
      except grpc.RpcError as e:
        result = None
        if e.code() == grpc.StatusCode.PERMISSION_DENIED and not self._unregistered(e, epoch):
          pass  # Sent with the session a new registration replaced: push it again (unfiled).
        elif e.code() in _UNREGISTERED:
          self._need_register.set()
          result = ReportResult("rejected", e.details() or "", 0.0)
        elif e.code() not in _TRANSIENT:
          log.error("learner %d: push of %d refused: %s %s", self.id, p, e.code(), e.details())
          result = ReportResult("rejected", e.details() or "", 0.0)
      except ValueError as e:  # θ_p cannot be encoded (NaN/Inf): never sent, never retried.
        log.error("learner %d: answer of fragment %d not sent: %s", self.id, p, e)
        result = ReportResult("rejected", str(e), 0.0)
      with self._jobs_cv:
        self._in_flight -= 1
        self._sending.discard(p)
        newer = self._jobs.get(p)
        if result is None and newer is None and not self._stop.is_set():
          self._jobs[p] = job  # Retry unless a newer snapshot of p replaced it.
        elif result is None and newer is not None:
          # The newer θ_p holds this one's progress: its ledger tokens ride along (ledger.py).
          self._jobs[p] = _fold(job, newer)
          self._results.put((p, job.report.step, newer.report.step))
        self._jobs_cv.notify_all()
      if result is None:
        self._stop.wait(backoff.next_delay())
        continue
      backoff.reset()
      self._results.put((p, job.report.step, result))

  def _record_latency(self, job: _Job, *, late: bool = False) -> None:
    """Books an answer's latencies (`answer_latency`); a late answer's also go to metrics.jsonl
    as a `late_answer` event, to show where it lost its time."""
    if job.asked_at is None or job.answered_at is None:
      return
    now = time.monotonic()
    times = {"to_snapshot": job.answered_at - job.asked_at, "to_reply": now - job.answered_at}
    if job.picked_at is not None and job.copied_at is not None:
      times["queued"] = job.picked_at - job.answered_at
      times["host_copy"] = job.copied_at - job.picked_at
      times["push"] = now - job.copied_at
    with self._lock:
      for k, v in times.items():
        self._latency[k].append(v)
    if late:
      report = job.report
      self._event(
        "late_answer",
        fragment=report.fragment,
        round_step=report.round_step,
        step=report.step,
        **{f"{k}_s": round(v, 4) for k, v in times.items()},
      )

  def answer_latency(self) -> dict[str, dict[str, float]]:
    """Median and 90th percentile, in seconds, of the answers' `to_snapshot` (a round request's
    arrival to the answer's snapshot at a step boundary) and `to_reply` (the snapshot to the
    syncer's reply) times; `to_reply` split into `queued` (waiting for the sender thread),
    `host_copy` and `push` (encoding, the stream and the syncer's filing)."""
    with self._lock:
      samples = {k: list(v) for k, v in self._latency.items()}
    return quantiles(samples)

  def _push(self, job: _Job) -> ReportResult:
    job.picked_at = time.monotonic()
    report = dataclasses.replace(job.report, values=job.fetch())
    job.copied_at = time.monotonic()
    return self._link.push(report, job.anchor_values)

  # -- training -------------------------------------------------------------------------------

  def _drain(self) -> None:
    while True:
      try:
        p, step, result = self._results.get_nowait()
      except queue.Empty:
        break
      if isinstance(result, int):
        self.learner.ledger.fold(p, step, result)
        continue
      self.push_status[result.status] += 1
      if result.status == "accepted" and result.weight == 0:
        self.zero_weight_pushes += 1
      self.learner.on_report_result(p, result, step=step)
      if result.fleet_step >= 0:
        self.fleet_step = result.fleet_step
    while True:
      try:
        self.learner.receive(self._received.get_nowait())
      except queue.Empty:
        break
    while True:  # After the fragments: a request whose round already merged is dropped.
      try:
        request, arrived = self._requests.get_nowait()
      except queue.Empty:
        break
      self.learner.ask(request)
      self._newest_round_step = max(self._newest_round_step, request.round_step)
      self._asked_at[(request.fragment, request.round_step)] = arrived
      self.rounds_asked += 1
    with self._lock:
      settle, self._settle = self._settle, None
    if settle is not None:
      self.learner.ledger.settle(*settle)

  def _send_due(self) -> None:
    for p in self.learner.due():
      report, fetch = self.learner.snapshot_report(p, step_time_s=self.step_time_s)
      # Inner steps θ_p trained away from the last global version applied (TensorBoard).
      self.last_staleness_steps = report.steps
      now = time.monotonic()
      asked_at = self._asked_at.pop((p, report.round_step), None)
      for key in [k for k in self._asked_at if k[0] == p and k[1] < report.round_step]:
        del self._asked_at[key]  # Requests dropped unanswered (their rounds merged meanwhile).
      with self._jobs_cv:
        anchor = self._link.anchor_values(p, report.anchor_version)
        job, older = _Job(report, fetch, anchor, asked_at, now), self._jobs.get(p)
        if older is not None:  # Never pushed: the new snapshot holds its progress and its tokens.
          job = _fold(older, job)
          self.learner.ledger.fold(p, older.report.step, report.step)
        self._jobs[p] = job
        self._jobs_cv.notify_all()

  def _apply(self) -> None:
    for p, version in self.learner.apply_ready():
      self._link.forget_before(p, version)  # Never a base or an anchor again.
    self._check_applies()

  def _wait_for_merges(self) -> None:
    """`blocking` only: waits at answer + τ until the round's merge has arrived (docs/algorithm.md §3)."""
    t0 = time.monotonic()
    while self.learner.blocked() and not self._stop_requested and not self._stop.is_set():
      self._stop.wait(0.002)
      self._waits += 1
      self._boundary()
    self.blocked_s += time.monotonic() - t0

  def _boundary(self) -> None:
    """The protocol's work at a step boundary: answers, applies, then answers rounds asked."""
    self._drain()
    self._apply()
    self._send_due()

  def _check_applies(self, *, block: bool = False) -> None:
    """Compares the digests of applies read back so far with the syncer's (docs/algorithm.md §4.7)."""
    for p, version, got in self.learner.verified_applies(block=block):
      expected = self._link.digest(p, version)
      if got is not None and got != expected:
        self.digest_mismatches += 1
        log.error("learner %d: fragment %d v%d digest %s != %s", self.id, p, version, got, expected)
      self.applies.append((p, version, got or ""))

  def request_stop(self) -> None:
    """Makes `run` return after the current step (signal handlers call this)."""
    self._stop_requested = True

  def run(self, num_steps: int) -> dict[str, Any]:
    """Trains until the learner's step reaches `num_steps` (or a stop request), then saves a final
    checkpoint, flushes, leaves and summarizes: a graceful stop (SIGTERM) loses no step."""
    self.start()
    train_s = self.train(num_steps)
    self.save_checkpoint()
    self.finish()
    return self.summary(train_s)

  def train(self, num_steps: int) -> float:
    """The training loop, until the step reaches `num_steps` or a stop is requested.

    Needs the background threads (`start`). Saves a checkpoint at every due step. Returns the
    seconds spent.
    """
    t_first = time.monotonic()
    recent: collections.deque[float] = collections.deque(maxlen=17)
    previous = None
    done = 0  # Steps of this call: a restored learner compiles on its first steps too.
    self.train_start = time.time()
    while self.learner.step < num_steps and not self._stop_requested:
      self._drain()
      if previous is not None and (self.learner.config.blocking or self.learner.due()):
        # An answer snapshots θ of the step last dispatched: wait for that step here, before
        # dispatching the next, so the sender's host copy is ready at once. Snapshotting after
        # the next dispatch made every answer wait a whole step more in the sender (the main
        # job's answers then missed their rounds' grace windows).
        jax.block_until_ready(previous)
      self._boundary()
      if self.learner.config.blocking:
        self._wait_for_merges()
      batch = next(self._data)
      if self.learner.config.step_in_flight:  # The boundary's work overlaps the next step.
        metrics = self.learner.train_step(batch)
      else:
        metrics = self.learner.start_step(batch, standby=self._standby())
      done += 1
      # At most one step in flight: wait for the previous step's loss (it releases the GIL for
      # the sender and comm threads). Without this, asynchronous dispatch let the step counter
      # run up to a logging interval ahead of the devices, and the schedule with it.
      if previous is not None:
        jax.block_until_ready(previous)
      previous = metrics["loss"]
      if not self.learner.config.step_in_flight:
        # The step is done before the protocol's work, and a round request that arrives during
        # it is answered at once with θ of the last step (with the next step in flight, it
        # waited for that step too: 1.5 steps on average, and the main job's answers missed
        # their windows).
        self._await_step(previous)
        self.learner.end_step()
      self.tokens_trained += int(np.prod(batch["targets"].shape))
      if self.checkpointer is not None and self.checkpointer.due(self.learner.step):
        self.save_checkpoint()
      now = time.monotonic()
      # Step time over the last steps, not an EMA of loop times: with asynchronous dispatch one
      # loop can take microseconds and the next a whole step. The first steps compile: left out.
      if done > _WARMUP_STEPS:
        recent.append(now)
        if len(recent) >= 2:
          self.step_time_s = (recent[-1] - recent[0]) / (len(recent) - 1)
      if self.learner.step % self._log_every == 0 or self.learner.step == num_steps:
        loss = float(metrics["loss"])
        self.losses.append((self.learner.step, time.time(), loss))
        self._event(
          "train",
          step=self.learner.step,
          loss=loss,
          step_time_s=self.step_time_s,
          schedule_step=self.learner.schedule_step,
        )
        if self._writer is not None:
          self._write_scalars(loss)
          self._writer.flush()  # The launcher tails metrics.jsonl for its progress lines.
    if previous is not None:  # The last step's boundary: answers and applies.
      jax.block_until_ready(previous)
      self._boundary()
    self._check_applies(block=True)  # The deferred digest checks of the last applies.
    self.train_end = time.time()
    return time.monotonic() - t_first

  def _await_step(self, loss: jax.Array) -> None:
    """Waits for the step in flight; rounds asked meanwhile are answered at once, with θ_p of the
    last step (`Learner.start_step`), where the learner can read it."""
    if not self.learner.answers_mid_step:  # A multi-process learner: at boundaries only.
      jax.block_until_ready(loss)
      return
    if self._step_waiter is None:
      self._step_waiter = StepWaiter(name=f"learner{self.id}-step")
    self._step_waiter.wait(loss, self._answer_mid_step)

  def _answer_mid_step(self) -> None:
    self._drain()
    self._send_due()

  def _standby(self) -> tuple[int, ...]:
    """The fragments the syncer will likely ask for during the next step: those due at the two
    round steps after the newest asked (copied on device where the step donates θ)."""
    if not self.learner.copies_standby or self._newest_round_step < 0:
      return ()  # On CPU θ stays readable without copies.
    t = max(self._newest_round_step, self.fleet_step)
    return tuple(p for s in (t + 1, t + 2) for p in self.learner.schedule.due(s))

  def save_checkpoint(self) -> bool:
    """Starts an asynchronous save of the current step (training thread only; docs/algorithm.md §6).

    Returns:
      False without a checkpointer, at step 0, or if this step is already saved.
    """
    if self.checkpointer is None or self.learner.step < 1:
      return False
    t = time.monotonic()
    saved = self.checkpointer.save(
      self.learner.step,
      opt_state=self.learner.opt_state,
      data_state=self._data.get_state(),
      tokens_trained=self.tokens_trained,
      schedule_step=self.learner.schedule_step,
      ledger=self.learner.ledger.state(),
    )
    if saved:
      self._event("checkpoint", step=self.learner.step, blocking_s=round(time.monotonic() - t, 4))
    return saved

  def abandon(self) -> None:
    """Stops the background threads without flushing, saving or leaving: a crash (fault injection).

    Queued pushes are dropped and the syncer still counts this learner as alive, as after a
    SIGKILL. A save already started still completes in this process (a killed process would leave
    its tmp folder instead; checkpoint tests cover that case).
    """
    self._stop.set()
    self._close_step_waiter()
    self._cancel_stream()
    with self._jobs_cv:
      self._jobs.clear()
      self._jobs_cv.notify_all()
    for t in self._threads:
      t.join(timeout=10.0)

  def finish(self, timeout_s: float = 30.0) -> None:
    """Waits for queued pushes (bounded) and the pending checkpoint save, stops the threads and
    leaves the fleet."""
    deadline = time.monotonic() + timeout_s
    with self._jobs_cv:
      while (self._jobs or self._in_flight) and time.monotonic() < deadline:
        self._jobs_cv.wait(0.1)
    self._stop.set()
    self._close_step_waiter()
    self._cancel_stream()
    with self._jobs_cv:
      self._jobs_cv.notify_all()
      self._announce_cv.notify_all()
    for t in self._threads:
      t.join(timeout=max(1.0, deadline - time.monotonic()))
    self._drain()
    if self.checkpointer is not None:
      self.checkpointer.close()  # Waits until the last save is on disk.
    try:
      self._client.leave(self.id)
    except grpc.RpcError as e:
      log.warning("learner %d: leave failed: %s", self.id, e.code())

  def _close_step_waiter(self) -> None:
    waiter, self._step_waiter = self._step_waiter, None
    if waiter is not None:
      waiter.close()

  def _cancel_stream(self) -> None:
    stream = self._stream
    if stream is not None:
      stream.cancel()

  def summary(self, train_s: float) -> dict[str, Any]:
    """This learner's summary.json. `steps` and `tokens` run from the start of its shard, across
    restarts (a restored learner counts from its checkpoint; repeated batches count once)."""
    learner = self.learner
    return {
      "learner_id": self.id,
      "steps": learner.step,
      "tokens": self.tokens_trained,
      "train_time_s": train_s,
      "wall_time_s": time.time() - self._t0,
      "start_time": self._t0,
      "train_start": self.train_start,
      "train_end": self.train_end,
      "step_time_s": self.step_time_s,
      "push_status": dict(self.push_status),
      "applies": [list(a) for a in self.applies],
      "digest_mismatches": self.digest_mismatches,
      "registrations": self.registrations,
      "recoveries": self.recoveries,
      "rounds_asked": self.rounds_asked,
      "answer_latency_s": self.answer_latency(),
      "blocked_s": self.blocked_s,
      "fleet_step": self.fleet_step,
      "unreachable_s": self.unreachable_s,
      "bytes_up": self._client.bytes_up,
      "bytes_down": self._client.bytes_down,
      "losses": [list(x) for x in self.losses],
      "uplink_codec": self.codec,
      "zero_weight_pushes": self.zero_weight_pushes,
      "restored_from": self.restored_from,
      "resumed_step": self.resumed_step,
      "checkpoint_steps": list(self.checkpointer.saved_steps) if self.checkpointer else [],
      "ledger": learner.ledger.totals(),
    }

  def _write_scalars(self, loss: float) -> None:
    """This learner's TensorBoard scalars, against the tokens it trained (and its step)."""
    tag = f"learner_{self.id}"
    rate = 1.0 / self.step_time_s if self.step_time_s > 0 else 0.0
    self._writer.scalars(
      {f"{tag}/loss": loss, f"{tag}/step_rate": rate},
      tokens=self.tokens_trained,
      step=self.learner.step,
    )
    self._writer.scalars(
      {
        f"{tag}/staleness_steps": self.last_staleness_steps,
        f"{tag}/late_reports": self.push_status["late"],
        f"{tag}/merged_fraction": self.learner.ledger.totals().get("merged_fraction", 0.0),
        f"{tag}/blocked_s": self.blocked_s,
        f"{tag}/bytes_up": self._client.bytes_up,
        f"{tag}/bytes_down": self._client.bytes_down,
      },
      tokens=self.tokens_trained,
    )

  def _event(self, kind: str, **fields: Any) -> None:
    if self._writer is not None:
      self._writer.event(kind, time=round(time.time(), 4), learner=self.id, **fields)
