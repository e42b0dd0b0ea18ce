"""Benchmark: a learner process syncing through the real gRPC syncer against a bare training loop.

  python scripts/bench_learner_overhead.py --devices=2 --batch=8 --seq_len=64 --steps=96 --rounds=3

Each round starts a fresh syncer subprocess (`ddiloco.launch.syncer_main` via
`LocalCluster.start_syncer`, CPU only) for the job of gin_configs/local_tiny.gin with LEARNERS = 1
and P = H = 24 (docs/algorithm.md §2: the syncer's step clock makes exactly one fragment due every step and
opens its round; the learner answers it at its next step boundary). This process parses the same
gin files and bindings, builds a learner with `make_learner_worker` on `--devices` fake CPU devices
and trains it through `LearnerWorker.run` as the fleet's first and only learner, so the syncer's
step clock runs at this learner's own pace. (A fresh syncer per round, not one syncer and a new
learner id per round: every round then starts from the same state, every fragment at version 0 and
a step clock that starts with this learner.) The syncer is stopped before the bare loops run.
Four loops are measured per round (medians over rounds):
  worker      the `LearnerWorker` loop. Compilation, the join and the start of the syncer's step
              clock, before which no round opens (it needs about a second of heartbeats to measure
              the learner's rate: on 2 loaded cores the syncer asked for 119 rounds in 128 steps in
              one run, 118 in 136 in another), are excluded by timing only the loop iterations
              after the first `--skip` ones (default 40; the whole run's line shows the rounds
              asked): the batches it consumes come from an iterator that stamps every `next()`
              (one per iteration).
  bare        the worker's own `CompiledSteps.train` (same model, mesh, shardings, donation) on the
              same pre-drawn batches, waiting for step t−1's loss after dispatching step t: the
              worker keeps one step in flight, so this is its fair baseline.
  bare_async  the same, blocking only at the end (JAX's asynchronous dispatch runs ahead).
  bare_sync   the same, blocking on step t itself (nothing in flight). Diagnostic: on the CPU
              backend an on-device copy of the due fragment waited for step t to finish, so the
              worker's loop degenerated to this one (measured; see docs/results.md); on CPU
              the worker now snapshots by reference (`Learner.snapshot_by_reference`).
  bare_keep   `bare` with the step variant that does not donate the parameters, which the worker
              runs after a snapshot by reference or an apply whose digest is read back later.
It prints steps/s and this process's CPU time per step of each loop, worker/bare (goal >= 0.95),
worker/bare_async and worker/bare_sync, and CPU per step of bare against worker + syncer (a
load-robust estimate of the ratio when the cores are saturated). For the worker's timed window, per
step: rounds answered (fragments sent), pushes answered and applies (1 each when the syncer opens
one round a step and every round merges), wire bytes, the training thread's time in the worker's
own host work (`send_due`: snapshot; `drain`: push results, received fragments, round requests;
`apply`: apply + digest read-back), and the CPU time of the learner process, of its background
threads (sender, comm, rounds, puller) and of the syncer process. The whole run's line adds the
rounds the syncer asked for and its step clock as the learner last heard it. And the load average:
the machine may be shared, and then wall-clock rates move between rounds; CPU times move much less.

What the worker's "overhead" includes, all of it real: per step, the device-side copy of the
fragment whose round it answers and its asynchronous host transfer (`DeviceParams.snapshot`);
in the sender thread, the wait for that copy, the delta θ − Θ^(anchor), int4 encoding and the gRPC
push; in the comm thread, heartbeats (every 0.25 s: the learner's step, from which the syncer's step
clock takes its pace); in the rounds thread, the `Rounds` stream of round requests and version
announcements; in the puller, the pull and decoding of every announced version; on the training
thread, draining push results, feeding received fragments and round requests to the learner,
applying fragments τ = 2 steps after answering their round (a `device_put` per tensor) with a
digest read back from the devices (docs/algorithm.md §4.7), and every `RunConfig.log_every` steps a loss read
(it blocks on the current step) and a metrics line. The background threads hold the GIL for their
Python work and compete for the 2 cores with XLA's compute threads and with the syncer process
(step clock, merge, outer step, encoding).
The syncer's periodic evaluation is off (`RunConfig.eval_every_s = 0`): it is not learner overhead.
`--syncer_blas_threads=1` runs the syncer with OPENBLAS_NUM_THREADS=1: by default its OpenBLAS
worker threads spin after every small BLAS call (the norms of RDA) and take most of its CPU time.
"""

