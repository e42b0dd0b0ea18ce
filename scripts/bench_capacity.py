r"""Capacity: how much push ingest S syncer shards sustain from a synthetic fleet of M learners.

  python scripts/bench_capacity.py --shards=1,2 --learners=8 --fragments=8 --fragment_mib=16 \
      --ramp_gbps=0.05,0.075,0.1,0.125,0.15,0.175,0.2,0.25,0.3 --shard_cpus=0,1 [--sweep]
  python scripts/bench_capacity.py --analyze=capacity.json    # the summary of a saved --json

The fleet (scripts/bench_capacity_fleet.py) is fake and cheap: `--fleet_procs` processes holding
the M learners. Each registers with every shard, pulls each fragment once, holds a Rounds stream
per shard and answers every round with a pre-encoded δ push (only the first chunk, the header, is
made per push), over the shard's bulk port as learners push. A push refused for a
transient reason (RESOURCE_EXHAUSTED, UNAVAILABLE...) is retried with backoff, as a learner's
sender does: with quorum M a round waits for every answer, and one answer given up left its
fragment's round open for the rest of the run, every later round of it skipped. Heartbeats report
steps at `step_s`, so the syncer's step clock (its default `fleet_rate` clock) opens P/H rounds
per step fleet-wide whatever the answers do. Learners do not pull merged versions: this measures
ingest (egress is scripts/bench_wire.py's pull figure).

Shard i is a syncer shard as `ddiloco-syncer --shard=i` builds it (`make_syncer` with
`shard`/`shard_addresses` + `serve`, warmed up as `SyncerRun.warm_up` does, its start-up heap
frozen out of the GC as ddiloco-syncer's is; `--nogc_freeze` leaves it in): its core owns the
fragments p with p mod S == i of the whole layout of P fragments of `--fragment_mib` (float32),
holds values only for those, and opens their rounds on the run's schedule (P, H, τ), so its rounds
come at 1/S of the fleet's rate. It merges with quorum M (every learner's answer) by the default
rule (`SyncerConfig.merge_rule`), with bf16 downlink adoption.

`--slices` cuts each of the P fragments into S slices instead, as ddiloco-syncer's shards do
(`FragmentSchedule.slices`; `--fragment_mib` is then a group's size): every shard opens a round
for its slice of each step's group, so a round's work is split S ways.

Load: the offered ingest is M · (fragment's wire bytes) · (P/H) / step_s over all shards. The ramp
offers each `--ramp_gbps` to every shard count in turn (S = 1 then S = 2 at each level, so the
machine's noise hits them alike; with `--ramp_per_shard` S shards are offered S times the level); a
shard count stops after its first level not kept up with, and with `--deadline_s` a point that would
end past the deadline is skipped (its cost beyond the load is the last point's of that S). Each
level runs `--windows` windows of `--window_s` one after the other after `--warmup_s`. A shard keeps
up in a window when it opened `--keep_up` of the rounds its schedule has (a late step clock skips a
round whose previous one is still open), merged `--keep_up` of the answers to those (one round of
lag allowed), and its p99 round latency (open → published, on its own clock) is within the grace
budget τ · step_s; a level is kept up with when most of its windows were, and its figures are the
medians over its windows (the spread over windows is printed beside them: the noise). Sustained
ingest is the highest merged ingest of a level kept up with; it prints "ingest(S)/ingest(S=1)" from
those. Per level and shard: merged GB/s, rounds opened/scheduled, p50/p99 open → published and p99
quorum → published (the merge) latency, the shard's CPU (cores) and RSS, the fleet's push answers
(and how many needed a retry) and its CPU.

Placement: shard i runs under `taskset -c <--shard_cpus[i]>`, the fleet under `--fleet_cpus`
(default unpinned: S = 1 and S = 2 see the same machine, the fleet where the scheduler puts it).
On a 2-core machine the fleet shares the shards' cores, so the summary fits
each side's CPU (a fixed part plus CPU-seconds per GB, scripts/bench_capacity_summary.py) and
prints the ingest CPU alone would allow. `--sweep` ramps S = 1 at `--sweep_learners` and at
`--sweep_mib` fragment sizes, and fits RSS per parameter held. `--json` writes every figure with
the date, the commit and the machine, again after every point ("complete": false until the run
ends: a run killed by `timeout` leaves the points it finished for `--analyze`; its SIGTERM stops
the children).
`--jax_cache` lets the shards share compiled merges through a JAX compilation cache (start-up only).
scripts/device_capacity.sh is the S = 1, 2, 4, 8 run for a 16-core host in a ~100 s budget.
`--fleet_send=sendfile` has the fake learners send a push's frames after the first from an
in-memory file with sendfile (the same bytes; ~30 % less of the fleet's CPU per push on this
machine), so that less of what a fleet on other hosts would spend lands on the shards' cores.
`--fleet_priority=idle` runs the fleet under SCHED_IDLE with its scheduler group's weight at its
lowest, so that it takes only the CPU the shards leave (a round's work is never preempted by it).
`--timeline` logs each round's phases in the shards (scripts/bench_capacity_timeline.py: round
opened, requests received by the fleet, pushes connected, answers decoded and filed, the merge's
step, adoption and digest, publication; the shard's CPU over the round) and prints their
medians and p90 per shard under each level.
"""

