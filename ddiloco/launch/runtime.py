"""The syncer's and a learner's process bodies, shared by the entry points and the tests.

`SyncerRun` builds the initial global model from a `JobConfig`, restores it from its workdir, serves
it, evaluates it now and then and writes the syncer's `summary.json`. Each merge is journaled (and
fsync'd) before the service serves it; if that fails (a full disk) the service halts, `loop` returns
and `shutdown` stops without merging or checkpointing the version that was never served. `make_learner_worker` builds one learner's mesh, data and
`LearnerWorker`. The entry points (syncer_main, learner_main) only parse flags around them.
"""

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from ddiloco import storage
from ddiloco.checkpoint import syncer as ckpt_lib
from ddiloco.checkpoint.learner import (
  LearnerCheckpointConfig,
)
from ddiloco.fragments import shards as shards_lib
from ddiloco.launch import syncer_shards
from ddiloco.launch.job import JobConfig
from ddiloco.launch.learner_workers import worker_args
from ddiloco.learner_process.shard_client import ShardedClient
from ddiloco.learner_process.worker import LearnerWorker
from ddiloco.metrics.writer import MetricsWriter, write_summary
from ddiloco.service import server as server_lib
from ddiloco.syncer.core import MergeEvent
from ddiloco.transport import messages
from ddiloco.transport.client import SyncerClient

__all__ = ["SyncerRun", "make_learner_worker"]

log = logging.getLogger(__name__)