import collections
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 2, "fake CPU devices of the learner's mesh")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step")
_SEQ = flags.DEFINE_integer("seq_len", 64, "tokens per sequence")
_STEPS = flags.DEFINE_integer("steps", 96, "timed steps per loop per round")
_SKIP = flags.DEFINE_integer(
  "skip",
  40,
  "first worker steps left out: compilation, the join and the start of the syncer's step clock",
)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "rounds (median reported)")
_CODEC = flags.DEFINE_enum("codec", "int4", ["fp32", "bf16", "int8", "int4"], "uplink/downlink")
_SYNCER_BLAS = flags.DEFINE_integer(
  "syncer_blas_threads",
  0,
  "OPENBLAS_NUM_THREADS for the syncer process (0: inherit the environment); see the docstring",
)
_LEARNER_CPUS = flags.DEFINE_list(
  "learner_cpus",
  [],
  "CPUs for this process (the learner and the bare loops), e.g. 0; empty: no pinning",
)
_SYNCER_CPUS = flags.DEFINE_list(
  "syncer_cpus",
  [],
  "CPUs for the syncer process, e.g. 1 (as on its own host); empty: no pinning",
)
_SNAPSHOT = flags.DEFINE_enum(
  "snapshot",
  "auto",
  ["auto", "reference", "copy"],
  "how the worker snapshots a due fragment (Learner.snapshot_by_reference); auto: by reference "
  "on CPU, the on-device copy of GPU/TPU otherwise",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "output folder (default: a temporary one, removed)")

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_GIN_DIR = os.path.join(_ROOT, "gin_configs")
_GIN_FILE = os.path.join(_GIN_DIR, "local_tiny.gin")
_TICK = os.sysconf("SC_CLK_TCK")
# Methods of the training loop (worker.loop): the step boundary (its own drain included, then
# `step_boundary`'s applies and answers) and the drain the loop makes before it.
_HOST_WORK = ("drain", "_boundary")
# Loop name -> (steps left in flight, whether the step keeps its input parameters).
_BARE = {
  "bare": (1, False),
  "bare_async": (None, False),
  "bare_sync": (0, False),
  "bare_keep": (1, True),
}


def _bindings() -> list[str]:
  """Bindings shared by this process and the syncer, so both agree on the layout digest."""
  return [
    "LEARNERS = 1",
    f"STEPS = {_STEPS.value + _SKIP.value}",
    f"BATCH = {_BATCH.value}",
    f"SEQ_LEN = {_SEQ.value}",
    f"transformer_config.max_len = {_SEQ.value}",
    f'UPLINK = "{_CODEC.value}"',
    f'DOWNLINK = "{_CODEC.value}"',
    # docs/algorithm.md §2 with P = H: the syncer opens fragment p's round at clock steps t ≡ p (mod 24).
    "FragmentSchedule.num_fragments = 24",
    "FragmentSchedule.period = 24",
    "RunConfig.eval_every_s = 0.0",
    "RunConfig.eval_batches = 2",
  ]


def _load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _pin(pid: int, cpus: list[str]) -> None:
  """Moves every thread of process `pid` onto `cpus` (threads it starts later inherit the mask)."""
  if not cpus:
    return
  mask = {int(c) for c in cpus}
  for tid in os.listdir(f"/proc/{pid}/task"):
    with contextlib.suppress(ProcessLookupError):  # The thread ended meanwhile.
      os.sched_setaffinity(int(tid), mask)


