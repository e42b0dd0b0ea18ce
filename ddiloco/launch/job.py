"""`JobConfig`: what the syncer, the learners and the local launcher of one distributed run share.

Every process of a run parses the same gin files, so they agree on the model, the fragment layout (the
syncer checks its digest at Register), the schedule and the wire codecs. Bound from gin as
`ddiloco.JobConfig.<field>`; see gin_configs/local_tiny.gin.
"""

import dataclasses

from ddiloco.data import text as text_data
from ddiloco.distributed.service_config import ServiceConfig
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.config import LearnerConfig, check_pacing
from ddiloco.learner.factory import LearnerFactory, LearnerSpec, resolve_task
from ddiloco.learner.learner import Learner
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.models import transformer
from ddiloco.syncer.types import SyncerConfig
from ddiloco.tasks import Task


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
  """One distributed run.

  Attributes:
    model: the transformer of a text run (vocab is set from the tokenizer); with `data`.
    data: the text pipeline of a text run; with `model`.
    task: what to train (`ddiloco.tasks`), instead of `model` and `data`.
    schedule: fragments P, period H, overlap τ (default docs/algorithm.md §2's 24/24/2).
    syncer: quorum, grace, merge, outer optimizer.
    learner: α and blocking.
    inner_opt: inner AdamW.
    service: wire codecs, chunk size, heartbeats, liveness.
    num_learners: M, learners the local launcher starts (ids 0..M-1).
    steps_per_learner: inner steps each learner trains before it leaves.
    devices_per_learner: fake CPU devices per learner process (the launcher sets XLA_FLAGS).
    processes_per_learner: JAX processes forming each learner in the local launchers, as the hosts
      of a multi-host slice (distributed/multihost.py, launch/processes.py); a learner's mesh then has
      processes_per_learner × devices_per_learner devices.
    model_parallelism: size of each learner mesh's "model" axis (tensor parallelism; the "data"
      axis gets the rest of its devices); must divide a learner's device count.
    batch_size: per-learner batch override (None: the task's).
    layout_strategy: "balanced", "layer" or "tensor".
    split_large: allow splitting tensors larger than total/P.
    seed: parameter-initialisation seed (the syncer's initial global model).
    eval_batches: held-out batches per evaluation of the global model (by the syncer).
    eval_every_s: seconds between evaluations of the global model (0: at start and end only).
    log_every: steps between logged training losses.
    senders: each learner process's sender threads, each with one push in flight (of different
      fragments; distributed/senders.py).
  """

  model: transformer.TransformerConfig | None = None
  data: text_data.TextDataConfig | None = None
  task: Task | None = None
  schedule: FragmentSchedule | None = None
  syncer: SyncerConfig | None = None
  learner: LearnerConfig | None = None
  inner_opt: InnerOptConfig | None = None
  service: ServiceConfig | None = None
  num_learners: int = 4
  steps_per_learner: int = 100
  devices_per_learner: int = 1
  processes_per_learner: int = 1
  model_parallelism: int = 1
  batch_size: int | None = None
  layout_strategy: str = "balanced"
  split_large: bool = False
  seed: int = 0
  eval_batches: int = 8
  eval_every_s: float = 0.0
  log_every: int = 10
  senders: int = 2

  def __post_init__(self):
    self.the_task()  # Exactly one of a task and a (model, data) pair.
    counts = (
      "num_learners",
      "steps_per_learner",
      "devices_per_learner",
      "processes_per_learner",
      "model_parallelism",
      "senders",
    )
    bad = [f"{name}={getattr(self, name)}" for name in counts if getattr(self, name) < 1]
    if bad:
      raise ValueError(f"{', '.join(bad)}: {', '.join(counts)} must be >= 1.")
    if self.eval_every_s < 0 or self.log_every < 1:
      raise ValueError("eval_every_s must be >= 0 and log_every >= 1.")
    check_pacing(self.learner or LearnerConfig(), self.syncer or SyncerConfig())

  def the_schedule(self) -> FragmentSchedule:
    return self.schedule or FragmentSchedule(num_fragments=24, period=24, overlap=2)

  def the_syncer(self) -> SyncerConfig:
    return self.syncer or SyncerConfig()

  def the_service(self) -> ServiceConfig:
    return self.service or ServiceConfig()

  def the_task(self) -> Task:
    """The task: `task`, or a `TextTask` of (model, data) (cheap: built on each call)."""
    return resolve_task(self.task, self.model, self.data)

  def learner_batch_size(self) -> int:
    """Examples per learner step: the override, or the task's default."""
    return self.batch_size or self.the_task().batch_size

  def factory(self) -> LearnerFactory:
    """Task, layout and compiled steps, identical in every process of the run."""
    return LearnerFactory(
      task=self.the_task(),
      inner_opt=self.inner_opt or InnerOptConfig(),
      num_fragments=self.the_schedule().num_fragments,
      layout_strategy=self.layout_strategy,
      split_large=self.split_large,
      num_shards=self.num_learners,
      seed=self.seed,
      eval_batches=self.eval_batches,
      batch_size=self.batch_size,
      model_parallelism=self.model_parallelism,
    )

  def make_learner(self, learner_id: int) -> tuple[LearnerFactory, LearnerSpec, Learner]:
    """Learner `learner_id` on all of this process's `jax.devices()` (with jax.distributed: every
    process's), with its factory and spec; the learner processes' one way to build it."""
    import jax

    factory = self.factory()
    spec = LearnerSpec(batch_size=self.batch_size, devices=len(jax.devices()))
    learner = factory.make_learner(
      learner_id,
      spec=spec,
      schedule=self.the_schedule(),
      config=self.learner or LearnerConfig(),
      device_slot=0,
    )
    return factory, spec, learner

  def tokens_per_step(self) -> int:
    """Merge units (tokens for text, examples for vision) in one nominal learner step."""
    return self.the_task().units_per_step(self.batch_size)

  def token_budget(self) -> int:
    return self.num_learners * self.steps_per_learner * self.tokens_per_step()
