"""Setting up real runs in tests: a run's `JobConfig` and gin flags from a shipped config, and
checks that a run's processes are gone."""

import os
import subprocess
from collections.abc import Sequence
from typing import Any

import ddiloco

# The gin configs ship with the package (`gin_configs` in a checkout links there).
CONFIGS = os.path.join(os.path.dirname(ddiloco.__file__), "configs")


def quick(*, learners: int = 2, steps: int = 32, more: Sequence[str] = ()) -> list[str]:
  """Gin bindings for a short test run of the tiny configs: `learners` learners of `steps` steps,
  no periodic evaluation, 2 held-out batches, a 4-step warm-up, then `more`."""
  return [
    f"LEARNERS = {learners}",
    f"STEPS = {steps}",
    "RunConfig.eval_every_s = 0.0",
    "RunConfig.eval_batches = 2",
    "InnerOptConfig.warmup_steps = 4",
    *more,
  ]


def config_path(name: str) -> str:
  """The shipped config `name` ("local_tiny.gin", "clusters/tpu_v5p32_5b.gin")."""
  return os.path.join(CONFIGS, name)


def parse_job(gin_file: str, bindings: Sequence[str] = ()) -> Any:
  """The `JobConfig` of `gin_file` with `bindings`, as every process of the run builds it (gin is
  cleared afterwards)."""
  from ddiloco.launch import configurables
  from ddiloco.launch.job import JobConfig

  try:
    configurables.parse([gin_file], bindings, search_paths=[CONFIGS])
    return configurables.configured(JobConfig)()
  finally:
    configurables.clear()


def gin_args(gin_file: str, bindings: Sequence[str] = ()) -> list[str]:
  """The gin flags a launcher forwards to its programs for `gin_file` with `bindings`."""
  return [
    f"--gin_file={gin_file}",
    f"--gin_search_paths={CONFIGS}",
    *(f"--gin_bindings={b}" for b in bindings),
  ]


def chaos_run(gin_file: str, workdir: str) -> Any:
  """A `ChaosRun` of the shipped chaos config `gin_file` (its job and schedule as `ddiloco-chaos`
  builds them) on a `LocalCluster` in `workdir`; call its `run`."""
  from ddiloco.chaos.driver import ChaosRun
  from ddiloco.faults.schedule import ChaosConfig
  from ddiloco.launch import configurables, local_cluster
  from ddiloco.launch.job import JobConfig

  search = [CONFIGS, os.path.join(CONFIGS, "chaos")]
  configurables.parse([gin_file], search_paths=search)
  try:
    job = configurables.configured(JobConfig)()
    chaos = configurables.configured(ChaosConfig)()
  finally:
    configurables.clear()
  cluster = local_cluster.LocalCluster(
    workdir=workdir, gin_args=gin_args(gin_file), num_learners=job.run.num_learners
  )
  return ChaosRun(job, chaos, cluster)


def self_signed_certificate(folder: str, *, san: str) -> tuple[str, str]:
  """A throwaway self-signed certificate and key (PEM, in `folder`) valid for `san`, such as
  "IP:127.0.0.1" or "DNS:localhost"; made with the openssl command."""
  cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
  subprocess.run(
    [
      "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
      "-keyout", key, "-out", cert, "-subj", "/CN=ddiloco-test", "-addext", f"subjectAltName={san}",
    ],
    check=True,
    capture_output=True,
    timeout=30,
  )  # fmt: skip
  return cert, key


def processes_mentioning(text: str) -> list[int]:
  """Pids of live (not zombie) processes whose command line mentions `text`, such as a run's
  workdir or a Ray session's folder; this process excluded."""
  pids = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
      with open(f"/proc/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if text in cmdline and state != "Z":
      pids.append(int(pid))
  return pids


def assert_all_gone(cluster: Any) -> None:
  """Every child of a `LocalCluster` exited and was reaped, and its process group is empty."""
  assert cluster.children()
  for child in cluster.children():
    assert child.proc.poll() is not None, f"{child.name} still running"
    try:
      os.killpg(child.proc.pid, 0)
    except ProcessLookupError:
      continue
    raise AssertionError(f"{child.name}'s process group {child.proc.pid} still has processes")
