"""Benchmark: a learner process syncing through the real (sharded) syncer against a bare training loop.

On a host with one GPU and 16 cores, the 2B model against S = 4 syncer shards (about 150 s):

  python scripts/bench_learner_overhead.py --size=2b --devices=0 --batch=8 --seq_len=1024 \
    --shards=4 --learner_cpus=0-5 --syncer_cpus=6-15 --syncer_blas_threads=1 \
    --skip=36 --steps=40 --rounds=1 --bare=bare,bare_async --deadline_s=150 \
    --json=$OUT/learner_sync_2b.json

(With the byte tokenizer of local_tiny.gin the "2b" shape has 2,115,053,568 parameters: 8.5 GB in
fp32, 17 GB of AdamW state; P = 24 fragments of 4 slices, 67-134 MB each.)

On 2 CPU cores, the tiny model on fake CPU devices (today's defaults; `--shards=2` for two shards):

  python scripts/bench_learner_overhead.py --devices=2 --batch=8 --seq_len=64 --steps=96 --rounds=3

Model and devices: gin_configs/local_tiny.gin with LEARNERS = 1 and P = H = 24, plus
gin_configs/models/<size>.gin for `--size` other than tiny (2b: bf16 compute, remat). `--devices=N`
gives this process N fake CPU devices (XLA_FLAGS, JAX_PLATFORMS=cpu); `--devices=0` leaves both
alone: the learner's mesh is every default device of the process (the GPU). `--dtype=auto`
computes in bfloat16 on an accelerator and keeps the model file's dtype on CPU. `--gin_bindings`
adds bindings for this process and the syncer (e.g. `transformer_config.remat = False`).

Each round starts a fresh syncer (`ddiloco.launch.syncer_main` via `LocalCluster`, CPU only), as
S = `--shards` shard processes when S > 1: `JobConfig.syncer_shards = S`, the framework's sharding,
which cuts every fragment into S byte-balanced slices (`FragmentSchedule.slices`, the sliced
layout; fragments/shards.py) so that every shard merges a slice of every round. The learner learns
the shards' addresses at Register and pushes and pulls each slice over its shard's bulk port
(`runtime.learner_client`). Shard i runs on its share of `--syncer_cpus` (split into S contiguous
groups, cycled when there are fewer CPUs than shards), this process on `--learner_cpus`; both
pinned with sched_setaffinity as `taskset` does. P = H = 24 (docs/algorithm.md §2: the syncer's
step clock makes exactly one fragment due every step and opens its round; the learner answers it
at its next step boundary), τ = 2. This process parses the same gin files and bindings, builds a
learner with `make_learner_worker` while the shards start, compiles its train step and, where
the devices encode δ (an accelerator), each fragment's encoding (24·S programs) ahead of their
first use, and trains it through `LearnerWorker.run` as the fleet's first and only learner, so the
syncer's step clock runs at this learner's own pace. (A fresh syncer per round, not one syncer
and a new learner id per round: every round then starts from the same state, every fragment at
version 0 and a step clock that starts with this learner.) The syncer is killed (its shutdown
would gather and evaluate the model) before the bare loops run on the worker's final parameters
and optimizer state (no other copy of them is made). `--bare` picks the loops, all by default:
  worker      the `LearnerWorker` loop. What compilation is left, the join and the start of the
              syncer's step clock (before which no round opens: it needs about a second of
              heartbeats to measure the learner's rate) are excluded by timing only the loop
              iterations after the first `--skip` ones: the batches it consumes come from an
              iterator that stamps every `next()` (one per iteration).
  bare        the worker's own `CompiledSteps.train` (same model, mesh, shardings, donation) on the
              same pre-drawn batches, waiting for step t−1's loss after dispatching step t: the
              worker keeps one step in flight, so this is its fair baseline.
  bare_async  the same, blocking only at the end (JAX's asynchronous dispatch runs ahead).
  bare_sync   the same, blocking on step t itself (nothing in flight). Diagnostic: on the CPU
              backend an on-device copy of the due fragment waited for step t to finish, so the
              worker's loop degenerated to this one (measured; see docs/results.md); on CPU
              the worker now snapshots by reference (`Learner.snapshot_by_reference`).
  bare_keep   `bare` with the step variant that does not donate the parameters, which the worker
              runs after a snapshot by reference (CPU) or an apply whose digest is read back later.
              It compiles that variant where the worker did not (an accelerator).
`--deadline_s` bounds the wall time from the start: a round that would not fit is not started,
and the bare loops after `bare` are left out (`bare` itself timed over fewer steps, at least 8)
when the time left would not hold them. Progress lines go out as the run goes, and `--json` is
rewritten after every round and at the end (`"partial": true` until then), so a killed run still
leaves its figures.

It prints steps/s and this process's CPU time per step of each loop, worker/bare (goal >= 0.95
on CPU, 0.9 on an accelerator), the other ratios, and CPU per step of bare against worker + syncer
(a load-robust estimate of the ratio when the cores are saturated). For the worker's timed window,
per step: rounds answered (fragments sent), pushes answered and applies (S each, one per slice,
when the syncer opens one round a step and every round merges), wire bytes, the training thread's time in the worker's own host work
(`send_due`: snapshot; `drain`: push results, received fragments, round requests; `apply`: apply +
digest read-back), and the CPU time of the learner process, of its background threads (senders,
comm, rounds, pullers) and of each syncer shard. The whole run's line adds the rounds the syncer
asked for and its step clock as the learner last heard it. And the load average: the machine may
be shared, and then wall-clock rates move between rounds; CPU times move much less.

What the worker's "overhead" includes, all of it real: per step, the snapshot of the fragment
whose round it answers (by reference on CPU; on an accelerator an on-device copy, δ = Θ^(anchor) −
θ encoded on the device and its payload's host transfer, `DeviceParams.snapshot`); in the sender
threads, the wait for that copy, the delta and int4 encoding where the host encodes, and the push of
each slice to its shard; in the comm thread, heartbeats (every 0.25 s: the learner's step, from
which the syncer's step clock takes its pace); in the rounds thread, the `Rounds` streams of round
requests and version announcements; in the pullers (one per shard), the pull and decoding of every
announced version; on the training thread, draining push results, feeding received fragments and
round requests to the learner, applying fragments τ = 2 steps after answering their round (a
`device_put` per fragment) with a digest read back from the devices (docs/algorithm.md §4.7), and
every `RunConfig.log_every` steps a loss read (it blocks on the current step) and a metrics line.
The background threads hold the GIL for their Python work and compete for this process's cores
with XLA's threads. The syncer's periodic evaluation is off (`RunConfig.eval_every_s = 0`): it is
not learner overhead. `--syncer_blas_threads=1` runs the syncer with OPENBLAS_NUM_THREADS=1: by
default its OpenBLAS worker threads spin after every small BLAS call (the norms of RDA) and take
most of its CPU time.
"""