import ctypes
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import bench_capacity_fleet  # Beside this script: its folder is first on sys.path when it runs.
import bench_capacity_timeline as timeline
import bench_learner_overhead_report
import numpy as np
from absl import app, flags, logging
from bench_capacity_summary import (
  clock_lag,
  medians,
  print_level,
  run_figures,
  shard_figures,
  statuses,
  summarize,
)

from ddiloco.launch import processes

_ROLE = flags.DEFINE_enum("role", "main", ["main", "shard", "fleet"], "internal: process role")
_SHARDS = flags.DEFINE_list("shards", ["1", "2"], "shard counts S compared side by side")
_LEARNERS = flags.DEFINE_integer("learners", 8, "M, fake learners")
_FRAGMENTS = flags.DEFINE_integer("fragments", 24, "P, fragments over all shards (H = P)")
_OVERLAP = flags.DEFINE_integer("overlap", 2, "τ: the grace budget is τ · step_s")
_FRAGMENT_MIB = flags.DEFINE_float("fragment_mib", 4.0, "one fragment's float32 size, MiB")
_CODEC = flags.DEFINE_string("codec", "bf16", "uplink codec of the pushes")
_DOWNLINK = flags.DEFINE_string("downlink", "bf16", "the syncer's downlink codec (adoption)")
_RAMP = flags.DEFINE_list("ramp_gbps", ["0.05", "0.1", "0.15", "0.2", "0.3"], "offered GB/s")
_WINDOW = flags.DEFINE_float("window_s", 8.0, "seconds of one measured window")
_WINDOWS = flags.DEFINE_integer(
  "windows", 3, "windows per level, one after the other; figures are their medians"
)
_WARMUP = flags.DEFINE_float("warmup_s", 3.0, "seconds of load before the window")
_KEEP_UP = flags.DEFINE_float("keep_up", 0.9, "merged/asked answers a level must reach")
_FLEET_PROCS = flags.DEFINE_integer("fleet_procs", 2, "processes the fake learners run in")
_SHARD_CPUS = flags.DEFINE_list("shard_cpus", [], "taskset CPU list per shard (cycled)")
_FLEET_CPUS = flags.DEFINE_string("fleet_cpus", "", "taskset CPU list of the fleet")
_GC_FREEZE = flags.DEFINE_bool(
  "gc_freeze", True, "shards freeze their start-up heap out of the GC, as SyncerRun.serve does"
)
_TIMELINE = flags.DEFINE_bool(
  "timeline",
  False,
  "log each round's phases in the shards and print them (bench_capacity_timeline)",
)
_FLEET_SEND = flags.DEFINE_enum(
  "fleet_send",
  "sendmsg",
  ["sendmsg", "sendfile"],
  "how the fake learners send a bulk push's frames: one gathered sendmsg (the kernel copies each "
  "byte), or sendfile from an in-memory file (the kernel lends its pages)",
)
_FLEET_PRIORITY = flags.DEFINE_enum(
  "fleet_priority",
  "normal",
  ["normal", "idle"],
  "the fake learners' CPU priority: normal, or idle (SCHED_IDLE and the lowest group weight: they "
  "run only on what the shards leave of the cores, as learners on other hosts would)",
)
_SWEEP = flags.DEFINE_bool("sweep", False, "also ramp S = 1 over M and fragment sizes")
_SWEEP_MIB = flags.DEFINE_list("sweep_mib", ["1", "16"], "fragment sizes of the sweep, MiB")
_SWEEP_M = flags.DEFINE_list("sweep_learners", ["2", "4"], "learner counts of the sweep")
_JSON = flags.DEFINE_string("json", "", "write every figure here (again after every point)")
_SLICES = flags.DEFINE_bool(
  "slices",
  False,
  "cut each fragment into S slices, one per shard, as ddiloco-syncer's shards do (every shard "
  "takes a slice of every round); off: each fragment's round goes whole to one shard",
)
_RAMP_PER_SHARD = flags.DEFINE_bool(
  "ramp_per_shard", False, "--ramp_gbps is per shard: S shards are offered S times each level"
)
_JAX_CACHE = flags.DEFINE_bool(
  "jax_cache",
  False,
  "shards keep their compiled merges in a JAX compilation cache shared by the run's points: a "
  "point after the first of its sizes starts ~1 CPU-s sooner (the merges run the same)",
)
_DEADLINE = flags.DEFINE_float(
  "deadline_s", 0.0, "skip the points that would end later than this after the start (0: none)"
)
_ANALYZE = flags.DEFINE_string("analyze", "", "print the summary of a --json file; run nothing")
# Internal (shard and fleet roles).
_SPEC = flags.DEFINE_string("spec", "", "internal: JSON of the point")
_INDEX = flags.DEFINE_integer("index", 0, "internal: shard or fleet process index")
_OUT = flags.DEFINE_string("out", "", "internal: where a child writes its results")