class SyncerRun:
  """One syncer process: global model, gRPC service, evaluations, summary."""

  def __init__(
    self,
    job: JobConfig,
    *,
    workdir: str,
    checkpoint: ckpt_lib.SyncerCheckpointConfig | None = None,
    shard: int = 0,
    shard_addresses: Sequence[str] = (),
  ):
    self.job = job
    # One shard of a sharded syncer (launch/syncer_shards.py): it merges only its fragments.
    self.shard, self.num_shards = shard, max(1, len(shard_addresses))
    self.workdir = workdir
    storage.require_local(
      workdir, who="The syncer", why="it fsyncs its merge journal before it serves a version"
    )
    storage.makedirs(workdir)
    self.factory = job.factory()
    self.layout = self.factory.layout
    self.writer = MetricsWriter(workdir)
    self.writer.event(
      "config",
      time=time.time(),
      params=self.factory.num_params,
      layout_digest=self.layout.digest,
      fragment_bytes=[self.layout.fragment_bytes(p) for p in range(self.layout.num_fragments)],
    )
    owned = shards_lib.owned(shard, self.num_shards, self.layout.num_fragments)
    # Only this shard's fragments are initialised: a shard holds 1/S of the model from the start.
    init_values = self.factory.global_init_values(owned)
    self.service = server_lib.make_syncer(
      fragment_keys=self.layout.fragments,
      init_values=init_values,
      syncer_config=job.run.the_syncer(),
      service_config=job.run.the_service(),
      layout_digest=self.layout.digest,
      embedding_keys=self.factory.embedding_keys(),
      schedule=job.run.the_schedule(),
      on_merge=self._on_merge,
      record=self._record,
      on_recovery=self._on_recovery,
      shard=shard,
      shard_addresses=shard_addresses,
    )
    del init_values
    # Shard 0 of several evaluates version 0 with the other shards' initial values, made when
    # that evaluation runs (`global_flat`) and dropped after it.
    self._others: dict[int, dict[str, np.ndarray]] | None = None
    self._others_initial = shard == 0 and self.num_shards > 1
    self.server: server_lib.SyncerServer | None = None
    self.merge_times: list[list] = []  # [wall time, fragment, version, contributors]
    # TensorBoard scalars of merges, written outside the service's lock (`_write_scalars`).
    self._scalars: collections.deque[tuple[dict[str, float], int]] = collections.deque()
    self.evals: list[tuple[float, int, float]] = []  # (time, merges, loss)
    self._t0 = time.time()
    self.checkpoint = checkpoint or ckpt_lib.SyncerCheckpointConfig()
    self.restored: ckpt_lib.RestoreInfo | None = None
    self._checkpointer: ckpt_lib.SyncerCheckpointer | None = None
    self._journal: ckpt_lib.MergeJournal | None = None
    self._version_log: ckpt_lib.VersionLog | None = None
    self._saved_step = -1
    self.checkpoints_saved = 0
    if self.checkpoint.enabled:
      self._restore()

  def _restore(self) -> None:
    """Restores the newest intact checkpoint and the journal's versions, opens the journal.

    Raises:
      ckpt_lib.RestoreError: if no checkpoint is intact while the journal records served versions.
      ckpt_lib.WorkdirMismatch: if the workdir holds another shard's state, or another model's.
    """
    cfg = self.checkpoint
    recorded = syncer_shards.check_workdir(self.workdir, self.shard, self.num_shards)
    ckpt_lib.quiet_orbax_logs()
    self._checkpointer = ckpt_lib.SyncerCheckpointer(
      os.path.join(self.workdir, cfg.subdir), max_to_keep=cfg.max_to_keep
    )
    journal_path = os.path.join(self.workdir, ckpt_lib.JOURNAL_NAME)
    if cfg.version_log:
      self._version_log = ckpt_lib.VersionLog(os.path.join(self.workdir, ckpt_lib.VERSION_LOG_DIR))
    with self.service.lock:
      self.restored = ckpt_lib.restore_core(
        self.service.core,
        self._checkpointer,
        journal_path,
        defer=cfg.recovery_window_s > 0,
        version_log=self._version_log,
      )
      self.service.refresh_published()
    if not recorded:  # Restored (or fresh): this workdir is this shard's from now on.
      syncer_shards.record_workdir(self.workdir, self.shard, self.num_shards)
    if self.restored is not None:
      info = self.restored
      self._saved_step = info.step
      self.writer.event(
        "restore",
        time=round(time.time(), 4),
        step=info.step,
        versions=list(info.versions),
        republished={str(p): list(v) for p, v in info.republished.items()},
        lost_merges=info.lost_merges,
        unusable_steps=list(info.unusable_steps),
        to_recover={str(p): list(v) for p, v in info.to_recover.items()},
        from_log={str(p): list(v) for p, v in info.from_log.items()},
      )
      log.info(
        "syncer restored from %s: %d fragments republished, %d merges lost",
        f"checkpoint {info.step}" if info.step >= 0 else "the initial values (no checkpoint)",
        len(info.republished),
        info.lost_merges,
      )
    self._journal = ckpt_lib.MergeJournal(journal_path)

  def save_checkpoint(self, *, wait: bool = False) -> bool:
    """Starts an asynchronous checkpoint if something merged since the last; True if it did."""
    if self._checkpointer is None or self.service.halted() is not None:
      return False  # Halted: the core holds a version that was never made durable nor served.
    with self.service.lock:
      step = self.service.core.stats()["merges"]
      if step <= self._saved_step:
        return False
      state = self.service.core.state_dict()
    self._checkpointer.save(step, state)
    self._saved_step = step
    self.checkpoints_saved += 1
    if wait:
      self._checkpointer.wait()
    return True

  def _record(self, ev: MergeEvent) -> None:
    """Logs a merge's values, then journals it (each written and fsync'd); the service serves
    it only after this returns (under its lock)."""
    if self._version_log is not None:
      self._log_version(ev.fragment, ev.version)
    if self._journal is not None:
      self._journal.append(ev)

  def _log_version(self, fragment: int, version: int) -> None:
    state = self.service.core.state(fragment)
    if state.version != version:  # Never: the core publishes what it holds.
      raise RuntimeError(f"fragment {fragment} is at version {state.version}, not {version}")
    self._version_log.write(fragment, version, state.values, state.digest)

  def _on_recovery(self, fragment: int, version: int, how: str) -> None:
    """A fragment a restart lost was handed back by a learner, or republished without."""
    if how == "recovered" and self._version_log is not None:
      try:  # The next restart finds it in the log too (a republished one went through _record).
        self._log_version(fragment, version)
      except OSError as e:
        log.error("version log: version %d of fragment %d not written: %s", version, fragment, e)
    lost = self.restored.to_recover.get(fragment) if self.restored is not None else None
    self.writer.event(
      "recovery",
      time=round(time.time(), 4),
      fragment=fragment,
      version=version,
      how=how,
      lost_merges=0 if how == "recovered" or lost is None else lost[3],
    )

  def _fleet_tokens(self) -> int:
    """The tokens the fleet reported so far: the x-axis of the syncer's TensorBoard scalars.

    The token ledger counts token-fragments (learner/ledger.py): divided by P, tokens. Read without
    the service's lock (a merge hook runs under it); a counter read is atomic.
    """
    return self.service.core.stats()["ledger_received"] // self.layout.num_fragments

  def _on_merge(self, ev: MergeEvent) -> None:
    self.merge_times.append([round(time.time(), 4), ev.fragment, ev.version, len(ev.contributors)])
    stats = self.service.core.stats()
    # Written by `loop`, not here: this hook runs under the service's lock, and an event writer
    # that blocks (its queue full while its thread waits for a core) would stall every RPC.
    self._scalars.append(
      (
        {
          "syncer/merges": len(self.merge_times),
          "syncer/quorum_size": len(ev.contributors),
          "syncer/grace_window_s": ev.grace_s,
          "syncer/quorum_s": ev.quorum_time - ev.open_time,
          "syncer/late_reports": stats["late"],
          "syncer/rejected_reports": stats["rejected"],
        },
        stats["ledger_received"] // self.layout.num_fragments,
      )
    )
    self.writer.event("merge", time=round(time.time(), 4), **ev.log_fields())

  def serve(
    self,
    address: str,
    *,
    token: str | None = None,
    tls=None,
    insecure: bool = False,
    bulk_port: int | None = None,
    advertise_bulk_port: int = 0,
  ) -> server_lib.SyncerServer:
    """Serves the syncer on `address` and its bulk port (`server.serve`, whose arguments these
    are) once its outer steps are compiled and version 0 evaluated."""
    self.warm_up()
    if self.restored is None:
      self.evaluate()  # Version 0, before any learner connects (a restart evaluates in `loop`).
    self._others = None  # A shard's periodic evaluations have no global model.
    self._others_initial = False
    if self.restored is not None and self.restored.to_recover:
      # Versions the kill lost: the learners hold them, digest-checked against the journal. The
      # window starts now, when they can reach us: the warm-up above took 19 s at a restart
      # beside 4 training learners on 2 cores, longer than the whole window.
      self.service.begin_recovery(
        {p: (v, d) for p, (v, d, _, _) in self.restored.to_recover.items()},
        self.checkpoint.recovery_window_s,
      )
    self.server = server_lib.serve(
      self.service,
      address=address,
      token=token,
      tls=tls,
      insecure=insecure,
      bulk_port=bulk_port,
      advertise_bulk_port=advertise_bulk_port,
    )
    return self.server

  def warm_up(self) -> float:
    """Compiles every fragment's outer step before serving (`SyncerCore.warm_up`): a merge that
    compiled would hold the service's lock, and every RPC with it, for the compile. Returns the
    seconds it took; compiles run on two threads (XLA compiles without the GIL)."""
    t0 = time.monotonic()
    core = self.service.core
    answers = self.job.run.num_learners  # The full fleet: the common answer count.
    # The dtype the door keeps the answers in (bf16: bfloat16): the merge's program depends on it.
    sent_as = messages.kept_dtype(self.job.run.the_service().uplink_codec)
    with futures.ThreadPoolExecutor(2) as pool:
      # Re-raises a failure.
      list(pool.map(lambda p: core.warm_up(p, answers, sent_as=sent_as), sorted(core.owned)))
    seconds = time.monotonic() - t0
    log.info("outer steps of %d fragments compiled in %.1f s", len(core.owned), seconds)
    self.writer.event("warm_up", time=round(time.time(), 4), seconds=round(seconds, 3))
    return seconds

  def global_flat(self) -> dict[str, np.ndarray] | None:
    """The global model's flat values; None on a shard that lacks the others' fragments."""
    with self.service.lock:
      states = [self.service.core.state(p).values for p in range(self.layout.num_fragments)]
    if self.num_shards > 1:
      if self._others is None and self._others_initial:
        self._others_initial = False  # Used once: version 0's evaluation.
        others = [p for p in range(self.layout.num_fragments) if not self.service.core.owns(p)]
        init = self.factory.global_init_values(others)  # Keyed as the layout keys them.
        self._others = {p: {k: init[k] for k in self.layout.fragments[p]} for p in others}
      if self._others is None:
        return None
      states = [self._others.get(p, vals) for p, vals in enumerate(states)]
    return self.layout.join(states)

  def evaluate(self) -> float:
    """Evaluates the global model; NaN (nothing recorded) on a shard without the whole model."""
    flat = self.global_flat()
    if flat is None:
      return float("nan")
    self._others = None  # Shard 0 of several: the initial or final values, used once.
    merges = len(self.service.merge_log())
    metrics = self.factory.evaluate_flat_metrics(flat)
    loss = metrics["loss"]
    self.evals.append((time.time(), merges, loss))
    aux = {k: float(v) for k, v in metrics.items() if k != "loss"}  # e.g. accuracy, moe_aux_loss
    self.writer.event("eval", time=round(time.time(), 4), merges=merges, loss=loss, **aux)
    up, down = self.service.traffic()
    self.writer.scalars(
      {
        "eval/loss": loss,
        **{f"eval/{k}": v for k, v in aux.items()},
        "traffic/bytes_up": up,
        "traffic/bytes_down": down,
      },
      tokens=self._fleet_tokens(),
    )
    self.writer.flush()
    return loss

  def loop(self, stop: threading.Event, *, until: float | None = None) -> None:
    """Serves until `stop` is set (or the monotonic time `until`), evaluating every eval_every_s."""
    every = self.job.run.eval_every_s
    next_eval = time.monotonic() + every if every > 0 else None
    next_save = time.monotonic() + self.checkpoint.every_s
    while not stop.is_set() and (until is None or time.monotonic() < until):
      stop.wait(0.2)
      self._write_scalars()
      if self.service.halted() is not None:
        log.error("syncer stopping: %s", self.service.halted())
        return
      if next_eval is not None and time.monotonic() >= next_eval:
        self.evaluate()
        next_eval = time.monotonic() + every
      if time.monotonic() >= next_save:
        self.save_checkpoint()
        next_save = time.monotonic() + self.checkpoint.every_s

  def _write_scalars(self) -> None:
    """Writes the merges' TensorBoard scalars queued by `_on_merge` (never under the lock)."""
    while self._scalars:
      values, tokens = self._scalars.popleft()
      self.writer.scalars(values, tokens=tokens)

  def shutdown(self) -> dict[str, Any]:
    """Stops serving, merges rounds with a quorum, evaluates, writes and returns the summary."""
    if self.server is not None:
      self.server.stop(flush=True)
    self._write_scalars()
    if self._checkpointer is not None:
      self.save_checkpoint()
      self._checkpointer.close()
    if self._journal is not None:
      self._journal.close()
    if self.num_shards > 1:  # Shard i > 0 hands its final values to shard 0, which evaluates.
      self._others = syncer_shards.gather(
        self.workdir, self.service.core, self.shard, self.num_shards, started=self._t0
      )
    final = self.evaluate()
    svc = self.service
    with svc.lock:
      stats = svc.core.stats()
      ledger = svc.core.ledger()
    up, down = svc.traffic()
    log_ = svc.merge_log()
    summary = {
      "final_eval_loss": final,
      "initial_eval_loss": self.evals[0][2] if self.evals else float("nan"),
      "shard": self.shard,
      "num_shards": self.num_shards,
      "owned": sorted(svc.core.owned),
      "merges": len(log_),
      "mean_quorum_size": stats["mean_quorum_size"],
      "stats": {k: v for k, v in stats.items() if k != "quorum_size_counts"},
      "quorum_size_counts": {str(k): v for k, v in stats["quorum_size_counts"].items()},
      "refused": svc.refused(),
      # Where pushes spent their time at the syncer (p50/p90 seconds; the learners' summaries
      # have the whole answer's).
      "push_latency_s": svc.push_latency(),
      "bytes_up": up,
      "bytes_down": down,
      "digests": {
        f"{p}:{v}": d for (p, v), d in svc.published_digests().items() if svc.core.owns(p)
      },
      "merge_times": self.merge_times,
      "evals": [[round(t, 4), m, loss] for t, m, loss in self.evals],
      "num_params": self.factory.num_params,
      "uplink_codec": self.job.run.the_service().uplink_codec,
      "downlink_codec": self.job.run.the_service().downlink_codec,
      "wall_time_s": time.time() - self._t0,
      "checkpoints_saved": self.checkpoints_saved,
      "version_log_bytes": 0 if self._version_log is None else self._version_log.bytes_written,
      "restored": None if self.restored is None else dataclasses.asdict(self.restored),
      # Fragments a restart lost: handed back by learners, or republished from the checkpoint.
      "recovery": svc.recovery(),
      # Why the service stopped merging (a merge could not be journaled), or None.
      "halted": svc.halted(),
      # This syncer's book since its checkpoint (learner/ledger.py): received = merged + dropped +
      # pending. Learner ids become strings in JSON.
      "token_ledger": ledger,
    }
    try:
      write_summary(self.workdir, summary)
      self.writer.close()
    except OSError as e:  # A full disk halted the service: the summary may not fit either.
      log.error("could not write the syncer's summary: %s", e)
    return summary