import collections
import concurrent.futures
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import bench_learner_overhead_report as report
import numpy as np
from absl import app, flags

_SIZES = ("tiny", "small", "2b", "5b", "9b", "tiny_moe", "small_moe", "5b_moe")
_CODECS = ("fp32", "bf16", "int8", "int4")
# Loop name -> (steps left in flight, whether the step keeps its input parameters).
_BARE = {
  "bare": (1, False),
  "bare_async": (None, False),
  "bare_sync": (0, False),
  "bare_keep": (1, True),
}

_SIZE = flags.DEFINE_enum("size", "tiny", _SIZES, "model size (gin_configs/models/<size>.gin)")
_DEVICES = flags.DEFINE_integer(
  "devices", 2, "fake CPU devices of the learner's mesh; 0: the process's default devices (GPU)"
)
_DTYPE = flags.DEFINE_enum(
  "dtype",
  "auto",
  ["auto", "float32", "bfloat16"],
  "compute dtype; auto: bfloat16 on an accelerator, the model file's on CPU",
)
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step")
_SEQ = flags.DEFINE_integer("seq_len", 64, "tokens per sequence")
_STEPS = flags.DEFINE_integer("steps", 96, "timed steps per loop per round")
_SKIP = flags.DEFINE_integer(
  "skip",
  40,
  "first worker steps left out: compilation, the join and the start of the syncer's step clock",
)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "rounds (median reported)")
_SHARDS = flags.DEFINE_integer("shards", 1, "syncer shard processes (JobConfig.syncer_shards)")
_CODEC = flags.DEFINE_enum("codec", "int4", _CODECS, "uplink codec, and downlink's by default")
_DOWNLINK = flags.DEFINE_enum("downlink", None, _CODECS, "downlink codec (default: --codec)")
_DEVICE_ENCODE = flags.DEFINE_enum(
  "device_encode",
  "auto",
  ["auto", "always", "never"],
  "LearnerConfig.device_encode; auto: on an accelerator",
)
_BARE_LOOPS = flags.DEFINE_list("bare", list(_BARE), f"bare loops, `bare` first; of {list(_BARE)}")
_SYNCER_BLAS = flags.DEFINE_integer(
  "syncer_blas_threads",
  0,
  "OPENBLAS_NUM_THREADS for the syncer process (0: inherit the environment); see the docstring",
)
_LEARNER_CPUS = flags.DEFINE_list(
  "learner_cpus",
  [],
  "CPUs for this process (the learner and the bare loops), e.g. 0 or 0-3; empty: no pinning",
)
_SYNCER_CPUS = flags.DEFINE_list(
  "syncer_cpus",
  [],
  "CPUs for the syncer, e.g. 1 or 4-15, split over its shards; empty: no pinning",
)
_SNAPSHOT = flags.DEFINE_enum(
  "snapshot",
  "auto",
  ["auto", "reference", "copy"],
  "how the worker snapshots a due fragment (Learner.snapshot_by_reference); auto: by reference "
  "on CPU, the on-device copy of GPU/TPU otherwise",
)
_BINDINGS = flags.DEFINE_multi_string(
  "gin_bindings", [], "more bindings for this process and the syncer"
)
_DEADLINE = flags.DEFINE_float("deadline_s", 0.0, "wall-time budget from the start (0: none)")
_JSON = flags.DEFINE_string("json", None, "write every figure, the machine and the commit here")
_WORKDIR = flags.DEFINE_string("workdir", None, "output folder (default: a temporary one, removed)")