def _cpu_s(stat_path: str) -> float:
  """utime + stime of a process or thread from /proc (0 if it is gone)."""
  try:
    with open(stat_path) as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except FileNotFoundError:
    return 0.0
  return (int(fields[11]) + int(fields[12])) / _TICK  # Fields 14 and 15 of proc(5).


class _Stamped:
  """Yields the batches in a cycle, stamping the time at every `next()`.

  `probe()` is recorded only at the calls numbered in `probe_at`: it reads /proc files.
  """

  def __init__(self, batches: list[dict[str, np.ndarray]], probe_at: tuple[int, ...]):
    self._batches = batches
    self._probe_at = probe_at
    self.stamps: list[float] = []
    self.probes: dict[int, dict[str, float]] = {}
    self.probe: Callable[[], dict[str, float]] = dict

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    i = len(self.stamps)
    if i in self._probe_at:
      self.probes[i] = self.probe()
    self.stamps.append(time.perf_counter())
    return self._batches[i % len(self._batches)]


def _instrument(worker, stamped: _Stamped, syncer_pid: int) -> None:
  """Counts rounds answered (sends) and times the worker's host work on the training thread, for
  the probes."""
  acc: collections.Counter[str] = collections.Counter()
  make_answer = worker.learner.answer

  def answer(p, **kwargs):  # One call per round answered (the worker also peeks at `due()`).
    acc["sent"] += 1
    return make_answer(p, **kwargs)

  worker.learner.answer = answer
  for name in _HOST_WORK:
    fn = getattr(worker.loop, name)

    def timed(*args, fn=fn, name=name, **kwargs):
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      acc[name] += time.perf_counter() - t0
      return out

    setattr(worker.loop, name, timed)

  def probe() -> dict[str, float]:
    threads = sum(_cpu_s(f"/proc/self/task/{t.native_id}/stat") for t in worker.threads)
    return {
      **acc,
      "pushes": sum(worker.loop.push_status.values()),
      "applies": len(worker.loop.applies),
      "threads_cpu": threads,
      "syncer_cpu": _cpu_s(f"/proc/{syncer_pid}/stat"),
      "proc_cpu": _cpu_s("/proc/self/stat"),
      "bytes_up": worker.link.client.bytes_up,
      "bytes_down": worker.link.client.bytes_down,
    }

  stamped.probe = probe


def _run_worker(job, cluster, port: int, batches, learner_dir: str) -> tuple[Any, dict, dict]:
  """One worker's run; returns (worker, summary, the timed window's per-step figures)."""
  from ddiloco.launch import runtime
  from ddiloco.transport.client import SyncerClient

  client = SyncerClient(
    f"127.0.0.1:{port}", token=cluster.token, max_chunk_bytes=job.run.the_service().max_chunk_bytes
  )
  # Both loops consume the same pre-drawn batches (grain's prefetch threads would load the worker
  # only). Iterations skip .. last-1 are timed: each dispatches a step, waits for the previous one
  # and does all of the worker's per-step host work.
  a, b = _SKIP.value, _SKIP.value + _STEPS.value - 1
  stamped = _Stamped(batches, probe_at=(a, b))
  worker, writer = runtime.make_learner_worker(
    job, learner_id=0, client=client, workdir=learner_dir, data=stamped
  )
  if _SNAPSHOT.value != "auto":
    worker.learner.device.snapshot_by_reference = _SNAPSHOT.value == "reference"
  _instrument(worker, stamped, cluster.syncer.proc.pid)
  worker.connect()
  summary = worker.run(_STEPS.value + _SKIP.value)
  writer.close()
  client.close()
  if len(stamped.stamps) != b + 1:
    raise RuntimeError(f"The worker ran {len(stamped.stamps)} iterations, expected {b + 1}.")
  n = b - a
  first, last = stamped.probes[a], stamped.probes[b]
  window = {k: (last.get(k, 0.0) - first.get(k, 0.0)) / n for k in last}
  window["step_s"] = (stamped.stamps[b] - stamped.stamps[a]) / n
  return worker, summary, window


