"""`ddiloco-learner`: one learner process of a distributed Decoupled DiLoCo run.

  ddiloco-learner --gin_file=gin_configs/local_tiny.gin --learner_id=0 \
      --syncer_address=127.0.0.1:50051 --workdir=/tmp/run/learner_0

Trains on every local device (on CPU: `XLA_FLAGS=--xla_force_host_platform_device_count=N`, set from
`--num_devices` when XLA_FLAGS does not set it). SIGTERM or SIGINT stops it after the current step:
it saves a checkpoint, flushes its pushes, leaves the fleet and writes `summary.json`.

Checkpoints (`ddiloco.LearnerCheckpointConfig`, on by default, in `<workdir>/checkpoints`): a learner
restarted with the same `--learner_id` and `--workdir` after a crash (even SIGKILL) restores its
step, inner optimizer state and data position from its newest checkpoint, then takes the global
fragments from the syncer. `--restore=own|peer|fresh` overrides where that chain starts
(docs/resilience.md); the summary's `restored_from` says what happened.

Multi-host slices: a learner may be several processes (one per host of its slice), started with
the same flags plus `--num_processes`, `--process_id` and `--coordinator_address` (process 0's
host:port for `jax.distributed.initialize`). Their mesh spans all their devices; process 0 alone
talks to the syncer and the others follow its applies step by step (learner_process/multihost.py). Process 0
writes to `--workdir`, process i to `<workdir>/process_<i>`. All of them save and restore the
learner's checkpoints in `<workdir>/checkpoints` together (on real hosts: a folder every host
mounts, or `LearnerCheckpointConfig.directory`); restart all of them with the same flags.

  ddiloco-learner ... --num_devices=2 --num_processes=2 --process_id=0 \
      --coordinator_address=127.0.0.1:12355     # and the same with --process_id=1
"""

import dataclasses
import functools
import os
import sys

from absl import app, flags, logging

from ddiloco.launch import cli, gin_flags

_LEARNER_ID = flags.DEFINE_integer(
  "learner_id", None, "this learner's id (>= 0)", required=True, lower_bound=0
)
_ADDRESS = flags.DEFINE_string("syncer_address", None, "syncer host:port", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output folder", required=True)
_NUM_DEVICES = flags.DEFINE_integer(
  "num_devices", None, "fake CPU devices (if XLA_FLAGS lacks it)", lower_bound=1
)
_TOKEN_FILE = flags.DEFINE_string(
  "auth_token_file", None, "shared token file (else $DDILOCO_TOKEN)"
)
_TLS_CA = flags.DEFINE_string("tls_ca_file", None, "PEM CA to trust; turns TLS on")
_CONNECT_TIMEOUT = flags.DEFINE_float(
  "connect_timeout_s", 120.0, "first registration timeout", lower_bound=0.0
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "jax.distributed coordinator")
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", 1, "processes of this learner's slice", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process's index in the slice")
_RESTORE = flags.DEFINE_enum(
  "restore",
  None,
  ["own", "peer", "fresh"],
  "where the restore chain own -> peer -> fresh starts (default: LearnerCheckpointConfig.init_from)",
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _NUM_DEVICES.value and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={_NUM_DEVICES.value}"
    ).strip()
  if "jax" in sys.modules:
    logging.warning("jax was imported before the device count was set; XLA_FLAGS may be ignored.")
  multi = _NUM_PROCESSES.value > 1
  if multi and not _COORDINATOR.value:
    raise app.UsageError("--num_processes > 1 needs --coordinator_address (process 0's host:port).")
  if not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
    raise app.UsageError(f"--process_id must be in [0, {_NUM_PROCESSES.value}).")
  import signal

  import jax

  from ddiloco.parallel import multihost

  if multi:
    multihost.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
    )
  from ddiloco.checkpoint.learner import LearnerCheckpointConfig
  from ddiloco.launch import configurables, learner_workers, runtime
  from ddiloco.launch.job import JobConfig
  from ddiloco.metrics.writer import write_summary
  from ddiloco.transport import auth

  workdir = learner_workdir = _WORKDIR.value
  if _PROCESS_ID.value > 0:
    workdir = os.path.join(workdir, f"process_{_PROCESS_ID.value}")
  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    job = configurables.configured(JobConfig)()
    checkpoint = configurables.configured(LearnerCheckpointConfig)()
    if _RESTORE.value:
      checkpoint = dataclasses.replace(checkpoint, init_from=_RESTORE.value)
  cli.make_workdir(workdir, config_text, remote_ok=True)
  client = None
  if _PROCESS_ID.value == 0:  # The other processes of a learner never talk to the syncer.
    client = runtime.learner_client(
      job, _ADDRESS.value, token=auth.read_token(_TOKEN_FILE.value), tls_ca_file=_TLS_CA.value
    )
  make_worker = runtime.make_learner_worker
  if multi:
    make_worker = functools.partial(
      learner_workers.make_multihost_worker, learner_workdir=learner_workdir
    )
  worker, writer = make_worker(
    job,
    learner_id=_LEARNER_ID.value,
    client=client,
    workdir=workdir,
    connect_timeout_s=_CONNECT_TIMEOUT.value,
    checkpoint=checkpoint,
  )
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: worker.request_stop())
  logging.info(
    "learner %d on %d device(s), process %d of %d",
    _LEARNER_ID.value,
    len(jax.devices()),
    jax.process_index(),
    jax.process_count(),
  )
  worker.connect()
  summary = worker.run(job.run.steps_per_learner)
  write_summary(workdir, summary)
  writer.close()
  if client is not None:
    client.close()
  print(
    f"learner {_LEARNER_ID.value}: {summary['steps']} steps (restored from "
    f"{summary['restored_from']} at {summary['resumed_step']}), pushes {summary['push_status']}, "
    f"{len(summary['applies'])} applies, {summary['digest_mismatches']} digest mismatches"
  )


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-learner", module=__name__)


if __name__ == "__main__":
  run()
