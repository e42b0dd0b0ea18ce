"""A learner process's answers on their way to the syncer: the queue of snapshots, the sender
threads that copy them to host memory and push them, their retries, and the answers' latencies.

The training thread queues each answer its step boundary made (`Senders.enqueue`; its θ_p a
device-side snapshot, its anchor the version it was formed against); a newer answer of a fragment
replaces an unsent older one, carrying its ledger tokens (learner/ledger.py).
Each sender thread pushes the oldest queued answer whose fragment has no push in flight, so at most
one push per fragment is in flight and an answer waits only behind pushes of its own fragment. Every
answer ends as one item of the inbox's `results` (learner_process/inbox.py).

To a sharded syncer (docs/architecture.md, "The sharded syncer") the S slices of a fragment are due
together and go to S shards: there are `count` threads per shard, and a thread takes an answer only
while its shard (fragment p's is p mod S, fragments/shards.py) has fewer than `count` pushes in
flight. So pushes to different shards never wait behind each other, and each shard sees at most
`count` pushes of this learner at once, as an unsharded syncer does.

A push that fails for a transient reason (the shard down, the connection cut) is queued again and
its shard backs off (`Backoff`, per shard): its answers wait out the delay while the threads go on
pushing the other shards' answers. A thread never sleeps in a backoff: with every thread asleep
after a down shard's failures (its answers being the oldest queued), a healthy shard's answers
waited seconds at a time and missed their rounds.
"""

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ddiloco.fragments import shards as shards_lib
from ddiloco.learner_process.link import SyncerLink
from ddiloco.learner_process.retry import TRANSIENT, UNREGISTERED, Backoff
from ddiloco.learner_process.session import SyncerSession
from ddiloco.metrics.writer import quantiles
from ddiloco.protocol import Answer, ReportResult

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
  answer: Answer
  asked_at: float | None = None  # Monotonic times: the round request's arrival, the answer's
  answered_at: float | None = None  # snapshot (for `answer_latency`).
  picked_at: float | None = None  # The sender took it; its host copy was ready at `copied_at`.
  copied_at: float | None = None


def _fold(older: _Job, newer: _Job) -> _Job:
  """`newer` carrying `older`'s ledger tokens too (the token ledger, learner/ledger.py)."""
  answer = dataclasses.replace(
    newer.answer, new_tokens=newer.answer.new_tokens + older.answer.new_tokens
  )
  return dataclasses.replace(newer, answer=answer)