_ALL_FLAGS = (
  *(_SIZE, _DEVICES, _DTYPE, _BATCH, _SEQ, _STEPS, _SKIP, _ROUNDS, _SHARDS, _CODEC, _DOWNLINK),
  *(_DEVICE_ENCODE, _BARE_LOOPS, _SYNCER_BLAS, _LEARNER_CPUS, _SYNCER_CPUS, _SNAPSHOT, _BINDINGS),
  *(_DEADLINE, _JSON, _WORKDIR),
)

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_GIN_DIR = os.path.join(_ROOT, "gin_configs")
_GIN_FILE = os.path.join(_GIN_DIR, "local_tiny.gin")
_TICK = os.sysconf("SC_CLK_TCK")
# Methods of the training loop (worker.loop): the step boundary (its own drain included, then
# `step_boundary`'s applies and answers) and the drain the loop makes before it.
_HOST_WORK = ("drain", "_boundary")
_WARMUP_STEPS = 2  # Of each bare variant before it is timed (batch placement, first dispatch).
_MIN_BARE_STEPS = 8  # `bare` is timed over no fewer steps, whatever the deadline.


def _gin_files() -> list[str]:
  extra = [] if _SIZE.value == "tiny" else [os.path.join(_GIN_DIR, "models", f"{_SIZE.value}.gin")]
  return [_GIN_FILE, *extra]