_TOKEN = bench_capacity_fleet.TOKEN
_TIMEOUT_S = bench_capacity_fleet.TIMEOUT_S  # Longest wait for a child to start or finish.


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured configuration: S shards, M learners, fragments, the offered load.

  With `slices` = S, each of the P `fragments` (groups) is cut into S slices of `fragment_params`,
  fragment g·S + s being slice s of group g (`FragmentSchedule.slices`), so each shard takes a
  slice of every round; with 1 each fragment's round goes whole to the shard that owns it.
  """

  shards: int
  learners: int
  fragments: int
  fragment_params: int  # One (sliced) fragment's.
  step_s: float
  overlap: int
  codec: str
  downlink: str
  t0: float = 0.0  # time.monotonic() at which the fleet's step 0 starts (shared clock).
  warmup_s: float = 3.0
  window_s: float = 8.0
  windows: int = 1  # Measured windows of window_s, one after the other (`measure`).
  addresses: tuple[str, ...] = ()
  slices: int = 1  # 1 or `shards`.

  @property
  def total_fragments(self) -> int:
    """The layout's fragment ids' count, P · slices."""
    return self.fragments * self.slices

  @property
  def digest(self) -> str:
    return f"capacity-{self.fragments}x{self.slices}x{self.fragment_params}"

  def owned(self, shard: int) -> frozenset[int]:
    """The fragments shard `shard` owns (p mod S == shard)."""
    from ddiloco.fragments import shards

    return shards.owned(shard, self.shards, self.total_fragments)


def wire_bytes(params: int, codec: str) -> int:
  """Bytes one pushed fragment of `params` values puts on the wire (payload, headers included)."""
  from ddiloco.transport.fragment_encoder import FragmentEncoder

  return FragmentEncoder({"f0": np.zeros(params, np.float32)}, codec).nbytes


# ---- shard process -------------------------------------------------------------------------


def _shard_main(pt: Point, out: str) -> None:
  """Syncer shard `--index` of `pt.shards`; writes its merge log on SIGTERM."""
  from ddiloco.fragments.schedule import FragmentSchedule
  from ddiloco.service.server import make_syncer, serve
  from ddiloco.service.service_config import ServiceConfig
  from ddiloco.syncer.core import SyncerConfig
  from ddiloco.transport import messages

  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  if _TIMELINE.value:
    timeline.install()
  rng = np.random.default_rng(_INDEX.value)
  owned = sorted(pt.owned(_INDEX.value))
  init = {f"f{k}": rng.standard_normal(pt.fragment_params, np.float32) for k in owned}
  svc = make_syncer(
    fragment_keys=[[f"f{k}"] for k in range(pt.total_fragments)],
    init_values=init,
    syncer_config=SyncerConfig(min_quorum=pt.learners, grace_max_s=pt.overlap * pt.step_s),
    service_config=ServiceConfig(uplink_codec=pt.codec, downlink_codec=pt.downlink),
    layout_digest=pt.digest,
    schedule=FragmentSchedule(
      num_fragments=pt.fragments, period=pt.fragments, overlap=pt.overlap, slices=pt.slices
    ),
    shard=_INDEX.value,
    shard_addresses=pt.addresses if pt.shards > 1 else (),
  )
  del init  # The core keeps its own copy: RSS is the shard's alone.
  for p in owned:  # As SyncerRun.warm_up: no merge compiles under the lock.
    svc.core.warm_up(p, pt.learners, sent_as=messages.kept_dtype(pt.codec))
  if _GC_FREEZE.value:  # As ddiloco-syncer does once serving (launch/syncer_main.py).
    gc.freeze()
  srv = serve(svc, address=pt.addresses[_INDEX.value], token=_TOKEN)
  with open(out + ".port.tmp", "w") as f:
    f.write(str(srv.port))
  os.rename(out + ".port.tmp", out + ".port")
  # Seconds in the cyclic GC and collections, per generation (a full pass stops every thread).
  gc_s = [0.0, 0.0, 0.0]
  gc_n = [0, 0, 0]
  gc_t0 = [0.0]

  def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
      gc_t0[0] = time.perf_counter()
    else:
      gc_s[info["generation"]] += time.perf_counter() - gc_t0[0]
      gc_n[info["generation"]] += 1

  gc.callbacks.append(_gc_timer)
  clock = []  # (time, the shard's step clock): how far it lags the fleet's steps.
  while not stop.wait(0.25):
    with svc.lock:
      clock.append((time.monotonic(), svc.core.pacer.cadence_step()))
  with svc.lock:
    counts = svc.core.stats()
  merges = [
    (m.fragment, m.time, m.open_time, m.quorum_time, len(m.contributors)) for m in svc.merge_log()
  ]
  result = {
    "merges": merges,
    "refused": svc.refused(),
    "push_latency": svc.push_latency(),
    "clock": clock,
    "gc": {"seconds": gc_s, "collections": gc_n},
    "bulk_pushes": srv.bulk.calls["Push"],
    "counts": {k: v for k, v in counts.items() if isinstance(v, int | float)},
    "timeline": timeline.events() if _TIMELINE.value else [],
  }
  srv.stop(grace_s=0.5, flush=False)
  with open(out, "w") as f:
    json.dump(result, f)


# ---- coordinator ---------------------------------------------------------------------------


_PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # Resolved before any fork.


def _die_with_parent() -> None:  # Runs in the child between fork and exec: one libc call.
  _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no shard outlives a killed coordinator.


def _lowest_priority() -> None:
  """This process (and the threads it starts) runs only when nothing else wants the CPU.

  Each child is its own session, so its own scheduler group (autogroup): SCHED_IDLE alone would
  only rank it within that group, and the group's weight is lowered too.
  """
  try:
    with open("/proc/self/autogroup", "w") as f:
      f.write("19")
  except OSError:
    pass  # No autogroup on this kernel: SCHED_IDLE is still set.
  os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _child(role: str, pt: Point, index: int, out: str, cpus: str) -> subprocess.Popen:
  cmd = [sys.executable, os.path.abspath(__file__), f"--role={role}", f"--index={index}"]
  cmd += [f"--spec={json.dumps(dataclasses.asdict(pt))}", f"--out={out}"]
  cmd += [f"--fleet_procs={_FLEET_PROCS.value}"]
  cmd += [f"--fleet_send={_FLEET_SEND.value}", f"--fleet_priority={_FLEET_PRIORITY.value}"]
  cmd += [f"--gc_freeze={_GC_FREEZE.value}", f"--timeline={_TIMELINE.value}"]
  if cpus:
    cmd = ["taskset", "-c", cpus, *cmd]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if _JAX_CACHE.value:  # In the run's temp dir, beside the point's files.
    env.update(
      JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(out), "jax_cache"),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  return subprocess.Popen(
    cmd,
    env=env,
    start_new_session=True,
    preexec_fn=_die_with_parent,  # noqa: PLW1509 - one libc call, resolved before the fork.
  )


def start_shard(pt: Point, i: int, out: str) -> subprocess.Popen:
  """Starts shard i of `pt.shards` on `pt.addresses[i]` (module docstring), pinned if asked."""
  cpus = _SHARD_CPUS.value[i % len(_SHARD_CPUS.value)] if _SHARD_CPUS.value else ""
  return _child("shard", pt, i, out, cpus)


def _wait_file(path: str, procs: list[subprocess.Popen]) -> None:
  deadline = time.monotonic() + _TIMEOUT_S
  while not os.path.exists(path):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      raise RuntimeError(f"a child failed before writing {path}")
    time.sleep(0.05)


def _cpu_s(pid: int) -> float:
  """User + system CPU seconds of a process (all its threads) so far."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _stop(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  for p in procs:
    try:
      p.wait(15)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait(5)