def main(argv: list[str]) -> None:
  del argv
  if _STEPS.value < 2 or _SKIP.value < 0 or _ROUNDS.value < 1:
    raise app.UsageError("Need --steps >= 2, --skip >= 0 and --rounds >= 1.")
  # LocalCluster's preexec_fn makes one libc call between fork and exec (local_cluster.py), which is
  # what Python's warning about forking a multithreaded (JAX) process is about.
  warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
  # Before jax is imported (the ddiloco imports below import it): the learner's mesh is every
  # local device, as in a learner process.
  xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device" not in f]
  xla.append(f"--xla_force_host_platform_device_count={_DEVICES.value}")
  os.environ["XLA_FLAGS"] = " ".join(xla)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Before jax starts its thread pools (they are sized by the CPUs this process may use).
  _pin(os.getpid(), _LEARNER_CPUS.value)
  workdir = os.path.abspath(_WORKDIR.value or tempfile.mkdtemp(prefix="bench_overhead_"))
  # One persistent compilation cache for this process and every syncer: later rounds start faster.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  if _SYNCER_BLAS.value > 0:  # Children copy os.environ; this process's OpenBLAS is already loaded.
    os.environ["OPENBLAS_NUM_THREADS"] = str(_SYNCER_BLAS.value)
  import jax

  from ddiloco.data import text as text_data
  from ddiloco.launch import configurables, local_cluster
  from ddiloco.launch.job import JobConfig

  print(
    f"load average at start: {_load()}; this process on CPUs {sorted(os.sched_getaffinity(0))}, "
    f"syncer on {_SYNCER_CPUS.value or 'any'}",
    flush=True,
  )
  bindings = _bindings()
  configurables.parse([_GIN_FILE], bindings, search_paths=[_GIN_DIR])
  job = configurables.configured(JobConfig)()
  gin_args = [f"--gin_file={_GIN_FILE}", f"--gin_search_paths={_GIN_DIR}"]
  gin_args += [f"--gin_bindings={b}" for b in bindings]
  it = text_data.make_train_iterator(
    job.run.data, shard_index=0, num_shards=1, batch_size=job.run.batch_size
  )
  batches = [next(it) for _ in range(_STEPS.value + _SKIP.value)]

  times: dict[str, list[float]] = {"worker": [], **{name: [] for name in _BARE}}
  cpu: dict[str, list[float]] = {name: [] for name in times}  # This process's CPU s per step.
  windows, summaries, state = [], [], {}

  def run_bare(in_flight: int | None, keep: bool = False) -> None:
    """`in_flight` steps may be pending when the next is dispatched (None: block at the end);
    `keep`: the step that does not donate the parameters (`CompiledSteps.train(keep_params=True)`)."""
    steps = state["steps"]
    params, opt, previous = state["params"], state["opt"], None
    for batch in batches[: _STEPS.value]:
      params, opt, metrics = steps.train(params, opt, steps.put_batch(batch), keep_params=keep)
      if in_flight == 0:
        jax.block_until_ready(metrics["loss"])
      elif in_flight == 1 and previous is not None:
        jax.block_until_ready(previous)
      previous = metrics["loss"]
    jax.block_until_ready((params, previous))
    state["params"], state["opt"] = params, opt

  try:
    for r in range(_ROUNDS.value):
      folder = os.path.join(workdir, f"round_{r}")
      cluster = local_cluster.LocalCluster(workdir=folder, gin_args=gin_args, num_learners=1)
      try:
        t0 = time.perf_counter()
        port = cluster.start_syncer()
        _pin(cluster.syncer.proc.pid, _SYNCER_CPUS.value)
        t_syncer = time.perf_counter() - t0
        worker, summary, window = _run_worker(
          job, cluster, port, batches, os.path.join(folder, "learner_0")
        )
      finally:
        cluster.stop_all()  # The bare loops run without the syncer process.
      times["worker"].append(window["step_s"])
      cpu["worker"].append(window["proc_cpu"])
      windows.append(window)
      summaries.append(summary)
      if not state:  # The first worker's compiled step: the bare loops reuse its executable.
        steps = worker.learner.steps
        state["steps"] = steps
        state["params"] = jax.device_put(
          jax.device_get(worker.learner.params), steps.param_shardings
        )
        state["opt"] = steps.init_opt_state(state["params"])
        run_bare(1)  # Warm-up (batch placement, first dispatch).
        run_bare(1, keep=True)  # The worker compiled this variant on CPU; warm it up too.
      for name, (in_flight, keep) in _BARE.items():
        t0, c0 = time.perf_counter(), _cpu_s("/proc/self/stat")
        run_bare(in_flight, keep)
        times[name].append((time.perf_counter() - t0) / _STEPS.value)
        cpu[name].append((_cpu_s("/proc/self/stat") - c0) / _STEPS.value)
      print(
        f"round {r}: "
        + " ".join(f"{name} {1 / ts[-1]:.2f}" for name, ts in times.items())
        + f" steps/s; syncer up in {t_syncer:.1f} s; load {_load()}",
        flush=True,
      )
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(workdir, ignore_errors=True)

  rate = {name: 1.0 / statistics.median(ts) for name, ts in times.items()}
  print(
    f"\nmodel tiny, mesh {dict(state['steps'].mesh.shape)}, batch {_BATCH.value}x{_SEQ.value}, "
    f"codec {_CODEC.value}, snapshot {_SNAPSHOT.value}, P = H = 24, {_STEPS.value} timed steps (after {_SKIP.value}) x "
    f"{_ROUNDS.value} rounds (median)"
  )
  for name in times:
    print(
      f"  {name:10s} {rate[name]:8.2f} steps/s   CPU of this process "
      f"{1e3 * statistics.median(cpu[name]):6.1f} ms/step"
    )
  print(f"  worker/bare        = {rate['worker'] / rate['bare']:.3f}   (goal >= 0.95)")
  print(f"  worker/bare_async  = {rate['worker'] / rate['bare_async']:.3f}")
  print(f"  worker/bare_sync   = {rate['worker'] / rate['bare_sync']:.3f}")
  print(
    f"  bare_keep/bare     = {rate['bare_keep'] / rate['bare']:.3f}   (the cost of not donating)"
  )
  # Load-robust view: when the 2 cores are saturated, throughput goes as 1 / (CPU s per step).
  bare_cpu = statistics.median(cpu["bare"])
  worker_cpu = statistics.median(c + w["syncer_cpu"] for c, w in zip(cpu["worker"], windows))
  print(
    f"  CPU per step: bare {1e3 * bare_cpu:.1f} ms; worker (learner process + syncer) "
    f"{1e3 * worker_cpu:.1f} ms; bare/worker = {bare_cpu / worker_cpu:.3f} (the steps/s ratio "
    "on a saturated machine)"
  )
  print("  worker, timed window, per step:")
  for r, (w, s) in enumerate(zip(windows, summaries)):
    host = " ".join(f"{k.lstrip('_')} {1e3 * w.get(k, 0.0):.2f}" for k in _HOST_WORK)
    print(
      f"    round {r}: step {1e3 * w['step_s']:.1f} ms; sent {w.get('sent', 0.0):.2f} pushes "
      f"{w['pushes']:.2f} applies {w['applies']:.2f}; bytes up {w['bytes_up']:.0f} down "
      f"{w['bytes_down']:.0f}; training thread ms: {host}; CPU ms: learner process "
      f"{1e3 * w['proc_cpu']:.1f} (background threads {1e3 * w['threads_cpu']:.1f}), syncer "
      f"{1e3 * w['syncer_cpu']:.1f}"
    )
    print(
      f"      whole run: steps {s['steps']}, push {s['push_status']}, applies "
      f"{len(s['applies'])}, digest mismatches {s['digest_mismatches']}, rounds asked "
      f"{s['rounds_asked']}, syncer step clock {s['fleet_step']}"
    )
  print(f"load average at end: {_load()}")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
