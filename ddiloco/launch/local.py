"""`ddiloco-local`: a syncer and M learners as subprocesses on 127.0.0.1 (the README's main job).

  ddiloco-local --gin_file=gin_configs/local_tiny.gin --workdir=workdirs/local_tiny

Everything about the run is gin: `--gin.LEARNERS=2` (the file's macro) or
`--gin.RunConfig.num_learners=2` starts 2 learners, and every process of the run agrees on it.
Each learner gets its own fake CPU devices (`JobConfig.devices_per_learner`), a shared JAX compile
cache and a fresh random shared token (DDILOCO_TOKEN). Progress is printed every couple of seconds:
the syncer's versions, merges and quorum sizes (its Status RPC) and each learner's step and loss (its
metrics.jsonl). Ctrl-C, SIGTERM, a failed process or `--timeout_s` stops everything: learners and
syncer get SIGTERM, then SIGKILL after a grace period, and every child also dies with the launcher
(PR_SET_PDEATHSIG), so no process is ever left behind. At the end it writes `summary.json` (the keys
of `ddiloco-simulate`) and `loss.png` (loss over time per learner, with merge events); after Ctrl-C
too, for the partial run, with "interrupted": true (exit status 130).

A run starts fresh: the previous run's process folders in `--workdir` are removed first. With
`--resume` they are kept, and the syncer and learners continue from their checkpoints.

Elastic scavenging (docs/algorithm.md §6): while it runs, `ddiloco-fleet --workdir=W add|remove|list` adds
learners (own devices, batch size, steps), removes them gracefully and lists the fleet
(launch/fleet.py; docs/resilience.md). The job ends when every learner still in the fleet has
finished; summary.json's "membership" lists every join and leave and "syncer_alive_at_end" the
syncer's last membership.

Multi-process learners (a learner on a multi-host slice, docs/algorithm.md §1):
`JobConfig.processes_per_learner = N` (`--gin.JobConfig.processes_per_learner=N`) starts every
learner as N processes joined by jax.distributed, each with `JobConfig.devices_per_learner` fake CPU
devices. A learner is one unit: when one of its processes dies the launcher kills the others, and
progress lines and summary.json count learners (launch/local_cluster.py).
"""

import os
import sys
from collections.abc import Callable
from typing import Any

from absl import app, flags

from ddiloco.launch import cli, gin_flags, processes

_WORKDIR = flags.DEFINE_string("workdir", None, "output folder", required=True)
_TIMEOUT = flags.DEFINE_float(
  "timeout_s", 1800.0, "stop everything after this long", lower_bound=0.0
)
_PROGRESS_EVERY = flags.DEFINE_float(
  "progress_every_s", 2.0, "seconds between progress lines", lower_bound=0.0
)
_TLS_CERT = flags.DEFINE_string(
  "tls_cert_file", None, "PEM certificate chain: the syncer serves TLS"
)
_TLS_KEY = flags.DEFINE_string("tls_key_file", None, "PEM private key of --tls_cert_file")
_TLS_CA = flags.DEFINE_string(
  "tls_ca_file", None, "PEM CA the learners trust (default: --tls_cert_file, self-signed)"
)
_RESUME = flags.DEFINE_bool(
  "resume", False, "continue the run in --workdir from its checkpoints (default: start fresh)"
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from ddiloco.launch import local_cluster

  run_job("ddiloco-local", local_cluster.LocalCluster)


def run_job(
  prog: str,
  make_cluster: Callable[..., Any],
  *,
  backend_config: Callable[[], Any] | None = None,
  before_run: Callable[[Any], Any] | None = None,
  after_run: Callable[[Any], Any] | None = None,
) -> None:
  """Parses the gin flags, builds the cluster with `make_cluster(**LocalCluster's arguments)`,
  runs the job and reports it; what `ddiloco-local` and `ddiloco-ray` share.

  `backend_config()` builds the backend's own configuration from gin (e.g.
  `configurables.configured(RayConfig)`), checked with JobConfig
  (a bad value is a one-line error before anything is written), and goes to `make_cluster` as
  `backend_config=`. `before_run(cluster)` runs after the workdir exists, before anything starts
  (ddiloco-ray joins its Ray cluster there); `after_run(cluster)` runs after the job, however it
  ended (ddiloco-ray leaves its Ray cluster there).
  """
  from ddiloco.launch import configurables, local_cluster  # After flags: they import jax.
  from ddiloco.launch.job import JobConfig
  from ddiloco.metrics.writer import HEADLINE_KEYS

  if bool(_TLS_CERT.value) != bool(_TLS_KEY.value):
    raise app.UsageError("--tls_cert_file and --tls_key_file go together.")
  tls = None
  if _TLS_CERT.value:
    try:
      tls = processes.tls_files((_TLS_CERT.value, _TLS_KEY.value, _TLS_CA.value or _TLS_CERT.value))
    except ValueError as e:
      raise app.UsageError(f"no such TLS file: {e}") from None
  elif _TLS_CA.value:
    raise app.UsageError("--tls_ca_file needs --tls_cert_file and --tls_key_file.")
  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    job = configurables.configured(JobConfig)()
    backend = {} if backend_config is None else {"backend_config": backend_config()}
    check_job = getattr(backend.get("backend_config"), "check_job", None)
    if check_job is not None:  # What the backend's own settings must agree with in the job.
      check_job(job)
  workdir = cli.make_workdir(
    _WORKDIR.value, config_text, why_local="the launcher reads its programs' files while they run"
  )
  cluster = make_cluster(
    **backend,
    workdir=workdir,
    gin_args=gin_flags.forwarded_args(),
    num_learners=job.run.num_learners,
    devices_per_learner=job.devices_per_learner,
    processes_per_learner=job.processes_per_learner,
    tls=tls,
  )
  print(
    f"fleet control: ddiloco-fleet --workdir={workdir} list | add [--devices=N] [--batch_size=B] "
    "| remove --learner_id=I",
    file=sys.stderr,
    flush=True,
  )
  summary_file, plot_file = os.path.join(workdir, "summary.json"), os.path.join(workdir, "loss.png")
  try:
    if before_run is not None:
      before_run(cluster)
    summary = cluster.run(
      job,
      timeout_s=_TIMEOUT.value,
      progress_every_s=_PROGRESS_EVERY.value,
      progress=lambda line: print(line, file=sys.stderr, flush=True),
      resume=_RESUME.value,
    )
  except local_cluster.RunInterrupted as e:  # Every process was stopped and said so.
    print("summary (interrupted):", {k: e.summary.get(k) for k in HEADLINE_KEYS})
    print(f"wrote {_written(summary_file, plot_file)} of the partial run")
    sys.exit(130)
  except KeyboardInterrupt:  # Before anything ran, or a second Ctrl-C while summarizing.
    sys.exit(130)
  except (RuntimeError, TimeoutError) as e:
    print(f"{prog}: {e}\nevery process was stopped; logs are in {workdir}", file=sys.stderr)
    sys.exit(1)
  finally:
    if after_run is not None:
      after_run(cluster)
  print("summary:", {k: summary[k] for k in HEADLINE_KEYS})
  for shard, s in enumerate(summary.get("shards", [])):  # A sharded syncer: each shard's checks.
    print(
      f"syncer shard {shard}:", {k: s[k] for k in ("merges", "digests_agree", "ledger_balanced")}
    )
  print(f"wrote {_written(summary_file, plot_file)}")
  if not summary["ok"]:
    sys.exit(1)


def _written(*paths: str) -> str:
  return " and ".join(p for p in paths if os.path.exists(p))


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-local", module=__name__)


if __name__ == "__main__":
  run()