def _bindings(accelerator: bool) -> list[str]:
  """Bindings shared by this process and the syncer, so all agree on the layout digest."""
  dtype = _DTYPE.value
  if dtype == "auto":
    dtype = "bfloat16" if accelerator else None
  return [
    "LEARNERS = 1",
    f"STEPS = {_STEPS.value + _SKIP.value}",
    # Past the warm-up (run_base.gin: 20 steps) however few steps run; the rate does not matter.
    f"InnerOptConfig.decay_steps = {max(_STEPS.value + _SKIP.value, 100)}",
    f"BATCH = {_BATCH.value}",
    f"SEQ_LEN = {_SEQ.value}",
    f"transformer_config.max_len = {_SEQ.value}",
    *([f'transformer_config.dtype = "{dtype}"'] if dtype else []),
    f'UPLINK = "{_CODEC.value}"',
    f'DOWNLINK = "{_DOWNLINK.value or _CODEC.value}"',
    f'LearnerConfig.device_encode = "{_DEVICE_ENCODE.value}"',
    f"JobConfig.syncer_shards = {_SHARDS.value}",
    # docs/algorithm.md §2 with P = H: the syncer opens fragment p's round at clock steps t ≡ p (mod 24).
    "FragmentSchedule.num_fragments = 24",
    "FragmentSchedule.period = 24",
    "RunConfig.eval_every_s = 0.0",
    "RunConfig.eval_batches = 2",
    *_BINDINGS.value,
  ]


def _load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _cpus(specs: list[str]) -> list[int]:
  """The CPUs of taskset-style list entries ("3", "4-7")."""
  out = []
  for spec in specs:
    lo, _, hi = spec.partition("-")
    out.extend(range(int(lo), int(hi or lo) + 1))
  return out


def shard_cpus(specs: list[str], shards: int) -> list[list[int]]:
  """Each shard's CPUs: `specs`' CPUs split into `shards` contiguous groups (the first ones one
  larger when they do not divide), cycled when there are fewer CPUs than shards; [] unpinned."""
  cpus = _cpus(specs)
  if not cpus:
    return [[] for _ in range(shards)]
  if len(cpus) < shards:
    return [[cpus[i % len(cpus)]] for i in range(shards)]
  size, extra = divmod(len(cpus), shards)
  starts = [i * size + min(i, extra) for i in range(shards + 1)]
  return [cpus[starts[i] : starts[i + 1]] for i in range(shards)]


def _pin(pid: int, cpus: list[int]) -> None:
  """Moves every thread of process `pid` onto `cpus` (threads it starts later inherit the mask)."""
  if not cpus:
    return
  for tid in os.listdir(f"/proc/{pid}/task"):
    with contextlib.suppress(ProcessLookupError):  # The thread ended meanwhile.
      os.sched_setaffinity(int(tid), set(cpus))


def _cpu_s(stat_path: str) -> float:
  """utime + stime of a process or thread from /proc (0 if it is gone)."""
  try:
    with open(stat_path) as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except FileNotFoundError:
    return 0.0
  return (int(fields[11]) + int(fields[12])) / _TICK  # Fields 14 and 15 of proc(5).


class _Progress:
  """Prints flushed progress lines stamped with the seconds since the start; keeps the deadline."""

  def __init__(self, deadline_s: float):
    self.t0 = time.perf_counter()
    self.deadline_s = deadline_s

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def left(self) -> float:
    """Seconds left before the deadline (infinite without one)."""
    return self.deadline_s - self.elapsed() if self.deadline_s > 0 else float("inf")

  def __call__(self, message: str) -> None:
    print(f"[{self.elapsed():7.1f} s] {message}", flush=True)


