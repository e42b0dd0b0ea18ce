"""A learner process's loop: train without ever waiting on the network (docs/algorithm.md §3, docs/architecture.md).

Five threads share one `Learner`, which only the training thread touches:

- the training thread steps, feeds round requests, received fragments and push answers to the
  learner's kernel and calls the step boundary (learner/boundary.py), which applies merged
  fragments τ steps after it answered their round, checking each apply's digest, and answers the
  rounds due, θ_p a device-side snapshot the senders push: learner_process/training.py;
- the rounds thread holds the syncer's `Rounds` stream: it queues every round request for the
  training thread and hands every announced version to the puller, so that a pull never delays a
  request;
- the puller pulls each announced version at once (a delta against the version held);
- two sender threads (`senders`) copy snapshots to host memory, encode the outer gradient
  Θ^(anchor) − θ with the uplink codec and push it, at most one push per fragment in flight
  (learner_process/senders.py);
- the comm thread sends heartbeats (the learner's step, from which the syncer's step clock takes the
  fleet's pace), announces any version it sees that the stream missed, and re-registers when the
  syncer forgot this learner (with the rounds thread and the puller: learner_process/listener.py).

With `LearnerConfig.blocking` (the synchronous baselines) the training thread waits at answer + τ
until the round's merge has arrived, as the simulated cluster does.

If the syncer is unreachable the learner keeps training; both background threads retry with
exponential backoff (and gRPC's channel reconnects with its own). Only the first registration, which
fetches the global model, waits (up to `connect_timeout_s`; learner_process/session.py).

With a `LearnerCheckpointer`, `connect` first restores the step, inner optimizer state and data
position (own checkpoint, a peer's, or fresh: checkpoint/learner.py), then loads the global fragments,
which overwrite every parameter (docs/algorithm.md §6). The training thread saves every `save_every_steps` steps
(asynchronously) and once more when it stops gracefully; docs/resilience.md states what a crash
repeats and loses.
"""

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import jax
import numpy as np

from ddiloco.checkpoint.learner import LearnerCheckpointer
from ddiloco.data import token_shards
from ddiloco.learner.learner import Learner
from ddiloco.learner_process.inbox import Inbox
from ddiloco.learner_process.link import SyncerLink
from ddiloco.learner_process.listener import SyncerListener
from ddiloco.learner_process.senders import Senders
from ddiloco.learner_process.session import SyncerSession
from ddiloco.learner_process.training import TrainingLoop
from ddiloco.metrics.writer import MetricsWriter
from ddiloco.transport import wire
from ddiloco.transport.client import SyncerClient

log = logging.getLogger(__name__)