def measure(pt: Point, tmp: str) -> dict:
  """Runs one point: S shards and the fleet under load for `pt.windows` windows of `window_s`
  after the warm-up; returns its figures, each the median over the windows, a level kept up with
  when most windows were (see the module docstring), and every window's own figures."""
  tag = f"{tmp}/s{pt.shards}m{pt.learners}f{pt.fragment_params}t{pt.step_s:.4f}"
  began = time.monotonic()
  # Seconds from `began` at which each phase ended (what a point costs beyond its load), and the
  # CPU-seconds its processes took to start.
  marks = {}
  # Every shard's address before any starts: a shard advertises the map at Register, as
  # ddiloco-local's shards do.
  ports = [processes.free_port() for _ in range(pt.shards)]
  pt = dataclasses.replace(pt, addresses=tuple(f"127.0.0.1:{port}" for port in ports))
  shards = [start_shard(pt, i, f"{tag}.shard{i}") for i in range(pt.shards)]
  # The fleet starts beside them (imports, encodes its pushes) and registers once they serve.
  fleets = [
    _child("fleet", pt, k, f"{tag}.fleet{k}", _FLEET_CPUS.value)
    for k in range(min(_FLEET_PROCS.value, pt.learners))
  ]
  cpu: list[list[float]] = []  # Per window boundary: CPU seconds of every shard and fleet process.
  try:
    for i in range(pt.shards):
      _wait_file(f"{tag}.shard{i}.port", shards + fleets)
    marks["shards_up"] = time.monotonic() - began
    marks["shard_start_cpu_s"] = max(_cpu_s(p.pid) for p in shards)  # Its busiest's, to serve.
    for k in range(len(fleets)):
      with open(f"{tag}.fleet{k}.serving", "w"):
        pass
    for k in range(len(fleets)):
      _wait_file(f"{tag}.fleet{k}.ready", fleets + shards)
    marks["fleet_up"] = time.monotonic() - began
    marks["fleet_start_cpu_s"] = max(_cpu_s(p.pid) for p in fleets)  # Registered and pulled.
    t0 = time.monotonic() + 0.2
    for k in range(len(fleets)):
      with open(f"{tag}.fleet{k}.go", "w") as f:
        f.write(repr(t0))
    bounds = [t0 + pt.warmup_s + w * pt.window_s for w in range(pt.windows + 1)]
    for b in bounds:
      time.sleep(max(0.0, b - time.monotonic()))
      cpu.append([_cpu_s(p.pid) for p in shards + fleets])
    rss = [_rss_mib(p.pid) for p in shards]
    for p in fleets:
      p.wait(_TIMEOUT_S)
    marks["load_end"] = time.monotonic() - began
  finally:
    _stop(fleets)
    _stop(shards)
  marks["stopped"] = time.monotonic() - began
  pushes, asks = [], []
  for k in range(len(fleets)):
    with open(f"{tag}.fleet{k}") as f:
      fleet = json.load(f)
    pushes += fleet["pushes"]
    asks += fleet["asks"]
  logs = []
  for i in range(pt.shards):
    with open(f"{tag}.shard{i}") as f:
      logs.append(json.load(f))
  wire = wire_bytes(pt.fragment_params, pt.codec)
  windows = []
  for w in range(pt.windows):
    start, end = bounds[w], bounds[w + 1]
    cores = [(b - a) / pt.window_s for a, b in zip(cpu[w], cpu[w + 1])]
    per_shard = []
    for i in range(pt.shards):
      merges = [m for m in logs[i]["merges"] if start <= m[1] < end]
      opened = sum(1 for a in asks if a[0] == i and a[1] == 0 and start <= a[2] < end)
      per_shard.append(shard_figures(pt, merges, opened, keep_up=_KEEP_UP.value, wire=wire))
      per_shard[-1].update(cores=cores[i], rss_mib=rss[i], **statuses(pushes, i, start, end))
      if logs[i]["timeline"]:
        per_shard[-1]["timeline"] = timeline.rounds(
          logs[i]["timeline"], merges, start, end, [a for a in asks if a[0] == i]
        )
    windows.append(
      {
        "fragments_per_s": sum(s["fragments_per_s"] for s in per_shard),
        "gbps": sum(s["gbps"] for s in per_shard),
        "keeps_up": all(s["keeps_up"] for s in per_shard),
        "fleet_cores": sum(cores[pt.shards :]),
        "shards": per_shard,
      }
    )
  # P/H = 1 group per step: M answers to each of its slices.
  offered = pt.learners * pt.slices / pt.step_s
  kept = sum(w["keeps_up"] for w in windows)
  return {
    "point": dataclasses.asdict(pt),
    "offered_fragments_per_s": offered,
    "offered_gbps": offered * wire_bytes(pt.fragment_params, pt.codec) / 1e9,
    **medians(windows),
    "budget_s": pt.overlap * pt.step_s,
    "keeps_up": 2 * kept > len(windows),  # Most windows: one neighbour's burst does not decide.
    "kept_windows": kept,
    "gbps_range": [min(w["gbps"] for w in windows), max(w["gbps"] for w in windows)],
    "p99_open_range_s": [
      min(max(s["p99_open_s"] for s in w["shards"]) for w in windows),
      max(max(s["p99_open_s"] for s in w["shards"]) for w in windows),
    ],
    "shard_gc_s": [sum(lg["gc"]["seconds"]) for lg in logs],  # In the cyclic GC, whole run.
    "bulk_pushes": [lg["bulk_pushes"] for lg in logs],  # Pushes over each shard's bulk port.
    # Whole run, per shard: rounds not opened because the fragment's last one was still open, and
    # how many steps its step clock trailed the fleet's at the end of the last window.
    "overrun_rounds": [lg["counts"].get("overrun_rounds", 0) for lg in logs],
    "clock_lag_steps": [clock_lag(lg["clock"], t0, bounds[-1], pt.step_s) for lg in logs],
    "windows": windows,
    "phase_s": marks,
  }


