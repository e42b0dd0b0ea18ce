"""`ddiloco-syncer`: the syncer service (CPU only) of a distributed Decoupled DiLoCo run.

  ddiloco-syncer --gin_file=gin_configs/local_tiny.gin --workdir=/tmp/run/syncer --port=50051

With `--gin.JobConfig.syncer_shards=S` (S > 1) run S of them, each with its own `--shard=i`,
workdir, port and the same `--shard_addresses=host:port,...` (every shard's, in shard order):
every fragment is cut into S slices, and shard i merges slice i of each: the layout's fragments
f with f mod S = i (docs/architecture.md, "The sharded syncer").

It serves its control plane (gRPC) on `--port` and its data plane, every push and pull, on its
bulk port (`--bulk_port`, or `ServiceConfig.bulk_port`; a free one by default): learners must
reach both. Both bind to 127.0.0.1 unless `--host` says otherwise. The shared token comes from
`--auth_token_file` or the DDILOCO_TOKEN environment variable; TLS is on with `--tls_cert_file` and
`--tls_key_file`. A non-loopback `--host` without a token is refused unless `--insecure` is given.
A port in use (by another syncer, say) ends the program with one line on stderr and exit status 1.
SIGTERM or SIGINT stops it gracefully: it stops accepting calls, merges every round that has its
quorum, evaluates the global model and writes `summary.json` to the workdir. It exits 1 with a
one-line error if its workdir holds no usable checkpoint although learners were served versions, or
holds another shard's state (or another model's), and after writing its summary if a merge could
not be journaled (a full disk; docs/resilience.md).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # The syncer is a CPU service (before jax loads).
# One BLAS thread: the merge's small norms made an idle OpenBLAS worker spin at ~0.4 core, taken
# from the learners on the same host (measured: 65-90 ms of syncer CPU per merge, 13 ms with this).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import gc
import signal
import sys
import threading

from absl import app, flags, logging

from ddiloco.launch import cli, gin_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "output folder", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to bind; loopback unless told otherwise")
_PORT = flags.DEFINE_integer(
  "port", 0, "port to bind; 0 picks a free one (see --port_file)", lower_bound=0, upper_bound=65535
)
_SHARD = flags.DEFINE_integer(
  "shard", 0, "this process's syncer shard, in [0, JobConfig.syncer_shards)", lower_bound=0
)
_SHARD_ADDRESSES = flags.DEFINE_string(
  "shard_addresses",
  "",
  "with JobConfig.syncer_shards = S > 1: every shard's host:port, comma-separated, in shard order "
  "(told to learners at Register)",
)
_BULK_PORT = flags.DEFINE_integer(
  "bulk_port",
  None,
  "the bulk port (pushes and pulls) to bind; 0 picks a free one; default: "
  "ServiceConfig.bulk_port (+ --shard)",
  lower_bound=0,
  upper_bound=65535,
)
_ADVERTISE_BULK_PORT = flags.DEFINE_integer(
  "advertise_bulk_port",
  0,
  "the bulk port learners are told at Register (a proxy's in front of it); 0: the bound one",
  lower_bound=0,
  upper_bound=65535,
)
_PORT_FILE = flags.DEFINE_string("port_file", None, "write the bound port here once serving")
_TOKEN_FILE = flags.DEFINE_string(
  "auth_token_file", None, "shared token file (else $DDILOCO_TOKEN)"
)
_TLS_CERT = flags.DEFINE_string("tls_cert_file", None, "PEM certificate chain for TLS")
_TLS_KEY = flags.DEFINE_string("tls_key_file", None, "PEM private key for TLS")
_INSECURE = flags.DEFINE_bool(
  "insecure", False, "serve a non-loopback --host without a shared token (logs a warning)"
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # Imported after flag parsing and JAX_PLATFORMS: these import jax.
  from ddiloco.checkpoint.syncer import RestoreError, SyncerCheckpointConfig, WorkdirMismatch
  from ddiloco.launch import configurables, runtime
  from ddiloco.launch.job import JobConfig

  if bool(_TLS_CERT.value) != bool(_TLS_KEY.value):
    raise app.UsageError("--tls_cert_file and --tls_key_file go together.")
  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    job = configurables.configured(JobConfig)()
    checkpoint = configurables.configured(SyncerCheckpointConfig)()
    from ddiloco.launch import syncer_shards

    shard_addresses = syncer_shards.parse_addresses(_SHARD_ADDRESSES.value, job.syncer_shards)
    if _SHARD.value >= job.syncer_shards:
      raise ValueError(f"--shard={_SHARD.value} with JobConfig.syncer_shards={job.syncer_shards}.")
  workdir = cli.make_workdir(
    _WORKDIR.value, config_text, why_local="the syncer fsyncs its merge journal before it serves"
  )
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  tls = (_TLS_CERT.value, _TLS_KEY.value) if _TLS_CERT.value else None
  from ddiloco.service import server as server_lib
  from ddiloco.transport import auth

  address = f"{_HOST.value}:{_PORT.value}"
  if ":" in _HOST.value and not _HOST.value.startswith("["):
    address = f"[{_HOST.value}]:{_PORT.value}"  # An IPv6 literal.
  try:
    # Checked before the model is built (`SyncerRun` checks it again, for its other callers).
    syncer_shards.check_workdir(workdir, _SHARD.value, job.syncer_shards)
    run = runtime.SyncerRun(
      job,
      workdir=workdir,
      checkpoint=checkpoint,
      shard=_SHARD.value,
      shard_addresses=shard_addresses,
    )
  except (RestoreError, WorkdirMismatch) as e:  # One line: the operator's to fix, no traceback.
    raise SystemExit(f"ddiloco-syncer: cannot restart: {e}") from None
  try:
    server = run.serve(
      address,
      token=auth.read_token(_TOKEN_FILE.value),
      tls=tls,
      insecure=_INSECURE.value,
      bulk_port=_BULK_PORT.value,
      advertise_bulk_port=_ADVERTISE_BULK_PORT.value,
    )
  except (server_lib.BindError, server_lib.InsecureServeError) as e:
    sys.exit(f"ddiloco-syncer: {e}")  # One line, no traceback: the operator's mistake.
  logging.info(
    "syncer shard %d serving on %s:%d, its bulk port on %d",
    _SHARD.value,
    _HOST.value,
    server.port,
    server.bulk.port,
  )
  # The start-up heap (jax, gRPC, the model, the compiled outer steps: ~140k objects) never turns
  # into garbage. Frozen, the cyclic GC's full passes skip it; unfrozen, one full pass over it
  # stopped every thread, and every push and merge with them, for 0.6-1.1 s (a syncer shard of
  # scripts/bench_capacity.py on the 2-core VM under load).
  gc.freeze()
  if _PORT_FILE.value:
    tmp = f"{_PORT_FILE.value}.tmp"
    with open(tmp, "w") as f:
      f.write(str(server.port))
    os.replace(tmp, _PORT_FILE.value)
  run.loop(stop)
  summary = run.shutdown()
  print("syncer summary:", {k: summary[k] for k in ("merges", "final_eval_loss", "refused")})
  if summary["halted"] is not None:
    raise SystemExit(f"ddiloco-syncer: halted: {summary['halted']}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-syncer", module=__name__)


if __name__ == "__main__":
  run()