def default_encode_workers(learner: Learner) -> int:
  """Threads for the host's encoding of an answer: 1 for a learner on CPU (its cores train), else
  half the CPUs this process may use, at most 8 (`JobConfig.encode_workers`)."""
  if learner.device.snapshot_by_reference:
    return 1
  return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class LearnerWorker:
  """Runs one learner against the syncer service (see module docstring).

  Its parts, each with the state of its concern: `session` (registration), `senders` (answers on
  their way), `listener` (the comm, rounds and puller threads), `inbox` (what those threads hand
  the training thread) and `loop` (the training thread, with its counters).

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
    senders: sender threads per syncer shard, each with one push in flight (of different
      fragments): with one, an answer waits behind every slower push to its shard.
    encode_workers: threads one answer's δ is encoded on where this host encodes it
      (`JobConfig.encode_workers`; 0: `default_encode_workers`).
    shards: the syncer's shards (`JobConfig.syncer_shards`): pulls from each have a thread of
      their own, and pushes to different shards go out
      side by side (learner_process/senders.py).
    inbox: the queues between the background threads and the training thread (default: plain
      queues; a multi-process learner gates them, learner_process/multihost.py).
    before_drain: called by the training thread with (step, waits) before each drain; True stops
      training after the current step (a multi-process learner shares its inbox there).
    sends: False on a process of a multi-process learner other than its leader: it snapshots
      what the leader answers (collectives) but sends nothing.

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
    encode_workers: int = 0,
    shards: int = 1,
    inbox: Inbox | None = None,
    before_drain: Callable[[int, int], bool] | None = None,
    sends: bool = True,
  ):
    if checkpointer is not None and not (hasattr(data, "get_state") and hasattr(data, "set_state")):
      raise ValueError(
        "Checkpointing needs a data iterator with get_state/set_state: without its position a "
        "restarted learner would repeat or skip data."
      )
    self.learner = learner
    # The training loop checks apply digests when the arrays are ready (Learner.defer_digests).
    learner.device.defer_digests = True
    self.id = learner.learner_id
    self._data = data
    self._client = client
    self._writer = writer
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    # Registration, pulls (into the versions the kernel holds: bases and anchors) and pushes.
    self.link = SyncerLink(
      client,
      learner_id=self.id,
      layouts=layouts,
      layout_digest=layout_digest,
      held=learner.kernel.held,
      encode_workers=encode_workers or default_encode_workers(learner),
    )
    self.inbox = inbox if inbox is not None else Inbox()
    self.session = SyncerSession(
      learner=learner,
      client=client,
      link=self.link,
      batch_size=batch_size,
      connect_timeout_s=connect_timeout_s,
      event=self._event,
    )
    self._shards = shards
    self.senders = Senders(
      learner_id=self.id,
      link=self.link,
      session=self.session,
      results=self.inbox.results,
      stop=self._stop,
      event=self._event,
      count=senders,
      shards=shards,
    )
    self.loop = TrainingLoop(
      learner=learner,
      data=data,
      inbox=self.inbox,
      senders=self.senders if sends else None,
      stop=self._stop,
      event=self._event,
      before_drain=before_drain,
    )
    self.listener = SyncerListener(
      learner_id=self.id,
      client=client,
      link=self.link,
      session=self.session,
      inbox=self.inbox,
      stop=self._stop,
      event=self._event,
      pace=self.loop.pace,
      on_request=self.loop.poke,
    )
    # Periodic work after each step, in this order.
    if checkpointer is not None:
      self.loop.add_hook(self._save_if_due)
    self.loop.add_hook(self._log_train, every=log_every, at_last=True)
    self.losses: list[tuple[int, float, float]] = []  # (step, time, loss)
    self.checkpointer = checkpointer
    # "own:<step>", "peer:<id>:<step>" or "fresh" once restored; None before.
    self.restored_from: str | None = None
    self.resumed_step = 0
    self.data_start: dict[str, int] | None = None  # Its data position once restored.
    self._t0 = time.time()

  @property
  def threads(self) -> tuple[threading.Thread, ...]:
    """The background threads `start` started."""
    return tuple(self._threads)

  @property
  def stop_requested(self) -> bool:
    return self.loop.stop_requested

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
      self.data_start = self.data_position()
      return self.restored_from
    restored = self.checkpointer.restore()
    if restored.opt_state is not None:
      self.learner.opt_state = restored.opt_state
    if restored.data_state is not None:
      self._data.set_state(restored.data_state)
    kernel = self.learner.kernel
    kernel.step = restored.step  # Only "own" moves it: a peer's step is not this learner's.
    self.loop.tokens_trained = restored.tokens_trained
    if restored.ledger is not None:  # Otherwise (fresh, peer) the ledger books from here.
      kernel.ledger.load_state(restored.ledger)
      kernel.ledger.restored()
    self.restored_from, self.resumed_step = restored.restored_from, restored.step
    self.data_start = self.data_position()
    self._event(
      "restore",
      restored_from=restored.restored_from,
      step=restored.step,
      tokens=restored.tokens_trained,
      directory=self.checkpointer.directory,
      discarded_steps=list(restored.discarded_steps),
      data=self.data_start,  # Where this life starts reading (run_summary.data_segments).
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
    resp, loaded = self.session.fetch_global()
    self.loop.load_global(loaded, int(resp.fleet_step), list(resp.versions))

  # -- running --------------------------------------------------------------------------------

  def start(self) -> None:
    """Starts the background threads: senders, comm, rounds and puller."""
    self.loop.start()
    loops = (
      *((functools.partial(self.senders.run, k), f"sender{k}") for k in range(self.senders.count)),
      (self.listener.comm_loop, "comm"),
      (self.listener.round_loop, "rounds"),
      *(
        (functools.partial(self.listener.pull_loop, shard=s, shards=self._shards), f"puller{s}")
        for s in range(self._shards)
      ),
    )
    for target, name in loops:
      t = threading.Thread(target=target, name=f"learner{self.id}-{name}", daemon=True)
      t.start()
      self._threads.append(t)

  def request_stop(self) -> None:
    """Makes `run` return after the current step (signal handlers call this)."""
    self.loop.stop_requested = True

  def run(self, num_steps: int) -> dict[str, Any]:
    """Trains until the learner's step reaches `num_steps` (or a stop request), then saves a final
    checkpoint, flushes, leaves and summarizes: a graceful stop (SIGTERM) loses no step."""
    self.start()
    train_s = self.train(num_steps)
    self.save_checkpoint()
    self.finish()
    return self.summary(train_s)

  def train(self, num_steps: int) -> float:
    """The training loop (`TrainingLoop.train`), until the step reaches `num_steps` or a stop is
    requested. Needs the background threads (`start`). Saves a checkpoint at every due step.
    Returns the seconds spent."""
    return self.loop.train(num_steps)

  def _save_if_due(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
    del metrics
    if self.checkpointer.due(step):
      self.save_checkpoint()

  def _log_train(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
    loss = float(metrics["loss"])
    self.losses.append((step, time.time(), loss))
    position = self.data_position()
    self._event(
      "train",
      step=step,
      loss=loss,
      step_time_s=self.loop.step_time_s,
      schedule_step=self.learner.kernel.schedule_step,
      # How far this life has read: a life killed later read at least this far.
      **({} if position is None else {"data_position": position["position"]}),
    )
    if self._writer is not None:
      self._write_scalars(loss)
      self._writer.flush()  # The launcher tails metrics.jsonl for its progress lines.

  def save_checkpoint(self) -> bool:
    """Starts an asynchronous save of the current step (training thread only; docs/algorithm.md §6).

    Returns:
      False without a checkpointer, at step 0, or if this step is already saved.
    """
    kernel = self.learner.kernel
    if self.checkpointer is None or kernel.step < 1:
      return False
    t = time.monotonic()
    saved = self.checkpointer.save(
      kernel.step,
      opt_state=self.learner.opt_state,
      data_state=self._data.get_state(),
      tokens_trained=self.loop.tokens_trained,
      schedule_step=kernel.schedule_step,
      ledger=kernel.ledger.state(),
      params=self.learner.params,  # Saved with `save_params` only, for export.
    )
    if saved:
      self._event("checkpoint", step=kernel.step, blocking_s=round(time.monotonic() - t, 4))
    return saved

  # -- the end --------------------------------------------------------------------------------

  def stop(self) -> None:
    """Tells the background threads and a `blocking` wait to stop (`finish`, `abandon`)."""
    self._stop.set()

  def abandon(self) -> None:
    """Stops the background threads without flushing, saving or leaving: a crash (fault injection).

    Queued pushes are dropped and the syncer still counts this learner as alive, as after a
    SIGKILL. A save already started still completes in this process (a killed process would leave
    its tmp folder instead; checkpoint tests cover that case).
    """
    self.stop()
    self.loop.close()
    self.listener.cancel_stream()
    self.senders.drop_all()
    for t in self._threads:
      t.join(timeout=10.0)

  def finish(self, timeout_s: float = 30.0) -> None:
    """Waits for queued pushes (bounded) and the pending checkpoint save, stops the threads and
    leaves the fleet."""
    deadline = time.monotonic() + timeout_s
    self.senders.wait_idle(deadline)
    self.stop()
    self.loop.close()
    self.listener.cancel_stream()
    self.senders.wake()
    self.listener.wake()
    for t in self._threads:
      t.join(timeout=max(1.0, deadline - time.monotonic()))
    self.loop.drain()
    if self.checkpointer is not None:
      self.checkpointer.close()  # Waits until the last save is on disk.
    try:
      self._client.leave(self.id)
    except grpc.RpcError as e:
      log.warning("learner %d: leave failed: %s", self.id, e.code())

  def data_position(self) -> dict[str, int] | None:
    """Where this learner's data stream is (`token_shards.stream_position`); None for a stream
    without numbered positions."""
    return token_shards.stream_position(self._data)

  def summary(self, train_s: float) -> dict[str, Any]:
    """This learner's summary.json. `steps` and `tokens` run from the start of its shard, across
    restarts (a restored learner counts from its checkpoint; repeated batches count once)."""
    kernel, loop, session = self.learner.kernel, self.loop, self.session
    return {
      "learner_id": self.id,
      "steps": kernel.step,
      "tokens": loop.tokens_trained,
      "train_time_s": train_s,
      "wall_time_s": time.time() - self._t0,
      "start_time": self._t0,
      "train_start": loop.train_start,
      "train_end": loop.train_end,
      "step_time_s": loop.step_time_s,
      "push_status": dict(loop.push_status),
      "applies": [list(a) for a in loop.applies],
      "digest_mismatches": loop.digest_mismatches,
      "registrations": session.registrations,
      "recoveries": session.recoveries,
      "rounds_asked": loop.rounds_asked,
      "answer_latency_s": self.senders.answer_latency(),
      "blocked_s": loop.blocked_s,
      "fleet_step": self.inbox.fleet_step,
      "unreachable_s": self.listener.unreachable_s,
      "bytes_up": self._client.bytes_up,
      "bytes_down": self._client.bytes_down,
      "losses": [list(x) for x in self.losses],
      "uplink_codec": session.codec,
      "zero_weight_pushes": loop.zero_weight_pushes,
      "restored_from": self.restored_from,
      "resumed_step": self.resumed_step,
      "checkpoint_steps": list(self.checkpointer.saved_steps) if self.checkpointer else [],
      "ledger": kernel.ledger.totals(),
      "carried_applies": kernel.answers.carried,  # learner/carry.py; 0 unless apply_rule = "carry".
      # The positions it read: from `start` (after its restore) to `end` (data/token_shards.py).
      "data": {"start": self.data_start, "end": self.data_position()},
    }

  def _write_scalars(self, loss: float) -> None:
    """This learner's TensorBoard scalars, against the tokens it trained (and its step)."""
    tag = f"learner_{self.id}"
    loop = self.loop
    rate = 1.0 / loop.step_time_s if loop.step_time_s > 0 else 0.0
    self._writer.scalars(
      {f"{tag}/loss": loss, f"{tag}/step_rate": rate},
      tokens=loop.tokens_trained,
      step=self.learner.kernel.step,
    )
    self._writer.scalars(
      {
        f"{tag}/staleness_steps": loop.last_staleness_steps,
        f"{tag}/late_reports": loop.push_status["late"],
        f"{tag}/merged_fraction": self.learner.kernel.ledger.totals().get("merged_fraction", 0.0),
        f"{tag}/blocked_s": loop.blocked_s,
        f"{tag}/bytes_up": self._client.bytes_up,
        f"{tag}/bytes_down": self._client.bytes_down,
      },
      tokens=loop.tokens_trained,
    )

  def _event(self, kind: str, **fields: Any) -> None:
    if self._writer is not None:
      self._writer.event(kind, time=round(time.time(), 4), learner=self.id, **fields)