@dataclasses.dataclass
class Deadline:
  """When the run must be over (`--deadline_s`): a point starts only if it should end before.

  A point's cost beyond its load (start-up of its processes, registration and pulls, stop,
  analysis) is taken from the last point of the same shard count, else the largest seen yet.
  """

  end: float = float("inf")  # time.monotonic()
  overhead_s: dict[int, float] = dataclasses.field(default_factory=dict)

  def fits(self, pt: Point) -> bool:
    over = self.overhead_s.get(pt.shards, max(self.overhead_s.values(), default=0.0))
    return time.monotonic() + _load_s(pt) + over <= self.end

  def spent(self, pt: Point, seconds: float) -> None:
    self.overhead_s[pt.shards] = max(0.0, seconds - _load_s(pt))


def _load_s(pt: Point) -> float:
  return pt.warmup_s + pt.windows * pt.window_s


def ramp(
  shard_counts: list[int],
  learners: int,
  fragment_mib: float,
  tmp: str,
  *,
  deadline: Deadline,
  record: Callable[[list[dict]], None] = lambda runs: None,
) -> list[dict]:
  """Offers each `--ramp_gbps` in turn to every shard count, interleaved (S = 1, then S = 2, at
  each level) so that the machine's noise hits them alike; a shard count stops ramping after its
  first level not kept up with, and a point that would end past `deadline` is skipped. Calls
  `record` with the runs so far after each point. Returns one run per shard count measured."""
  print(
    f"\nM={learners} P={_FRAGMENTS.value} fragment {fragment_mib:g} MiB float32 "
    f"({wire_bytes(int(fragment_mib * (1 << 18)), _CODEC.value) / 2**20:.2f} MiB {_CODEC.value} "
    f"on the wire{', cut into S slices' if _SLICES.value else ''}), {_WINDOWS.value} windows of "
    f"{_WINDOW.value:g} s per level, medians. Per shard: [merged GB/s, rounds opened/scheduled, "
    "p50/p99 open->published ms, p99 quorum->published ms, cores, RSS MiB, fleet's push answers]; "
    "then windows kept up with, merged GB/s and the worst shard's p99 (min-max over windows)"
  )
  print(f"{'S':>2s} {'offered':>8s} {'merged':>7s} {'frag/s':>7s} {'budget':>7s} {'fleet':>6s}")
  levels: dict[int, list[dict]] = {s: [] for s in shard_counts}
  for level in (float(g) for g in _RAMP.value):
    for shards in shard_counts:
      if levels[shards] and not levels[shards][-1]["keeps_up"]:
        continue
      slices = shards if _SLICES.value else 1
      params = int(fragment_mib * (1 << 18)) // slices  # float32 values of one (sliced) fragment.
      gbps = level * shards if _RAMP_PER_SHARD.value else level
      pt = Point(
        shards=shards,
        learners=learners,
        fragments=_FRAGMENTS.value,
        fragment_params=params,
        # P = H: one group per step, M answers to each of its slices.
        step_s=learners * slices * wire_bytes(params, _CODEC.value) / (gbps * 1e9),
        overlap=_OVERLAP.value,
        codec=_CODEC.value,
        downlink=_DOWNLINK.value,
        warmup_s=_WARMUP.value,
        window_s=_WINDOW.value,
        windows=_WINDOWS.value,
        slices=slices,
      )
      if not deadline.fits(pt):
        print(f"{shards:2d} {gbps:8.3f}  skipped: it would end past --deadline_s", flush=True)
        continue
      began = time.monotonic()
      r = measure(pt, tmp)
      deadline.spent(pt, time.monotonic() - began)
      levels[shards].append(r)
      print_level(r)
      for i in range(shards) if _TIMELINE.value else ():
        rows = [row for w in r["windows"] for row in w["shards"][i].get("timeline", [])]
        timeline.print_rounds(f"shard {i}", rows)
      record([run_figures(s, learners, fragment_mib, lv) for s, lv in levels.items() if lv])
  return [run_figures(s, learners, fragment_mib, lv) for s, lv in levels.items() if lv]


