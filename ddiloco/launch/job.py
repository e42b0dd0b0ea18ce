"""`JobConfig`: a distributed run's processes, what the syncer, the learners and the launchers share.

Every process of a run parses the same gin files, so they agree on the run (`RunConfig`: the model,
the fragment layout, which the syncer checks by its digest at Register, the schedule and the wire
codecs) and on its topology: the processes and devices of each learner. Bound from gin as
`ddiloco.JobConfig.<field>`, with `JobConfig.run = @RunConfig()`; see gin_configs/local_tiny.gin.
"""

import dataclasses

from ddiloco.learner.factory import LearnerFactory, LearnerSpec
from ddiloco.learner.learner import Learner
from ddiloco.run_config import RunConfig
from ddiloco.types import check_int_fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
  """One distributed run: the run itself and the processes that execute it.

  Attributes:
    run: what is trained and how (`RunConfig`), as the simulator would run it.
    devices_per_learner: fake CPU devices per learner process (the launcher sets XLA_FLAGS).
    processes_per_learner: JAX processes forming each learner in the local launchers, as the hosts
      of a multi-host slice (learner_process/multihost.py, launch/processes.py); a learner's mesh then has
      processes_per_learner × devices_per_learner devices.
    model_parallelism: size of each learner mesh's "model" axis (tensor parallelism; the "data"
      axis gets the rest of its devices); must divide a learner's device count.
    senders: each learner process's sender threads per syncer shard, each with one push in
      flight (of different fragments; learner_process/senders.py); with its pull, at most each
      shard's `ServiceConfig.max_data_streams_per_learner`.
    encode_workers: threads a learner process encodes one answer's δ on where its host encodes it
      (a learner on CPU, a multi-process learner's leader, a fragment its devices cannot encode:
      learner_process/link.py); 0 picks it: 1 for a learner on CPU, whose cores train, else half
      the CPUs this process may use, at most 8.
    syncer_shards: S syncer processes, each with its own port, checkpoint and journal; learners
      learn the shards' addresses at Register (docs/architecture.md, "The sharded syncer"). With
      S > 1 every fragment of the schedule is cut into S slices (`FragmentSchedule.slices`, set
      here from S for every process of the run), and shard s merges slice s of every fragment,
      so each round's work is spread over all shards.
  """

  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  devices_per_learner: int = 1
  processes_per_learner: int = 1
  model_parallelism: int = 1
  senders: int = 2
  encode_workers: int = 0
  syncer_shards: int = 1

  def __post_init__(self):
    counts = (
      "devices_per_learner",
      "processes_per_learner",
      "model_parallelism",
      "senders",
      "syncer_shards",
    )
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not later.
    bad = [f"{name}={getattr(self, name)}" for name in counts if getattr(self, name) < 1]
    if bad:
      raise ValueError(f"{', '.join(bad)}: {', '.join(counts)} must be >= 1.")
    if self.encode_workers < 0:
      raise ValueError(f"encode_workers must be >= 0 (0: chosen), got {self.encode_workers}.")
    object.__setattr__(self, "run", _sliced(self.run, self.syncer_shards))
    service = self.run.the_service()
    if self.senders + 1 > service.max_data_streams_per_learner:
      # Each sender has a push open, the puller a pull: the syncer would refuse the one too many
      # (RESOURCE_EXHAUSTED), and the answer would wait out a retry's backoff.
      raise ValueError(
        f"senders={self.senders} push at once beside a pull: "
        f"ServiceConfig.max_data_streams_per_learner={service.max_data_streams_per_learner} "
        f"must be at least {self.senders + 1}."
      )
    bulk_port = service.bulk_port
    if bulk_port and bulk_port + self.syncer_shards - 1 > 65535:
      raise ValueError(
        f"ServiceConfig.bulk_port={bulk_port} with syncer_shards={self.syncer_shards}: shard i "
        "serves its bulk port on bulk_port + i, past 65535."
      )

  def factory(self) -> LearnerFactory:
    """Task, layout and compiled steps, identical in every process of the run."""
    return self.run.factory(model_parallelism=self.model_parallelism)

  def make_learner(self, learner_id: int) -> tuple[LearnerFactory, LearnerSpec, Learner]:
    """Learner `learner_id` on all of this process's `jax.devices()` (with jax.distributed: every
    process's), with its factory and spec; the learner processes' one way to build it."""
    import jax

    factory = self.factory()
    spec = LearnerSpec(batch_size=self.run.batch_size, devices=len(jax.devices()))
    learner = factory.make_learner(
      learner_id,
      spec=spec,
      schedule=self.run.the_schedule(),
      config=self.run.the_learner(),
      device_slot=0,
    )
    return factory, spec, learner


def _sliced(run: RunConfig, shards: int) -> RunConfig:
  """`run` with S = `shards` slices per fragment (docs/architecture.md, "The sharded syncer"): the
  layout and schedule every process derives from the job. Slices are the shard count's to set;
  a schedule that names another count is refused."""
  schedule = run.the_schedule()
  if schedule.slices == shards:
    return run
  if schedule.slices != 1:
    raise ValueError(
      f"FragmentSchedule.slices={schedule.slices} contradicts JobConfig.syncer_shards={shards}: "
      "slices follow the shard count; set only syncer_shards."
    )
  sliced = dataclasses.replace(schedule, slices=shards)
  return dataclasses.replace(run, schedule=sliced)
