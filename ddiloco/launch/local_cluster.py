"""`LocalCluster`: one syncer and M learner subprocesses on 127.0.0.1, and their clean teardown.

Used by `ddiloco-local` and the integration tests. Children are started in their own session (so a
terminal's Ctrl-C reaches only the launcher, which then stops them in order) with PR_SET_PDEATHSIG
(so they die with the launcher even if it is SIGKILLed). `stop_all` sends SIGTERM, waits, then
SIGKILLs whatever is left.
"""

import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ddiloco.launch.job import JobConfig
from ddiloco.metrics.writer import write_summary

_PR_SET_PDEATHSIG = 1
# Resolved in the parent: the child between fork and exec only makes one libc call (no imports, no
# allocation), which is what makes this preexec_fn safe although the launcher has threads (gRPC).
_PRCTL = (
  ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None
)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec.
  if _PRCTL is not None:
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass
class Child:
  """A started subprocess, its log file and the metrics file the launcher tails."""

  name: str
  proc: subprocess.Popen
  log_path: str
  metrics_path: str
  offset: int = 0
  last: dict = dataclasses.field(default_factory=dict)  # Last train event.

  def poll_metrics(self) -> None:
    """Reads new complete lines of metrics.jsonl; keeps the last `train` event."""
    try:
      with open(self.metrics_path) as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return
    end = data.rfind("\n") + 1
    self.offset += end
    for line in data[:end].splitlines():
      try:
        ev = json.loads(line)
      except json.JSONDecodeError:
        continue
      if ev.get("kind") == "train":
        self.last = ev