class Senders:
  """The answers queued for the syncer and the threads that push them (see module docstring).

  Args:
    learner_id: this learner's id (logs, backoff seeds).
    link: the learner's link to the syncer (pushes).
    session: the learner's registration (epochs, re-registration).
    results: where each answer's outcome goes (the inbox's `results`).
    stop: set when the threads must stop.
    event: writes one event to this learner's metrics (`kind`, then its fields).
    count: sender threads per syncer shard, each with one push in flight (of different
      fragments): with one, an answer waits behind every slower push to its shard.
    shards: the syncer's shards, S: `count` x S threads, at most `count` pushes in flight to each.

  Attributes:
    count: the sender threads to run (`run(k)` for k in range(count)).

  Raises:
    ValueError: if `count` or `shards` < 1.
  """

  def __init__(
    self,
    *,
    learner_id: int,
    link: SyncerLink,
    session: SyncerSession,
    results: Any,
    stop: threading.Event,
    event: Callable[..., None],
    count: int = 2,
    shards: int = 1,
  ):
    if count < 1:
      raise ValueError(f"senders must be >= 1, got {count}.")
    if shards < 1:
      raise ValueError(f"shards must be >= 1, got {shards}.")
    self.count = count * shards
    self._per_shard, self._shards = count, shards
    self._busy = [0] * shards  # Pushes in flight to each shard.
    # Each shard's backoff after a transient failure, and when its answers may go again.
    self._backoff = [Backoff(seed=1000 + 100 * s + learner_id) for s in range(shards)]
    self._retry_at = [0.0] * shards
    self._id = learner_id
    self._link = link
    self._session = session
    self._results = results
    self._stop = stop
    self._event = event
    self._lock = threading.Lock()
    self._jobs: dict[int, _Job] = {}
    self._cv = threading.Condition(self._lock)
    self._in_flight = 0
    self._sending: set[int] = set()  # Fragments with a push in flight (one push per fragment).
    # Seconds from a request's arrival to the answer's snapshot, and from the snapshot to the
    # syncer's reply: where an answer that misses its round's grace window lost its time.
    # `to_reply` splits into `queued` (waiting for the sender), `host_copy` and `push` (encoding,
    # the stream and the syncer's filing).
    self._latency: dict[str, collections.deque[float]] = {
      k: collections.deque(maxlen=4096)
      for k in ("to_snapshot", "to_reply", "queued", "host_copy", "push")
    }

  def enqueue(
    self,
    answer: Answer,
    *,
    asked_at: float | None = None,
    answered_at: float | None = None,
  ) -> int | None:
    """Queues `answer` (its θ_p is copied to host memory, or encoded on the devices, when sent).

    Args:
      answer: the answer, as the learner's step boundary made it.
      asked_at: monotonic arrival time of the round request it answers (None: unknown).
      answered_at: monotonic time of the snapshot.

    Returns:
      The step of the unsent older answer of the same fragment it replaced (and holds the ledger
      tokens of; the caller folds them in its ledger), or None.
    """
    p = answer.fragment
    with self._cv:
      job, older = _Job(answer, asked_at, answered_at), self._jobs.get(p)
      if older is not None:  # Never pushed: the new snapshot holds its progress and its tokens.
        job = _fold(older, job)
      self._jobs[p] = job
      self._cv.notify_all()
    return None if older is None else older.answer.step

  def wait_idle(self, deadline: float) -> None:
    """Waits until nothing is queued or in flight, or until `deadline` (monotonic)."""
    with self._cv:
      while (self._jobs or self._in_flight) and time.monotonic() < deadline:
        self._cv.wait(0.1)

  def wake(self) -> None:
    """Wakes the sender threads (after `stop` was set)."""
    with self._cv:
      self._cv.notify_all()

  def drop_all(self) -> None:
    """Drops every queued answer and wakes the threads: a crash (`LearnerWorker.abandon`)."""
    with self._cv:
      self._jobs.clear()
      self._cv.notify_all()

  def _shard(self, p: int) -> int:
    return shards_lib.shard_of(p, self._shards)

  def _ready_jobs(self, now: float) -> list[int]:
    """Fragments with a queued push and none in flight, whose shard has a push to spare and is
    not backing off (caller holds the lock)."""
    return [
      q
      for q in self._jobs
      if q not in self._sending
      and self._busy[self._shard(q)] < self._per_shard
      and self._retry_at[self._shard(q)] <= now
    ]

  def _wait_s(self, now: float) -> float | None:
    """How long a thread with nothing ready may sleep: until the first backing-off shard with
    queued answers may push again (None: until woken). Caller holds the lock."""
    due = [self._retry_at[self._shard(q)] for q in self._jobs if q not in self._sending]
    due = [t for t in due if t > now]
    return max(0.0, min(due) - now) if due else None

  def run(self, k: int = 0) -> None:
    """One of `count` threads: pushes the oldest queued answer whose fragment has no push in
    flight and whose shard has a push to spare. Several pushes in flight keep answers from
    queueing behind a slow one."""
    del k  # Threads are alike; backoffs are per shard.
    while True:
      with self._cv:
        while not self._ready_jobs(time.monotonic()) and not self._stop.is_set():
          self._cv.wait(self._wait_s(time.monotonic()))
        ready = self._ready_jobs(time.monotonic())
        if not ready:  # Stopping: what is left is another sender's to finish.
          return
        p = min(ready, key=lambda q: self._jobs[q].answer.step)
        job = self._jobs.pop(p)
        self._sending.add(p)
        self._busy[self._shard(p)] += 1
        self._in_flight += 1
      epoch = self._session.registrations
      try:
        result = self._push(job)
        self._record_latency(job, late=result.status == "late")
      except grpc.RpcError as e:
        result = None
        if e.code() == grpc.StatusCode.PERMISSION_DENIED and not self._session.unregistered(
          e, epoch
        ):
          pass  # Sent with the session a new registration replaced: push it again (unfiled).
        elif e.code() in UNREGISTERED:
          self._session.need_register.set()
          result = ReportResult("rejected", e.details() or "", 0.0)
        elif e.code() not in TRANSIENT:
          log.error("learner %d: push of %d refused: %s %s", self._id, p, e.code(), e.details())
          result = ReportResult("rejected", e.details() or "", 0.0)
      except ValueError as e:  # θ_p cannot be encoded (NaN/Inf): never sent, never retried.
        log.error("learner %d: answer of fragment %d not sent: %s", self._id, p, e)
        result = ReportResult("rejected", str(e), 0.0)
      with self._cv:
        self._in_flight -= 1
        self._sending.discard(p)
        shard = self._shard(p)
        self._busy[shard] -= 1
        if result is None:  # Its shard waits; the threads go on with the other shards'.
          self._retry_at[shard] = time.monotonic() + self._backoff[shard].next_delay()
        else:
          self._backoff[shard].reset()
          self._retry_at[shard] = 0.0
        newer = self._jobs.get(p)
        if result is None and newer is None and not self._stop.is_set():
          self._jobs[p] = job  # Retry unless a newer snapshot of p replaced it.
        elif result is None and newer is not None:
          # The newer θ_p holds this one's progress: its ledger tokens ride along (ledger.py).
          self._jobs[p] = _fold(job, newer)
          self._results.put((p, job.answer.step, newer.answer.step))
        self._cv.notify_all()
      if result is not None:
        self._results.put((p, job.answer.step, result))

  def _push(self, job: _Job) -> ReportResult:
    job.picked_at = time.monotonic()

    def copied() -> None:
      job.copied_at = time.monotonic()

    return self._link.push(job.answer, on_copied=copied)

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
      answer = job.answer
      self._event(
        "late_answer",
        fragment=answer.fragment,
        round_step=answer.round_step,
        step=answer.step,
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