def learner_client(
  job: JobConfig, address: str, *, token: str | None = None, tls_ca_file: str | None = None
) -> ShardedClient:
  """A learner process's client of the syncer at `address` (shard 0's when sharded), set by the
  run's `ServiceConfig` as the syncer is: its chunk bound and its stream deadline (a push or pull
  the syncer allows `stream_deadline_s` is not cut sooner by the learner)."""
  svc = job.run.the_service()

  def connect(address: str) -> SyncerClient:
    return SyncerClient(
      address,
      token=token,
      tls_ca_file=tls_ca_file,
      transfer_deadline_s=svc.stream_deadline_s,
      max_chunk_bytes=svc.max_chunk_bytes,
    )

  # A sharded syncer's other shards are learned at Register (a pass-through when unsharded).
  return ShardedClient(connect(address), connect)


def make_learner_worker(
  job: JobConfig,
  *,
  learner_id: int,
  client: SyncerClient,
  workdir: str,
  connect_timeout_s: float = 120.0,
  data: Iterator[dict[str, np.ndarray]] | None = None,
  checkpoint: LearnerCheckpointConfig | None = None,
) -> tuple[LearnerWorker, MetricsWriter]:
  """One learner on all of this process's devices, its data shard and its worker.

  `data` replaces the learner's grain shard (benchmarks feed pre-drawn batches to compare loops).
  `checkpoint` (None or not enabled: no checkpoints) makes the worker restore at `connect` and save
  while it trains (checkpoint/learner.py); a restarted learner needs the same id and workdir (or
  shared checkpoint directory) to find its own checkpoint and keep its data shard.
  """
  factory, spec, learner = job.make_learner(learner_id)
  if data is None:
    data = iter(factory.make_data(learner_id, spec=spec))
  storage.makedirs(workdir)
  writer = MetricsWriter(workdir, deferred=True)  # TensorBoard at the end (MetricsWriter).
  worker = LearnerWorker(
    learner=learner,
    data=data,
    client=client,
    writer=writer,
    **worker_args(
      job,
      factory,
      learner,
      learner_id=learner_id,
      checkpoint=checkpoint,
      ckpt_workdir=workdir,
      connect_timeout_s=connect_timeout_s,
    ),
  )
  return worker, writer