class _Stamped:
  """Yields the batches in a cycle, stamping the time at every `next()`.

  `probe()` is recorded only at the calls numbered in `probe_at`: it reads /proc files.
  """

  def __init__(
    self, batches: list[dict[str, np.ndarray]], probe_at: tuple[int, ...], progress: _Progress
  ):
    self._batches = batches
    self._probe_at = probe_at
    self._progress = progress
    self._every = max(8, (probe_at[-1] + 1) // 8)
    self.stamps: list[float] = []
    self.probes: dict[int, dict[str, float]] = {}
    self.probe: Callable[[], dict[str, float]] = dict

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    i = len(self.stamps)
    if i in self._probe_at:
      self.probes[i] = self.probe()
    if i in (1, self._probe_at[0]) or i % self._every == 0:
      self._progress(f"worker iteration {i}" + (" (timed from here)" * (i == self._probe_at[0])))
    self.stamps.append(time.perf_counter())
    return self._batches[i % len(self._batches)]


def _instrument(worker, stamped: _Stamped, syncer_pids: list[int]) -> None:
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
    shards = {f"syncer_cpu_{i}": _cpu_s(f"/proc/{pid}/stat") for i, pid in enumerate(syncer_pids)}
    return {
      **acc,
      "pushes": sum(worker.loop.push_status.values()),
      "applies": len(worker.loop.applies),
      "threads_cpu": threads,
      "syncer_cpu": sum(shards.values()),
      **shards,
      "proc_cpu": _cpu_s("/proc/self/stat"),
      "bytes_up": worker.link.client.bytes_up,
      "bytes_down": worker.link.client.bytes_down,
    }

  stamped.probe = probe


def _spawn_syncer(cluster, cpus: list[list[int]]) -> str:
  """Starts the syncer's S shards (or the one syncer) without waiting, each pinned to its CPUs;
  returns the address learners dial (shard 0's)."""
  from ddiloco.launch import processes

  shards = len(cpus)
  if shards > 1:
    cluster.syncer_host, cluster.shard_ports = cluster.backend.syncer_shards(
      cluster.syncer_host, [], shards
    )
    for shard in range(shards):
      cluster.spawn_syncer(shard=shard)
    port = cluster.shard_ports[0]
  else:
    port = processes.free_port()  # Chosen here, so that the learner is built meanwhile.
    cluster.spawn_syncer(port=port)
  for shard, shard_cpus_ in enumerate(cpus):
    _pin(cluster.syncer_child(shard).proc.pid, shard_cpus_)
  return f"{cluster.syncer_host}:{port}"


def _precompile(learner, batch: dict[str, np.ndarray]) -> None:
  """Compiles the learner's train step now, while the syncer starts: the worker's first step then
  finds it in jax's caches. The variant its first step runs: on CPU (snapshots by reference) the
  one that keeps its input parameters (learner/device.py `before_step`)."""
  from ddiloco.parallel import partitioning

  steps = learner.steps
  step = steps._train_keep if learner.device.by_reference else steps._train
  with partitioning.partitioning_context(steps.mesh, steps.rules):
    step.lower(learner.params, learner.opt_state, steps.put_batch(batch)).compile()


def _warm_encodings(learner, codec: str, block_size: int) -> int:
  """Compiles every fragment's δ encoding program (fragments/device_codec.py: one per fragment)
  now, while the syncer starts, rather than in the senders over the first period; returns how many
  (0 where the host encodes). Each encodes θ_p against a host copy of itself, as an answer would."""
  device = learner.device
  if not device.device_encode:
    return 0

  def warm(p: int) -> None:
    snapshot = device.snapshot(p)
    snapshot.encode_delta(codec, snapshot(), block_size)  # δ = 0: no valid encoding, compiled.

  workers = min(8, len(os.sched_getaffinity(0)))
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    list(pool.map(warm, range(learner.layout.num_fragments)))
  return learner.layout.num_fragments


def _run_worker(job, cluster, cpus, batches, learner_dir: str, *, progress: _Progress):
  """One worker's run; returns (the worker, its summary, the timed window's per-step figures,
  phase times)."""
  from ddiloco.launch import runtime

  phases = {}
  t0 = time.perf_counter()
  address = _spawn_syncer(cluster, cpus)
  progress(f"syncer: {len(cpus)} process(es) spawned on CPUs {cpus}")
  client = runtime.learner_client(job, address, token=cluster.token)
  # Both loops consume the same pre-drawn batches (grain's prefetch threads would load the worker
  # only). Iterations skip .. last-1 are timed: each dispatches a step, waits for the previous one
  # and does all of the worker's per-step host work.
  a, b = _SKIP.value, _SKIP.value + _STEPS.value - 1
  stamped = _Stamped(batches, probe_at=(a, b), progress=progress)
  worker, writer = runtime.make_learner_worker(
    job, learner_id=0, client=client, workdir=learner_dir, data=stamped
  )
  if _SNAPSHOT.value != "auto":
    worker.learner.device.snapshot_by_reference = _SNAPSHOT.value == "reference"
  phases["learner_built_s"] = time.perf_counter() - t0
  progress("learner built")
  _precompile(worker.learner, batches[0])
  phases["step_compiled_s"] = time.perf_counter() - t0
  progress("train step compiled")
  service = job.run.the_service()
  warmed = _warm_encodings(worker.learner, service.uplink_codec, service.block_size)
  phases["encodings_compiled_s"] = time.perf_counter() - t0
  progress(f"δ encodings compiled: {warmed} fragments")
  for shard in range(len(cpus)):
    cluster.wait_syncer(shard=shard)
  phases["syncer_up_s"] = time.perf_counter() - t0
  progress("syncer serving")
  _instrument(worker, stamped, [c.proc.pid for c in cluster.syncers()])
  worker.connect()
  phases["connected_s"] = time.perf_counter() - t0
  progress("connected: the global model loaded")
  summary = worker.run(_STEPS.value + _SKIP.value)
  phases["worker_done_s"] = time.perf_counter() - t0
  writer.close()
  client.close()
  if len(stamped.stamps) != b + 1:
    raise RuntimeError(f"The worker ran {len(stamped.stamps)} iterations, expected {b + 1}.")
  n = b - a
  first, last = stamped.probes[a], stamped.probes[b]
  window = {k: (last.get(k, 0.0) - first.get(k, 0.0)) / n for k in last}
  window["step_s"] = (stamped.stamps[b] - stamped.stamps[a]) / n
  return worker, summary, window, phases


def _run_bare(state: dict, batches, n: int, in_flight: int | None, keep: bool = False) -> None:
  """`n` steps of the bare loop on `state`'s parameters; `in_flight` steps may be pending when the
  next is dispatched (None: block at the end); `keep`: the step that does not donate the
  parameters (`CompiledSteps.train(keep_params=True)`)."""
  import jax

  steps = state["steps"]
  params, opt, previous = state["params"], state["opt"], None
  for batch in batches[:n]:
    params, opt, metrics = steps.train(params, opt, steps.put_batch(batch), keep_params=keep)
    if in_flight == 0:
      jax.block_until_ready(metrics["loss"])
    elif in_flight == 1 and previous is not None:
      jax.block_until_ready(previous)
    previous = metrics["loss"]
  jax.block_until_ready((params, previous))
  state["params"], state["opt"] = params, opt


def _bare_loops(state, batches, res: report.Results, progress: _Progress, est_step_s: float):
  """One round of the bare loops `--bare` names, within the deadline (module docstring)."""
  for name in _BARE_LOOPS.value:
    in_flight, keep = _BARE[name]
    warm = 0 if keep in state["warmed"] else _WARMUP_STEPS
    if res.times["bare"]:
      est_step_s = statistics.median(res.times["bare"])
    n, left = _STEPS.value, progress.left()
    fit = n if left == float("inf") else int(left / est_step_s) - warm
    if fit < n:
      if name != "bare":
        res.skipped.append(name)
        progress(f"{name} left out: {progress.left():.0f} s left, {n} steps need more")
        continue
      n = max(_MIN_BARE_STEPS, fit)
    if warm:
      _run_bare(state, batches, warm, 1, keep)
      state["warmed"].add(keep)
    t0, c0 = time.perf_counter(), _cpu_s("/proc/self/stat")
    _run_bare(state, batches, n, in_flight, keep)
    res.times[name].append((time.perf_counter() - t0) / n)
    res.cpu[name].append((_cpu_s("/proc/self/stat") - c0) / n)
    res.bare_steps[name] = n
    progress(f"{name}: {1 / res.times[name][-1]:.3f} steps/s over {n} steps")


def _check_flags() -> None:
  if _STEPS.value < 2 or _SKIP.value < 0 or _ROUNDS.value < 1 or _DEVICES.value < 0:
    raise app.UsageError("Need --steps >= 2, --skip >= 0, --rounds >= 1 and --devices >= 0.")
  loops = _BARE_LOOPS.value
  if (
    not loops or loops[0] != "bare" or not set(loops) <= set(_BARE) or len(set(loops)) < len(loops)
  ):
    raise app.UsageError(f"--bare: `bare` first, then any of {list(_BARE)} once each.")
  if _SHARDS.value < 1 or _SHARDS.value > 24:
    raise app.UsageError("--shards: 1 to 24 (P = 24 fragments, each cut into S slices).")
  try:
    _cpus(_LEARNER_CPUS.value + _SYNCER_CPUS.value)
  except ValueError as e:
    raise app.UsageError(f"--learner_cpus/--syncer_cpus take numbers and ranges a-b: {e}") from e


def main(argv: list[str]) -> None:
  del argv
  _check_flags()
  progress = _Progress(_DEADLINE.value)
  # LocalCluster's preexec_fn makes one libc call between fork and exec (local_cluster.py), which is
  # what Python's warning about forking a multithreaded (JAX) process is about.
  warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
  # Before jax is imported (the ddiloco imports below import it): the learner's mesh is every
  # local device, as in a learner process; fake CPU devices unless --devices=0.
  if _DEVICES.value > 0:
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device" not in f]
    xla.append(f"--xla_force_host_platform_device_count={_DEVICES.value}")
    os.environ["XLA_FLAGS"] = " ".join(xla)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Before jax starts its thread pools (they are sized by the CPUs this process may use).
  _pin(os.getpid(), _cpus(_LEARNER_CPUS.value))
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

  accelerator = jax.default_backend() != "cpu"
  cpus = shard_cpus(_SYNCER_CPUS.value, _SHARDS.value)
  progress(
    f"load average {_load()}; devices {jax.devices()}; this process on CPUs "
    f"{sorted(os.sched_getaffinity(0))}, syncer shards on {cpus if _SYNCER_CPUS.value else 'any'}"
  )
  files, bindings = _gin_files(), _bindings(accelerator)
  configurables.parse(files, bindings, search_paths=[_GIN_DIR])
  job = configurables.configured(JobConfig)()
  gin_args = [f"--gin_file={f}" for f in files] + [f"--gin_search_paths={_GIN_DIR}"]
  gin_args += [f"--gin_bindings={b}" for b in bindings]
  it = text_data.make_train_iterator(
    job.run.data, shard_index=0, num_shards=1, batch_size=job.run.batch_size
  )
  batches = [next(it) for _ in range(_STEPS.value + _SKIP.value)]
  res = report.Results(loops=["worker", *_BARE_LOOPS.value])
  res.config = {
    **{f.name: f.value for f in _ALL_FLAGS},
    "gin_files": files,
    "bindings": bindings,
    "accelerator": accelerator,
    "shard_cpus": cpus,
  }
  state: dict[str, Any] = {}

  def save(partial: bool) -> None:
    if _JSON.value:
      report.write_json(_JSON.value, res, root=_ROOT, partial=partial, elapsed_s=progress.elapsed())

  try:
    for r in range(_ROUNDS.value):
      if r > 0 and progress.left() < res.round_s[0]:
        progress(
          f"round {r} left out: {progress.left():.0f} s left, a round took {res.round_s[0]:.0f} s"
        )
        break
      t_round = time.perf_counter()
      folder = os.path.join(workdir, f"round_{r}")
      cluster = local_cluster.LocalCluster(workdir=folder, gin_args=gin_args, num_learners=1)
      try:
        worker, summary, window, phases = _run_worker(
          job, cluster, cpus, batches, os.path.join(folder, "learner_0"), progress=progress
        )
      finally:
        # Killed, not stopped: a shard's shutdown gathers the model and evaluates it (runtime.py).
        cluster.stop_all(grace_s=0.0)
      progress(f"worker: {1 / window['step_s']:.3f} steps/s; syncer stopped")
      res.model = res.model or report.model_figures(worker.learner, _SIZE.value)
      res.add_worker(window, summary, phases)
      save(partial=True)  # The worker's figures survive a run killed in the bare loops.
      if not state:  # The first worker's compiled step and final state: the bare loops' own.
        state.update(
          steps=worker.learner.steps,
          params=worker.learner.params,
          opt=worker.learner.opt_state,
          warmed=set(),
        )
      del worker  # Its parameters and optimizer state on the devices: no other copy stays.
      gc.collect()
      _bare_loops(state, batches, res, progress, window["step_s"])
      res.round_s.append(time.perf_counter() - t_round)
      res.loads.append(_load())
      print(f"round {r}: " + res.round_line() + f"; load {_load()}", flush=True)
      save(partial=True)
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(workdir, ignore_errors=True)
  report.print_report(res)
  print(f"load average at end: {_load()}")
  save(partial=False)
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
