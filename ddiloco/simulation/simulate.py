"""`simulate()`: one simulated run from configs to summary, importable from a notebook.

Everything an experiment varies is an argument; gin binds them from .gin files (gin_configs/), and the
`ddiloco-simulate` entry point is a thin shell around this function.
"""

import functools
import logging
from collections.abc import Callable
from typing import Any

from ddiloco import storage
from ddiloco.metrics.writer import MetricsWriter, write_summary
from ddiloco.run_config import RunConfig
from ddiloco.service.virtual import VirtualSyncer
from ddiloco.simulation.cluster import SimulatedCluster
from ddiloco.simulation.config import ClusterConfig

log = logging.getLogger(__name__)


def simulate(
  *,
  workdir: str,
  run: RunConfig,
  fleet: ClusterConfig | None = None,
  sync: bool = True,
  tensorboard: bool = True,
  progress: Callable[[str], None] | None = None,
  on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
  """Runs one simulated Decoupled DiLoCo (or baseline) training and writes its outputs.

  Args:
    workdir: output folder: metrics.jsonl, tb/, summary.json.
    run: what to train and how: the task (or text model and data), schedule, syncer, learners,
      inner optimizer, the syncer service's settings (wire codecs both ways, heartbeats and
      liveness, here in virtual seconds), M learners and the token budget.
    fleet: the virtual fleet: step times, stragglers, faults, network (default: ClusterConfig()).
    sync: False runs the data-parallel baseline: no syncer, learner 0's params are the model.
    tensorboard: write TensorBoard events too.
    progress: called with a one-line status every couple of seconds.
    on_start: called once the arguments are checked, before anything is written (the command line
      writes its config.gin then; an error before it is a configuration error).

  Returns:
    The summary (also written to workdir/summary.json). "final_eval_metrics" holds the final
    evaluation's loss and the task's aux metric means (e.g. "accuracy" for vision).

  Raises:
    ValueError: for a fleet that does not fit the run, or a baseline of more than one learner.
  """
  fleet = fleet or ClusterConfig()
  fleet.check_fleet(run.num_learners)
  if not sync and run.num_learners != 1:
    raise ValueError("The data-parallel baseline (sync=False) runs exactly one learner.")
  schedule = run.the_schedule()
  factory = run.factory(num_shards=fleet.num_shards(run.num_learners, run.data_slots))
  service = run.the_service()
  # The distributed runtime's syncer service, on the virtual clock (service/virtual.py).
  syncer_fn = functools.partial(
    VirtualSyncer, syncer_config=run.the_syncer(), service_config=service
  )

  if on_start is not None:
    on_start()
  storage.makedirs(workdir)
  with MetricsWriter(workdir, tensorboard=tensorboard) as writer:
    writer.event(
      "config",
      time=0.0,
      params=factory.num_params,
      layout_digest=factory.layout.digest,
      fragment_bytes=[factory.layout.fragment_bytes(p) for p in range(schedule.total_fragments)],
    )
    sim = SimulatedCluster(
      factory=factory,
      run=run,
      fleet=fleet,
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
