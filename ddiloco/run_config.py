"""`RunConfig`: what a training run is, whichever runtime executes it.

The simulated cluster (`ddiloco.simulate(run=...)`) and the distributed launchers (`JobConfig.run`)
read the same object: what is trained, the fragment schedule, the syncer's and the learners'
algorithm, the wire, the fleet's size and the run's length. What executes it is configured beside
it: the virtual fleet's speeds, faults and network (`ClusterConfig`), or the processes and meshes
of a distributed run (`JobConfig`). Bound from gin as `ddiloco.RunConfig.<field>`; see
gin_configs/runs/run_base.gin.
"""

import dataclasses
import numbers

from ddiloco.data import text as text_data
from ddiloco.data import token_shards
from ddiloco.fragments.layout import STRATEGIES
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.config import LearnerConfig, check_pacing
from ddiloco.learner.factory import LearnerFactory, check_hf_checkpoint, resolve_task
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.models import hf_llama, transformer
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.types import SyncerConfig
from ddiloco.tasks import Task
from ddiloco.types import check_int_fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """One training run.

  Attributes:
    model: the transformer of a text run (vocab is set from the tokenizer); with `data`. With
      `hf_checkpoint` it may be left unset: the checkpoint's config.json gives it.
    data: the data of a text run, with `model`: the Shakespeare pipeline (`TextDataConfig`) or a
      pre-tokenized corpus (`TokenShardDataConfig`, data/token_shards.py).
    task: what to train (`ddiloco.tasks`, e.g. `VisionTask`), instead of `model` and `data`.
    hf_checkpoint: a Hugging Face Llama checkpoint folder (config.json + safetensors,
      models/hf_llama.py): the syncer's initial global model and so every learner's start, instead
      of a random init (`seed` then plays no part). The model must be the checkpoint's: unset
      `model` takes its config.json; a given one (or a task's transformer) must agree with it on
      every architecture field (`hf_llama.ARCHITECTURE_FIELDS`), and a text run keeps its
      vocabulary. Every process of a run reads the folder: put it where each one sees it.
    schedule: fragments P, period H, overlap τ (default docs/algorithm.md §2's 24/24/2).
    syncer: quorum, grace, merge, outer optimizer (default `SyncerConfig()`).
    learner: α and blocking (default `LearnerConfig()`).
    inner_opt: inner AdamW (default `InnerOptConfig()`).
    service: the syncer service's wire codecs, chunk size, heartbeats and liveness (default
      `ServiceConfig()`); the simulator runs that very service, in virtual seconds.
    num_learners: M, the learners the run starts with (ids 0..M-1).
    data_slots: the disjoint slots the training data is cut into; learner i reads slot
      i mod `data_slots` (data/sharding.py, data/token_shards.py). 0: M, one per starting
      learner. Set it above M to leave slots for learners added while the run goes
      (`ddiloco-fleet add`): learner i < `data_slots` then reads data no other learner reads,
      where one beyond shares slot i mod `data_slots` with a running learner. A slot without a
      learner is not read (until one takes it), so spare slots leave their share unread meanwhile.
    steps_per_learner: inner steps each learner trains. Sets the token budget, M x steps x
      (tokens per nominal step): the simulator stops when the fleet has trained that many tokens,
      so runs with faults or baselines compare at equal tokens.
    batch_size: per-learner batch override (None: the task's).
    layout_strategy: "balanced", "layer" or "tensor".
    split_large: allow splitting tensors larger than total/P.
    seed: parameter-initialisation seed (the syncer's initial global model).
    eval_batches: held-out batches per evaluation of the global model.
    eval_batch_size: examples per held-out batch. The held-out set (`eval_batches` x
      `eval_batch_size` examples) is fixed by these two alone, never by the learners' batches, so
      systems that split the same data differently (data-parallel, M learners) are scored on
      the same set.
    eval_every_s: seconds between evaluations of the global model (virtual seconds in the
      simulator; 0: only at the end, and at the start of a distributed run).
    log_every: steps between logged training losses.
  """

  model: transformer.TransformerConfig | None = None
  data: text_data.TextDataConfig | token_shards.TokenShardDataConfig | None = None
  task: Task | None = None
  hf_checkpoint: str | None = None
  schedule: FragmentSchedule | None = None
  syncer: SyncerConfig | None = None
  learner: LearnerConfig | None = None
  inner_opt: InnerOptConfig | None = None
  service: ServiceConfig | None = None
  num_learners: int = 4
  data_slots: int = 0
  steps_per_learner: int = 100
  batch_size: int | None = None
  layout_strategy: str = "balanced"
  split_large: bool = False
  seed: int = 0
  eval_batches: int = 8
  eval_batch_size: int = 8
  eval_every_s: float = 0.0
  log_every: int = 10

  def __post_init__(self):
    if self.hf_checkpoint is not None and not (
      isinstance(self.hf_checkpoint, str) and self.hf_checkpoint
    ):
      # gin.REQUIRED left unbound (gin_configs/examples/from_hf_llama.gin).
      raise ValueError("RunConfig.hf_checkpoint must name a checkpoint folder: bind it.")
    task = self.the_task()  # Exactly one of a task and a (model, data) pair.
    if self.hf_checkpoint is not None:
      check_hf_checkpoint(task, self.hf_checkpoint)  # Here, not once the learners start.
    counts = ("num_learners", "steps_per_learner", "log_every", "eval_batches", "eval_batch_size")
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not later.
    bad = [f"{name}={getattr(self, name)}" for name in counts if getattr(self, name) < 1]
    if bad:
      raise ValueError(f"{', '.join(bad)}: {', '.join(counts)} must be >= 1.")
    # 0 would fall through `batch_size or the task's` to the task's default without a word.
    if self.batch_size is not None and not (
      isinstance(self.batch_size, numbers.Integral) and self.batch_size >= 1
    ):
      raise ValueError(f"batch_size must be an integer >= 1 or None, got {self.batch_size!r}.")
    if self.data_slots and self.data_slots < self.num_learners:
      raise ValueError(
        f"data_slots={self.data_slots} is below num_learners={self.num_learners}: learners would "
        "share data from the start (0 gives one slot per learner)."
      )
    if self.layout_strategy not in STRATEGIES:
      raise ValueError(
        f"layout_strategy must be one of {STRATEGIES}, got {self.layout_strategy!r}."
      )
    if not self.eval_every_s >= 0:  # `not >=` refuses NaN too.
      raise ValueError(f"eval_every_s must be >= 0, got {self.eval_every_s}.")
    check_pacing(self.the_learner(), self.the_syncer())
    service = self.the_service()
    if self.num_learners > min(service.max_rounds_streams, service.max_members):
      # Each learner holds a Rounds stream and a place in the syncer's record: those beyond the
      # bounds would be refused them for as long as the others stay.
      raise ValueError(
        f"num_learners={self.num_learners} exceeds the syncer's ServiceConfig.max_rounds_streams="
        f"{service.max_rounds_streams} or max_members={service.max_members}: the learners beyond "
        "them could never subscribe to rounds. Raise those bounds."
      )

  def the_data_slots(self) -> int:
    """The data's slots: `data_slots`, or one per starting learner."""
    return self.data_slots or self.num_learners

  def the_task(self) -> Task:
    """The task: `task`, or a `TextTask` of (model, data) (cheap: built on each call)."""
    if self.hf_checkpoint is None or self.task is not None:
      return resolve_task(self.task, self.model, self.data)
    if self.data is None:
      raise ValueError("hf_checkpoint needs RunConfig.data (or a task) to train the checkpoint on.")
    model = self.model or hf_llama.read_config(self.hf_checkpoint)
    return resolve_task(None, model, self.data, keep_vocab=True)

  def the_schedule(self) -> FragmentSchedule:
    return self.schedule or FragmentSchedule(num_fragments=24, period=24, overlap=2)

  def the_syncer(self) -> SyncerConfig:
    return self.syncer or SyncerConfig()

  def the_learner(self) -> LearnerConfig:
    return self.learner or LearnerConfig()

  def the_service(self) -> ServiceConfig:
    return self.service or ServiceConfig()

  def learner_batch_size(self) -> int:
    """Examples per learner step: the override, or the task's default."""
    return self.batch_size or self.the_task().batch_size

  def tokens_per_step(self) -> int:
    """Merge units (tokens for text, examples for vision) in one nominal learner step."""
    return self.the_task().units_per_step(self.batch_size)

  def token_budget(self) -> int:
    """Merge units the fleet trains: M x steps x `tokens_per_step()`."""
    return self.num_learners * self.steps_per_learner * self.tokens_per_step()

  def factory(self, *, num_shards: int | None = None, model_parallelism: int = 1) -> LearnerFactory:
    """Task, layout and compiled steps, identical wherever the run's learners are built.

    Args:
      num_shards: disjoint data shards (default `the_data_slots()`).
      model_parallelism: size of each learner mesh's "model" axis (`LearnerFactory`).
    """
    return LearnerFactory(
      task=self.the_task(),
      inner_opt=self.inner_opt or InnerOptConfig(),
      num_fragments=self.the_schedule().num_fragments,
      slices=self.the_schedule().slices,
      layout_strategy=self.layout_strategy,
      split_large=self.split_large,
      num_shards=self.the_data_slots() if num_shards is None else num_shards,
      seed=self.seed,
      hf_checkpoint=self.hf_checkpoint,
      eval_batches=self.eval_batches,
      eval_batch_size=self.eval_batch_size,
      batch_size=self.batch_size,
      model_parallelism=model_parallelism,
    )
