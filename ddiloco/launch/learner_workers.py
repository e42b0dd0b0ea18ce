"""The learner worker's arguments from a run, and the worker of one process of a multi-process
learner (`make_multihost_worker`); `runtime.make_learner_worker` builds a one-process learner's."""

from typing import Any

import jax

from ddiloco import storage
from ddiloco.checkpoint.learner import (
  LearnerCheckpointConfig,
  LearnerCheckpointer,
  abstract_opt_state,
)
from ddiloco.launch.job import JobConfig
from ddiloco.learner_process import multihost as multihost_lib
from ddiloco.metrics.writer import MetricsWriter
from ddiloco.parallel.multihost import GlobalBatches, ProcessGroup
from ddiloco.transport.client import SyncerClient, fragment_layouts

__all__ = ["make_multihost_worker", "worker_args"]


def worker_args(
  job: JobConfig,
  factory: Any,
  learner: Any,
  *,
  learner_id: int,
  checkpoint: LearnerCheckpointConfig | None,
  ckpt_workdir: str,
  connect_timeout_s: float,
  group: ProcessGroup | None = None,
) -> dict[str, Any]:
  """The arguments every kind of learner worker takes from the run and its factory; the
  checkpointer (None unless `checkpoint` is enabled) keeps its folder under `ckpt_workdir`."""
  checkpointer = None
  if checkpoint is not None and checkpoint.enabled:
    checkpointer = LearnerCheckpointer(
      checkpoint,
      learner_id=learner_id,
      workdir=ckpt_workdir,
      opt_target=abstract_opt_state(learner.steps, learner.params),
      layout_digest=factory.layout.digest,
      group=group,
    )
  return {
    "layout_digest": factory.layout.digest,
    "layouts": fragment_layouts(factory.layout.fragments, factory.global_init_values()),
    "batch_size": job.run.learner_batch_size(),
    "log_every": job.run.log_every,
    "senders": job.senders,
    "encode_workers": job.encode_workers,
    "shards": job.syncer_shards,
    "connect_timeout_s": connect_timeout_s,
    "checkpointer": checkpointer,
  }


def make_multihost_worker(
  job: JobConfig,
  *,
  learner_id: int,
  client: SyncerClient | None,
  workdir: str,
  connect_timeout_s: float = 120.0,
  checkpoint: LearnerCheckpointConfig | None = None,
  learner_workdir: str | None = None,
) -> tuple[multihost_lib.MultihostWorker, MetricsWriter]:
  """This process's part of learner `learner_id`, on the global devices of all its processes.

  Call after `parallel.multihost.initialize`. Every process reads the learner's data shard and feeds
  the rows of its own devices (`GlobalBatches`), so the learner's batch is `job.run.batch_size`.

  Args:
    job: the run's config (identical in every process).
    learner_id: the learner's id at the syncer.
    client: the syncer client (process 0 only; None elsewhere).
    workdir: this process's output folder.
    connect_timeout_s: how long process 0's first registration may take.
    checkpoint: learner checkpoints (None or not enabled: none), shared by the processes.
    learner_workdir: the learner's output folder (process 0's `workdir`, the default), where the
      checkpoint folder is unless `checkpoint.directory` says otherwise: the same in every process.

  Returns:
    The worker and its metrics writer.

  Raises:
    ValueError: without a client on process 0, or with one elsewhere.
  """
  if (client is not None) != (jax.process_index() == 0):
    raise ValueError("Process 0, and only process 0, of a learner needs a syncer client.")
  # jax.devices() is global here: the learner's mesh spans every process of the learner.
  factory, spec, learner = job.make_learner(learner_id)
  group = ProcessGroup(learner.steps.mesh)
  data = GlobalBatches(iter(factory.make_data(learner_id, spec=spec)), learner.steps.batch_sharding)
  storage.makedirs(workdir)
  # One TensorBoard run per learner: process 0's (the others' curves would repeat it).
  writer = MetricsWriter(workdir, tensorboard=jax.process_index() == 0)
  worker = multihost_lib.MultihostWorker(
    group=group,
    learner=learner,
    data=data,
    client=client if client is not None else multihost_lib.NoSyncer(),
    writer=writer,
    **worker_args(
      job,
      factory,
      learner,
      learner_id=learner_id,
      checkpoint=checkpoint,
      ckpt_workdir=learner_workdir or workdir,
      connect_timeout_s=connect_timeout_s,
      group=group,
    ),
  )
  return worker, writer