def main(argv):
  del argv
  if _ROLE.value != "main":
    logging.set_verbosity(logging.WARNING)  # Not a line per registration.
    pt = Point(**{**json.loads(_SPEC.value), "addresses": ()})
    pt = dataclasses.replace(pt, addresses=tuple(json.loads(_SPEC.value)["addresses"]))
    if _ROLE.value == "shard":
      _shard_main(pt, _OUT.value)
    else:
      if _FLEET_PRIORITY.value == "idle":
        _lowest_priority()
      bench_capacity_fleet.fleet_main(
        pt,
        _OUT.value,
        index=_INDEX.value,
        procs=_FLEET_PROCS.value,
        send=_FLEET_SEND.value,
      )
    return
  if _ANALYZE.value:
    with open(_ANALYZE.value) as f:
      summarize(json.load(f))
    return
  _coordinate([int(s) for s in _SHARDS.value])


def memcpy_probe(nbytes: int = 64 << 20, repeats: int = 8) -> dict[str, float]:
  """The GB/s of a `nbytes` copy on each CPU this process may run on, this process pinned to it
  in turn (the best of `repeats`). The machine's speed, recorded beside each run's figures: on a
  shared VM it drifts by a factor of two within an hour, with the code unchanged."""
  allowed = sorted(os.sched_getaffinity(0))
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  out = {}
  try:
    for cpu in allowed:
      os.sched_setaffinity(0, {cpu})
      best = float("inf")
      for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
      out[str(cpu)] = round(nbytes / best / 1e9, 2)
  finally:
    os.sched_setaffinity(0, set(allowed))
  return out