class LocalCluster:
  """Starts, watches and stops a syncer and learners (see module docstring).

  Args:
    workdir: output folder; the syncer writes to workdir/syncer, learner i to workdir/learner_i.
    gin_args: gin flags forwarded to every child.
    num_learners: M.
    devices_per_learner: fake CPU devices per learner process.
    python: the interpreter for the children.
  """

  def __init__(
    self,
    *,
    workdir: str,
    gin_args: Sequence[str],
    num_learners: int,
    devices_per_learner: int = 1,
    python: str = sys.executable,
    extra_learner_args: Sequence[str] = (),
  ):
    self.workdir = os.path.abspath(workdir)
    self.gin_args = list(gin_args)
    self.num_learners = num_learners
    self.devices_per_learner = devices_per_learner
    self.python = python
    self.extra_learner_args = list(extra_learner_args)
    self.token = secrets.token_hex(16)
    self.syncer: Child | None = None
    self.learners: dict[int, Child] = {}
    self.port: int | None = None

  # -- processes --------------------------------------------------------------------------------

  def _env(self, devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["DDILOCO_TOKEN"] = self.token
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(self.workdir, "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    flags_ = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    if devices is not None:
      flags_.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags_)
    env["PYTHONUNBUFFERED"] = "1"
    return env

  def _spawn(self, name: str, module: str, args: Sequence[str], env: dict[str, str]) -> Child:
    folder = os.path.join(self.workdir, name)
    os.makedirs(folder, exist_ok=True)
    log_path = os.path.join(folder, "log.txt")
    with open(log_path, "a") as log:  # A restarted process appends to its predecessor's log.
      proc = subprocess.Popen(
        [self.python, "-m", module, f"--workdir={folder}", *args, *self.gin_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - see _PRCTL.
      )
    return Child(name, proc, log_path, os.path.join(folder, "metrics.jsonl"))

  def start_syncer(self, timeout_s: float = 180.0, *, port: int = 0) -> int:
    """Starts the syncer and waits until it serves; returns its port.

    A restart passes the previous `port` so that learners reconnect to the same address; the syncer
    restores its checkpoint from its workdir (docs/resilience.md).
    """
    port_file = os.path.join(self.workdir, "syncer", "port")
    if os.path.exists(port_file):
      os.remove(port_file)
    self.syncer = self._spawn(
      "syncer",
      "ddiloco.launch.syncer_main",
      [f"--port_file={port_file}", f"--port={port}"],
      self._env(1),
    )
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(port_file):
      if self.syncer.proc.poll() is not None:
        raise RuntimeError(
          f"The syncer exited with {self.syncer.proc.returncode}:\n{self.tail(self.syncer)}"
        )
      if time.monotonic() > deadline:
        raise TimeoutError(
          f"The syncer did not serve within {timeout_s} s:\n{self.tail(self.syncer)}"
        )
      time.sleep(0.1)
    with open(port_file) as f:
      self.port = int(f.read())
    return self.port

  def start_learner(
    self,
    learner_id: int,
    *,
    extra_args: Sequence[str] = (),
    devices: int | None = None,
    address: str | None = None,
  ) -> Child:
    """Starts (or restarts) learner `learner_id` on `devices` fake CPU devices.

    Args:
      learner_id: its id; a restarted learner keeps its id, workdir and data shard.
      extra_args: flags for this learner only (e.g. `--gin.JobConfig.batch_size=8`).
      devices: fake CPU devices (default `devices_per_learner`): fleets may be heterogeneous.
      address: where it reaches the syncer (default the syncer's port; a chaos proxy's otherwise).
    """
    child = self._spawn(
      f"learner_{learner_id}",
      "ddiloco.launch.learner_main",
      [
        f"--learner_id={learner_id}",
        f"--syncer_address={address or f'127.0.0.1:{self.port}'}",
        *self.extra_learner_args,
        *extra_args,
      ],
      self._env(devices or self.devices_per_learner),
    )
    self.learners[learner_id] = child
    return child

  def signal(self, child: Child, sig: int) -> None:
    """Sends `sig` to a child's process group (SIGKILL, SIGSTOP, SIGCONT, SIGTERM) if it runs."""
    _signal(child.proc, sig)

  def kill(self, child: Child, *, timeout_s: float = 10.0) -> int | None:
    """SIGKILLs a child (a crash) and reaps it; returns its exit code."""
    _signal(child.proc, signal.SIGCONT)  # A stopped process must not stay stopped in the kernel.
    _signal(child.proc, signal.SIGKILL)
    try:
      return child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      return None

  def clear_previous(self) -> list[str]:
    """Removes a previous run's process folders (state, checkpoints, logs); returns what it removed.

    The compile cache stays. Without this, a restarted syncer or learner resumes from the
    checkpoints it finds in its folder (docs/resilience.md).
    """
    removed = []
    if not os.path.isdir(self.workdir):
      return removed
    for name in sorted(os.listdir(self.workdir)):
      path = os.path.join(self.workdir, name)
      if os.path.isdir(path) and (name == "syncer" or name.startswith("learner_")):
        shutil.rmtree(path)
        removed.append(name)
    return removed

  def children(self) -> list[Child]:
    return [*self.learners.values(), *([self.syncer] if self.syncer else [])]

  def stop_all(self, grace_s: float = 15.0) -> None:
    """SIGTERM to every live child (learners first), then SIGKILL after `grace_s`. Idempotent."""
    for group in (list(self.learners.values()), [self.syncer] if self.syncer else []):
      live = [c for c in group if c.proc.poll() is None]
      for c in live:
        _signal(c.proc, signal.SIGCONT)  # A paused (SIGSTOPped) child could not handle SIGTERM.
        _signal(c.proc, signal.SIGTERM)
      deadline = time.monotonic() + grace_s
      for c in live:
        try:
          c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          _signal(c.proc, signal.SIGKILL)
          c.proc.wait(timeout=10)

  @staticmethod
  def tail(child: Child, lines: int = 30) -> str:
    try:
      with open(child.log_path) as f:
        return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
      return ""

  # -- the whole run ----------------------------------------------------------------------------

  def run(
    self,
    job: JobConfig,
    *,
    timeout_s: float = 1800.0,
    progress_every_s: float = 2.0,
    progress: Callable[[str], None] | None = None,
    resume: bool = False,
  ) -> dict[str, Any]:
    """Starts everything, waits for the learners to finish, stops the syncer, summarizes.

    Unless `resume`, a previous run's folders in the workdir are removed first (`clear_previous`);
    with it, the syncer and learners restore their checkpoints from there.

    Raises:
      RuntimeError: if a process fails (everything is stopped first).
      TimeoutError: after `timeout_s` (everything is stopped first).
    """
    from ddiloco.transport.client import SyncerClient

    t0 = time.time()
    interrupted = False
    if not resume:
      removed = self.clear_previous()
      if removed and progress is not None:
        progress(
          f"fresh run: removed the previous run's {', '.join(removed)} (--resume keeps them)"
        )
    try:
      self.start_syncer()
      for i in range(self.num_learners):
        self.start_learner(i)
      client = SyncerClient(f"127.0.0.1:{self.port}", token=self.token, deadline_s=2.0)
      deadline = time.monotonic() + timeout_s
      next_progress = 0.0
      while True:
        codes = {i: c.proc.poll() for i, c in self.learners.items()}
        failed = {i: rc for i, rc in codes.items() if rc not in (None, 0)}
        if failed:
          i = next(iter(failed))
          raise RuntimeError(f"learner {i} exited with {failed[i]}:\n{self.tail(self.learners[i])}")
        if self.syncer.proc.poll() is not None:
          raise RuntimeError(f"The syncer exited early:\n{self.tail(self.syncer)}")
        if all(rc == 0 for rc in codes.values()):
          break
        if time.monotonic() > deadline:
          raise TimeoutError(f"The run did not finish within {timeout_s} s.")
        if progress is not None and time.monotonic() >= next_progress:
          progress(self.progress_line(client, t0))
          next_progress = time.monotonic() + progress_every_s
        time.sleep(0.2)
      client.close()
      _signal(self.syncer.proc, signal.SIGTERM)  # Graceful: flush merges, final eval, summary.
      self.syncer.proc.wait(timeout=300)
      if self.syncer.proc.returncode != 0:
        raise RuntimeError(f"The syncer failed at shutdown:\n{self.tail(self.syncer)}")
    except KeyboardInterrupt:
      interrupted = True
      raise
    finally:
      self.stop_all()
      if interrupted and progress is not None:
        progress("interrupted: every process stopped")
    summary = summarize(
      self.workdir, job, num_learners=self.num_learners, wall_time_s=time.time() - t0
    )
    plot(self.workdir)
    return summary

  def progress_line(self, client, t0: float) -> str:
    import grpc

    try:
      st = client.status()
      hist = list(st.quorum_histogram)
      merges = int(sum(hist))
      mean_q = sum(q * n for q, n in enumerate(hist)) / merges if merges else 0.0
      head = (
        f"t={time.time() - t0:6.1f}s v_sum {sum(st.versions):4d} merges {st.merges:4d} "
        f"quorum {mean_q:.2f} alive {list(st.alive)}"
      )
    except grpc.RpcError as e:
      head = f"t={time.time() - t0:6.1f}s syncer {e.code().name}"
    parts = []
    for i, c in sorted(self.learners.items()):
      c.poll_metrics()
      state = "done" if c.proc.poll() == 0 else "up"
      if c.last:
        parts.append(f"L{i}:{state} step {c.last['step']} loss {c.last['loss']:.3f}")
      else:
        parts.append(f"L{i}:{state} starting")
    return head + " | " + " ".join(parts)


def _signal(proc: subprocess.Popen, sig: int) -> None:
  if proc.poll() is None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, sig)  # The child leads its own session and process group.


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def summarize(workdir: str, job: JobConfig, *, num_learners: int, wall_time_s: float) -> dict:
  """The run's summary.json from the syncer's and learners' summaries (the keys of simulate)."""
  syncer = _read_json(os.path.join(workdir, "syncer", "summary.json"))
  learners = {}
  for i in range(num_learners):
    path = os.path.join(workdir, f"learner_{i}", "summary.json")
    if os.path.exists(path):
      learners[i] = _read_json(path)
  digests = syncer["digests"]
  applies = [(p, v, d) for s in learners.values() for p, v, d in s["applies"]]
  agree = bool(applies) and all(d and digests.get(f"{p}:{v}") == d for p, v, d in applies)
  agree = agree and all(s["digest_mismatches"] == 0 for s in learners.values())
  busy = sum(s["train_time_s"] for s in learners.values())
  provisioned = sum(s["train_end"] - s["start_time"] for s in learners.values())
  spans = sorted((s["train_start"], s["train_end"]) for s in learners.values())
  downtime, reach = 0.0, spans[0][1] if spans else 0.0
  for start, end in spans[1:]:
    downtime += max(0.0, start - reach)
    reach = max(reach, end)
  tokens = sum(s["tokens"] for s in learners.values())
  push = {}
  for s in learners.values():
    for k, n in s["push_status"].items():
      push[k] = push.get(k, 0) + n
  summary = {
    "final_eval_loss": syncer["final_eval_loss"],
    "initial_eval_loss": syncer["initial_eval_loss"],
    "tokens_trained": tokens,
    "goodput": busy / provisioned if provisioned > 0 else 0.0,
    "global_downtime_s": downtime,
    "merges": syncer["merges"],
    "mean_quorum_size": syncer["mean_quorum_size"],
    "dropped_reports": int(syncer["stats"].get("late", 0)),
    "bytes_up": syncer["bytes_up"],
    "bytes_down": syncer["bytes_down"],
    "wall_time_s": wall_time_s,
    "virtual_time_s": wall_time_s,  # Real processes: virtual time is wall time.
    "digests_agree": agree,
    "digest_checks": len(applies),
    "token_budget": job.token_budget(),
    "budget_reached": tokens >= job.token_budget(),
    "stalled": False,
    "learners": {
      str(i): {
        "steps": s["steps"],
        "tokens": s["tokens"],
        "step_time_s": s["step_time_s"],
        "push_status": s["push_status"],
        "applies": len(s["applies"]),
        "bytes_up": s["bytes_up"],
        "bytes_down": s["bytes_down"],
        "final_loss": s["losses"][-1][2] if s["losses"] else None,
      }
      for i, s in learners.items()
    },
    "push_status": push,
    "syncer": {
      k: syncer[k]
      for k in ("stats", "refused", "quorum_size_counts", "uplink_codec", "downlink_codec")
    },
    "evals": syncer["evals"],
    "num_params": syncer["num_params"],
  }
  summary["ok"] = bool(
    agree and summary["budget_reached"] and np.isfinite(summary["final_eval_loss"])
  )
  write_summary(workdir, summary)
  return summary


def plot(workdir: str) -> str:
  """loss.png: training loss over time per learner, the global eval loss, and merge events."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  syncer = _read_json(os.path.join(workdir, "syncer", "summary.json"))
  t0 = min([e[0] for e in syncer["evals"]] or [0.0])
  fig, ax = plt.subplots(figsize=(9, 4.5))
  i = 0
  while os.path.exists(path := os.path.join(workdir, f"learner_{i}", "summary.json")):
    losses = _read_json(path)["losses"]
    if losses:
      ax.plot(
        [x[1] - t0 for x in losses], [x[2] for x in losses], lw=1, label=f"learner {i} (train)"
      )
    i += 1
  evals = syncer["evals"]
  ax.plot(
    [e[0] - t0 for e in evals], [e[2] for e in evals], "k-o", lw=2, label="global model (eval)"
  )
  merges = syncer["merge_times"]
  if merges:
    lo, hi = ax.get_ylim()
    ax.vlines(
      [m[0] - t0 for m in merges], lo, lo + 0.04 * (hi - lo), color="0.5", lw=0.5, label="merges"
    )
    ax.set_ylim(lo, hi)
  ax.set_xlabel("wall time since the syncer started (s)")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title(
    f"{syncer['merges']} merges, uplink {syncer['uplink_codec']}, downlink {syncer['downlink_codec']}"
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = os.path.join(workdir, "loss.png")
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out
