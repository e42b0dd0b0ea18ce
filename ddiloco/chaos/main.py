"""`ddiloco-chaos`: the local cluster under a fault schedule, with invariants checked at the end.

  ddiloco-chaos --gin_file=gin_configs/chaos/local_tiny_chaos.gin --workdir=workdirs/chaos

The faults are `ddiloco.ChaosConfig` (gin): Poisson learner kills and restarts, SIGSTOP/SIGCONT
slowdowns, network delay, drops and partitions through a loopback proxy, and syncer kills (with
`--gin.JobConfig.syncer_shards=S`, of one shard or all: `ChaosConfig.syncer_kill_shards`). The event
tape goes to `workdir/chaos/tape.jsonl`, the verdict to `workdir/chaos_summary.json`. With
`--run_baseline` the same job first runs without faults in `workdir/baseline`, and its final eval
loss is the bound of the eval invariant (or pass `--baseline_loss`). Exits 1 when an invariant fails.
`--summarize_only` checks a finished run in `workdir` again (same gin flags) without running anything.
"""

import json
import math
import os
import sys

from absl import app, flags

from ddiloco.launch import cli, gin_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "output folder", required=True)
_TIMEOUT = flags.DEFINE_float(
  "timeout_s", 3600.0, "stop everything after this long", lower_bound=0.0
)
_BASELINE_LOSS = flags.DEFINE_float("baseline_loss", None, "fault-free final eval loss")
_RUN_BASELINE = flags.DEFINE_bool("run_baseline", False, "run the job without faults first")
_SUMMARIZE_ONLY = flags.DEFINE_bool(
  "summarize_only", False, "check the finished run in --workdir again; start nothing"
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from ddiloco.chaos.driver import ChaosRun
  from ddiloco.faults.schedule import ChaosConfig, make_schedule
  from ddiloco.launch import configurables, local_cluster
  from ddiloco.launch.job import JobConfig

  workdir = os.path.abspath(_WORKDIR.value)
  if _SUMMARIZE_ONLY.value and not os.path.isdir(workdir):
    raise app.UsageError(f"--summarize_only: no run in {workdir}")
  baseline = _BASELINE_LOSS.value
  if baseline is not None and not (baseline > 0 and math.isfinite(baseline)):
    # The eval invariant would refuse it only after the whole run.
    raise app.UsageError(f"--baseline_loss must be finite and > 0, got {baseline}.")
  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    job = configurables.configured(JobConfig)()
    chaos = configurables.configured(ChaosConfig)()
    # A bad fault schedule is refused before anything runs.
    make_schedule(chaos, job.run.num_learners, job.syncer_shards)
  cli.make_workdir(workdir, config_text)
  args = gin_flags.forwarded_args()

  def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

  if _RUN_BASELINE.value and not _SUMMARIZE_ONLY.value:
    cluster = local_cluster.LocalCluster(
      workdir=os.path.join(workdir, "baseline"),
      gin_args=args,
      num_learners=job.run.num_learners,
      devices_per_learner=job.devices_per_learner,
      processes_per_learner=job.processes_per_learner,
    )
    base = cluster.run(job, timeout_s=_TIMEOUT.value, progress=say)
    baseline = base["final_eval_loss"]
    say(f"baseline (no faults): final eval loss {baseline:.4f}")
  cluster = local_cluster.LocalCluster(
    workdir=os.path.join(workdir, "chaos"),
    gin_args=args,
    num_learners=job.run.num_learners,
    devices_per_learner=job.devices_per_learner,
    processes_per_learner=job.processes_per_learner,
  )
  run = ChaosRun(job, chaos, cluster, progress=say)
  if _SUMMARIZE_ONLY.value:
    if not os.path.exists(run.tape_path):
      say(f"ddiloco-chaos: no tape at {run.tape_path}: nothing to summarize")
      sys.exit(1)
    if baseline is None and os.path.exists(os.path.join(workdir, "chaos_summary.json")):
      with open(os.path.join(workdir, "chaos_summary.json")) as f:
        baseline = json.load(f).get("baseline_loss")
  else:
    say(f"{len(run.schedule)} scheduled events; tape: {run.tape_path}")
    try:
      run.run(timeout_s=_TIMEOUT.value)
    except KeyboardInterrupt:
      sys.exit(130)
    except (RuntimeError, TimeoutError) as e:
      say(f"ddiloco-chaos: {e}\nevery process was stopped; logs are in {cluster.workdir}")
      sys.exit(1)
  summary = run.summary(baseline_loss=baseline)
  print(summary["table"])
  keys = (
    "merges",
    "longest_gap_s",
    "final_eval_loss",
    "baseline_loss",
    "goodput",
    "merged_fraction",
  )
  keys += ("learner_kills", "syncer_kills", "merges_lost_at_restarts", "pauses", "net_events")
  print("summary:", {k: summary[k] for k in keys})
  print("per learner:", summary["learners"])
  if len(summary["shards"]) > 1:
    print("per syncer shard:", summary["shards"])
  path = os.path.join(workdir, "chaos_summary.json")
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {path}")
  if not summary["ok"]:
    sys.exit(1)


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-chaos", module=__name__)


if __name__ == "__main__":
  run()
