"""`simulate()`: one simulated run from configs to summary, importable from a notebook.

Everything an experiment varies is an argument; gin binds them from .gin files (gin_configs/), and the
`ddiloco-simulate` entry point is a thin shell around this function.
"""

import functools
import logging
from collections.abc import Callable
from typing import Any

from ddiloco import storage
from ddiloco.data import text as text_data
from ddiloco.distributed.service_config import ServiceConfig
from ddiloco.distributed.virtual import VirtualSyncer
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner.config import LearnerConfig, check_pacing
from ddiloco.learner.factory import LearnerFactory
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.metrics.writer import MetricsWriter, write_summary
from ddiloco.models import transformer
from ddiloco.simulation.cluster import SimulatedCluster
from ddiloco.simulation.config import ClusterConfig
from ddiloco.syncer.core import SyncerConfig
from ddiloco.tasks import Task

log = logging.getLogger(__name__)


def simulate(
  *,
  workdir: str,
  model: transformer.TransformerConfig | None = None,
  data: text_data.TextDataConfig | None = None,
  task: Task | None = None,
  cluster: ClusterConfig,
  schedule: FragmentSchedule | None = None,
  syncer: SyncerConfig | None = None,
  service: ServiceConfig | None = None,
  learner: LearnerConfig | None = None,
  inner_opt: InnerOptConfig | None = None,
  layout_strategy: str = "balanced",
  split_large: bool = False,
  sync: bool = True,
  seed: int = 0,
  eval_batches: int = 8,
  tensorboard: bool = True,
  progress: Callable[[str], None] | None = None,
  on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
  """Runs one simulated Decoupled DiLoCo (or baseline) training and writes its outputs.

  Args:
    workdir: output folder: metrics.jsonl, tb/, summary.json.
    model: the transformer (vocab is set from the tokenizer), for a text run (with `data`).
    data: the text pipeline, for a text run (with `model`).
    task: what to train (`ddiloco.tasks`, e.g. `VisionTask`), instead of `model` and `data`.
    cluster: fleet, faults, network, token budget.
    schedule: fragments P, period H, overlap τ (default: docs/algorithm.md §2's 24/24/2).
    syncer: quorum, grace, merge and outer optimizer (default: SyncerConfig()).
    service: the syncer service's settings, as for a distributed run (default: ServiceConfig()):
      the wire codecs both ways, and heartbeats and liveness, in virtual seconds.
    learner: α and blocking (default: LearnerConfig()).
    inner_opt: inner AdamW (default: InnerOptConfig()).
    layout_strategy: "balanced" (default), "layer" or "tensor".
    split_large: allow splitting tensors larger than total/P.
    sync: False runs the data-parallel baseline: no syncer, learner 0's params are the model.
    seed: parameter initialisation seed.
    eval_batches: held-out batches per evaluation.
    tensorboard: write TensorBoard events too.
    progress: called with a one-line status every couple of seconds.
    on_start: called once the arguments are checked, before anything is written (the command line
      writes its config.gin then; an error before it is a configuration error).

  Returns:
    The summary (also written to workdir/summary.json). "final_eval_metrics" holds the final
    evaluation's loss and the task's aux metric means (e.g. "accuracy" for vision).

  Raises:
    ValueError: for inconsistent arguments (both or neither of task and model/data).
  """
  schedule = schedule or FragmentSchedule(num_fragments=24, period=24, overlap=2)
  syncer = syncer or SyncerConfig()
  if not sync and cluster.num_learners != 1:
    raise ValueError("The data-parallel baseline (sync=False) runs exactly one learner.")
  factory = LearnerFactory(
    task=task,
    model_config=model,
    data_config=data,
    inner_opt=inner_opt or InnerOptConfig(),
    num_fragments=schedule.num_fragments,
    layout_strategy=layout_strategy,
    split_large=split_large,
    num_shards=cluster.num_shards(),
    seed=seed,
    eval_batches=eval_batches,
    batch_size=cluster.batch_size,
  )

  service = service or ServiceConfig()
  if sync:
    check_pacing(learner or LearnerConfig(), syncer)
  # The distributed runtime's syncer service, on the virtual clock (distributed/virtual.py).
  syncer_fn = functools.partial(VirtualSyncer, syncer_config=syncer, service_config=service)

  if on_start is not None:
    on_start()
  storage.makedirs(workdir)
  with MetricsWriter(workdir, tensorboard=tensorboard) as writer:
    writer.event(
      "config",
      time=0.0,
      params=factory.num_params,
      layout_digest=factory.layout.digest,
      fragment_bytes=[factory.layout.fragment_bytes(p) for p in range(schedule.num_fragments)],
    )
    sim = SimulatedCluster(
      factory=factory,
      cluster=cluster,
      schedule=schedule,
      learner_config=learner or LearnerConfig(),
      syncer_fn=syncer_fn if sync else None,
      writer=writer,
      heartbeat_interval_s=service.heartbeat_interval_s,
    )
    try:
      summary = sim.run(progress=progress)
    finally:
      sim.close()
  summary["num_params"] = factory.num_params
  # The cluster's final evaluation is the factory's last one: its metrics, at no extra cost.
  summary["final_eval_metrics"] = factory.last_eval
  write_summary(workdir, summary)
  return summary
