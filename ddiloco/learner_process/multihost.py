"""One learner formed by several JAX processes: process 0 talks to the syncer, the others follow.

A learner on a multi-host slice is one multi-controller JAX job (docs/algorithm.md §1): its mesh spans the devices
of all its processes, so every process must launch the same computations (train steps, snapshot
copies, digest read-backs: collectives) in the same order, and all must hold bit-identical parameters.
`MultihostWorker` keeps that invariant around a `LearnerWorker` it holds:

- Only the leader (process 0) has a syncer client and background threads: it registers, heartbeats,
  pushes and pulls. The others hold a client that raises if anything touches it.
- Everything that steers the learner's protocol state arrives on the leader's threads (round
  requests, merged fragments, push answers) and reaches the training thread only through its drain
  (`TrainingLoop.drain`). Once per step (and once per wait while a `blocking` learner waits for a
  merge), just before that drain (the worker's `before_drain`), the leader shares
  exactly what it drains there (`ProcessGroup.share`, as the syncer's own messages:
  transport/process_share.py, exact to the bit); every process then feeds the same items to
  its `Learner`, so `due`, `blocked` and `apply_ready` decide the same sends, waits and applies at
  the same step everywhere, and the digest of every apply is checked
  on every process. The shared header also carries stop requests (SIGTERM on any process stops all
  at the same step) and a connect failure (the others raise instead of waiting forever).
- A due fragment is replicated across the learner's devices (`DeviceParams.host_readable`), so the
  leader's sender copies it to host memory without any further collective.

Learner checkpoints (checkpoint/learner.py with the learner's `ProcessGroup`): every process saves
at the same steps (their step counters and stop requests agree) and restores the same step,
process 0's choice; each restores its own data position, and all take the leader's step, tokens
and ledger, so a restarted learner resumes with the same state on every process.

The worker's inbox holds `_GatedQueue`s: the leader's threads still `put` into them, but the
training loop's drain only sees items released by a share, so nothing reaches the leader's learner
that the others did not get. The token ledger (learner/ledger.py) is bookkeeping of the leader's
reports: the followers' copy is approximate and the leader's summary is the learner's.
"""

import collections
import hashlib
import queue
from typing import Any

from ddiloco.learner.learner import Learner
from ddiloco.learner_process.inbox import Inbox
from ddiloco.learner_process.worker import LearnerWorker
from ddiloco.parallel.multihost import ProcessGroup
from ddiloco.transport import process_share


class _GatedQueue:
  """A queue whose consumer sees only what was released: `put` (any thread) -> `take_incoming` ->
  (shared with the other processes) -> `release` -> `get_nowait` (the training thread)."""

  def __init__(self):
    self._incoming: queue.Queue = queue.Queue()
    self._released: collections.deque = collections.deque()

  def put(self, item: Any) -> None:
    self._incoming.put(item)

  def take_incoming(self) -> list[Any]:
    items = []
    while True:
      try:
        items.append(self._incoming.get_nowait())
      except queue.Empty:
        return items

  def release(self, items: list[Any]) -> None:
    self._released.extend(items)

  def get_nowait(self) -> Any:
    try:
      return self._released.popleft()
    except IndexError:
      raise queue.Empty from None


class NoSyncer:
  """The syncer client of a follower process: only the leader talks to the syncer."""

  address = "(process 0 of this learner)"
  bytes_up = 0
  bytes_down = 0

  def __getattr__(self, name: str) -> Any:
    raise RuntimeError(
      f"SyncerClient.{name}: only process 0 of a multi-process learner talks to the syncer."
    )