def _save(out: dict) -> None:
  """Writes `out` to `--json` whole or not at all: a run cut short leaves its last complete copy."""
  if _JSON.value:
    with open(_JSON.value + ".tmp", "w") as f:
      json.dump(out, f, indent=1)
    os.replace(_JSON.value + ".tmp", _JSON.value)


def _coordinate(shard_counts: list[int]) -> None:
  """The ramps (and `--sweep`), `--json` rewritten after every point; the summary."""
  if not _SLICES.value and any(_FRAGMENTS.value % s for s in shard_counts):
    raise app.UsageError(f"--fragments={_FRAGMENTS.value} must divide by every --shards.")
  # A SIGTERM (`timeout`) unwinds: each point's finally stops its children, the temp dir goes.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  deadline = Deadline(time.monotonic() + (_DEADLINE.value or float("inf")))
  with open("/proc/loadavg") as f:
    print(f"load before: {f.read().strip()}; {os.cpu_count()} CPUs")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  probe = {"before": memcpy_probe()}
  print(f"memcpy GB/s by core before: {probe['before']}")
  out: dict = {
    **bench_learner_overhead_report.provenance(root),
    "command": " ".join(sys.argv),
    "memcpy_gbps": probe,
    "runs": [],
    "sweep": [],
    "cpus": len(os.sched_getaffinity(0)),
    "complete": False,
  }

  def record(key: str, done: list[dict]) -> Callable[[list[dict]], None]:
    return lambda runs: _save({**out, key: done + runs})

  with tempfile.TemporaryDirectory(prefix="bench_capacity_") as tmp:
    m, mib = _LEARNERS.value, _FRAGMENT_MIB.value
    out["runs"] = ramp(shard_counts, m, mib, tmp, deadline=deadline, record=record("runs", []))
    if _SWEEP.value:
      for m in (int(m) for m in _SWEEP_M.value):
        runs = ramp([1], m, mib, tmp, deadline=deadline, record=record("sweep", out["sweep"]))
        out["sweep"] += runs
      for mib in (float(x) for x in _SWEEP_MIB.value):
        m = _LEARNERS.value
        runs = ramp([1], m, mib, tmp, deadline=deadline, record=record("sweep", out["sweep"]))
        out["sweep"] += runs
  with open("/proc/loadavg") as f:
    print(f"\nload after: {f.read().strip()}")
  probe["after"] = memcpy_probe()
  print(f"memcpy GB/s by core after: {probe['after']}")
  summarize(out)
  out["complete"] = True
  _save(out)


if __name__ == "__main__":
  app.run(main)