class MultihostWorker:
  """A `LearnerWorker` for one process of a multi-process learner (see module docstring).

  Holds the worker (`worker`), whose training loop calls back before each drain to share what
  the leader drains (`_share_step`); followers send nothing and start no background threads.

  Args:
    group: this process's view of the learner's processes (its mesh is the learner's).
    **kwargs: `LearnerWorker` arguments; followers get any `client` (never used). A checkpointer
      must have been built with the same `group` (its saves and restores are collective).
  """

  def __init__(self, *, group: ProcessGroup, **kwargs: Any):
    self.group = group
    self._inbox = Inbox(requests=_GatedQueue(), received=_GatedQueue(), results=_GatedQueue())
    self.worker = LearnerWorker(
      inbox=self._inbox, before_drain=self._share_step, sends=group.is_leader, **kwargs
    )
    self.learner.device.host_readable = group.replicate
    self._stop_pending = False  # A stop request of this process, shared at the next share.
    # (learner.step, waits) at the last share: one share per step, and per wait for a merge.
    self._synced: tuple[int, int] = (-1, -1)
    self._local_only = False  # After training: no more collectives.
    self.params_digest = ""

  @property
  def learner(self) -> Learner:
    return self.worker.learner

  @property
  def stop_requested(self) -> bool:
    return self.worker.stop_requested

  # -- connection -----------------------------------------------------------------------------

  def connect(self) -> None:
    """Leader: registers and pulls; then every process loads the same global fragments (docs/algorithm.md §6).

    Raises:
      RuntimeError: on a follower, if the leader failed to connect.
      TimeoutError, grpc.RpcError: on the leader, as `LearnerWorker.connect`.
    """
    if self.worker.restored_from is None:
      self.worker.restore()
    payload = b""
    if self.group.is_leader:
      try:
        resp, loaded = self.worker.session.fetch_global()
        fleet_step, versions = int(resp.fleet_step), [int(v) for v in resp.versions]
        payload = process_share.encode_global(loaded, fleet_step, versions)
      except Exception:
        self.group.share(flag=True)  # The followers would otherwise wait for the leader forever.
        raise
    shared = self.group.share(payload)
    if shared.any_flag:
      raise RuntimeError("Process 0 of this learner could not connect to the syncer (its log).")
    if not self.group.is_leader:  # The leader keeps what it pulled: the payload holds its bits.
      loaded, fleet_step, versions = process_share.decode_global(
        shared.payload, self.worker.link.layouts
      )
    self.worker.loop.load_global(loaded, fleet_step, versions)

  def start(self) -> None:
    if self.group.is_leader:
      self.worker.start()

  def request_stop(self) -> None:
    """Stops every process of the learner after the step at which the request is shared."""
    self._stop_pending = True

  # -- the shared step ------------------------------------------------------------------------

  def _share_step(self, step: int, waits: int) -> bool:
    """Before each drain: shares the inbox once per step (and per wait for a merge); whether a
    process asked to stop."""
    if self._local_only:
      if self.group.is_leader:  # Final answers after training: the leader's summary counts them.
        for q in (self._inbox.results, self._inbox.received, self._inbox.requests):
          q.release(q.take_incoming())
    elif self._synced != (step, waits):
      self._synced = (step, waits)
      return self._share_inbox()
    return False

  def _share_inbox(self) -> bool:
    """Shares what the leader drains this step and any stop request; whether one was made."""
    inbox = self._inbox
    payload = b""
    if self.group.is_leader:
      drained = process_share.Drained(
        results=inbox.results.take_incoming(),
        states=inbox.received.take_incoming(),
        requests=inbox.requests.take_incoming(),
        settle=inbox.peek_settle(),
      )
      if drained:
        payload = process_share.encode_drained(drained)
    shared = self.group.share(payload, flag=self._stop_pending)
    if not shared.payload:
      return shared.any_flag
    if not self.group.is_leader:  # The leader keeps its own items: the payload holds their bits.
      drained = process_share.decode_drained(shared.payload, self.worker.link.layouts)
      inbox.post_settle(drained.settle)
    inbox.results.release(drained.results)
    inbox.received.release(drained.states)
    inbox.requests.release(drained.requests)
    return shared.any_flag

  # -- the end --------------------------------------------------------------------------------

  def run(self, num_steps: int) -> dict[str, Any]:
    """Trains, saves a final checkpoint and digests the parameters (every process, collectives),
    then the leader flushes and leaves."""
    self.start()
    train_s = self.worker.train(num_steps)
    self.worker.save_checkpoint()
    self.params_digest = self.digest_params()
    self._local_only = True
    self.finish()
    return self.summary(train_s)

  def digest_params(self) -> str:
    """A digest of every parameter (each fragment's digest, in order); a collective."""
    num = self.learner.layout.num_fragments
    text = ",".join(self.learner.device.digest(p) for p in range(num))
    return hashlib.sha256(text.encode()).hexdigest()

  def finish(self, timeout_s: float = 30.0) -> None:
    self._local_only = True
    if self.group.is_leader:
      self.worker.finish(timeout_s)
    else:
      self.worker.stop()
      if self.worker.checkpointer is not None:
        self.worker.checkpointer.close()  # Its last save's commit waits for every process.

  def summary(self, train_s: float) -> dict[str, Any]:
    out = self.worker.summary(train_s)
    out.update(
      process_index=self.group.process_index,
      num_processes=self.group.num_processes,
      params_digest=self.params_digest,
    )
    return out
