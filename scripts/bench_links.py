"""Benchmark: the main job across a shaped link, the syncer on one side and the learners on the other.

Two network namespaces joined by a veth pair, a `tbf` rate limit on each end (the same rate each
way; no delay nor loss: those are the chaos proxy's, ddiloco/chaos/proxy.py):

  ddl_syncer    10.77.0.1   the syncer (gRPC control port and bulk port)
  ddl_learners  10.77.0.2   the learners, the launcher and a prober of the control plane

For each codec it runs the main job (gin_configs/local_tiny.gin: 4 learners, int4 or bf16 both
ways, shortened to --steps) under `LocalCluster` across the link unshaped, then at each rate, and
records:
- `util_measured`: the learners' compute utilization as they measure it: the share of each one's
  training span (its first to its last step) not spent waiting for the syncer (`blocked_s`, the
  training thread's time waiting for a merge), averaged over the learners;
- `step_time_ratio`: their steady step time unshaped over their steady step time at this rate
  (each from the learner's first to its last logged step), averaged over the learners: on a small
  machine where learners and syncer share the cores it moves with the CPU the run's merges and
  applies take, not only with the link;
- `util_model`: the bandwidth model's prediction for the same settings (goodput/bandwidth.py,
  `DiLoCoLink` with the unshaped run's step time, P, H, τ and codec, the link shared by the M
  learners: rate / M each, each way) for the job's learners, which never wait
  (`learner_utilization`: 1); `util_waiting_model`, its prediction for a learner that waits for
  its fragments (`utilization`, Streaming DiLoCo's); `knee_mbit`, the rate it needs for every
  fragment to cross in time (M x `required_gbps`), and `link_load`, the knee over the rate;
- `control_p50_s`, `control_p99_s`: the latency of Status and Heartbeat calls made every 0.2 s
  from the learners' side while the data crosses the link (a Heartbeat of an id never registered:
  the same server threads and lock as a learner's, answered `registered=False`);
- `merged_fraction` (the learners' ledgers: the share of trained token-fragments that reached the
  global model), `mean_quorum`, late answers, merges, bytes and the achieved rate.

Needs root (`ip netns`, `tc`). The namespaces are removed on exit, and by `--cleanup` after a
crash. Each run takes a minute or two on 2 cores.

  python scripts/bench_links.py --rates_mbit=1,4,16 --codecs=int4,bf16 --out=docs/results/links.json
  python scripts/bench_links.py --cleanup
"""

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # This tree's ddiloco, here and in every process started below.
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

from absl import app, flags  # noqa: E402

_RATES = flags.DEFINE_list("rates_mbit", ["2", "8", "32"], "link rates, Mbit/s each way")
_CODECS = flags.DEFINE_list("codecs", ["int4", "bf16"], "wire codecs (both ways)")
_STEPS = flags.DEFINE_integer("steps", 96, "inner steps per learner")
_LEARNERS = flags.DEFINE_integer("learners", 4, "learners M")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "longest one run may take")
_OUT = flags.DEFINE_string("out", "docs/results/links.json", "where the rows go")
_WORKDIR = flags.DEFINE_string("workdir", None, "runs' folders (default: a temporary one)")
_CLEANUP = flags.DEFINE_bool("cleanup", False, "only remove the namespaces (after a crash)")
_REREAD = flags.DEFINE_bool(
  "reread", False, "rebuild --out's rows from --workdir's finished runs, comparing them again"
)
_CASE = flags.DEFINE_string(
  "case", None, "internal: run one case (JSON) in the learners' namespace"
)

NS_SYNCER, NS_LEARNERS = "ddl_syncer", "ddl_learners"
VETH_SYNCER, VETH_LEARNERS = "ddl_vs", "ddl_vl"
IP_SYNCER, IP_LEARNERS = "10.77.0.1", "10.77.0.2"
PROBE_EVERY_S = 0.2
PROBE_ID = 1_000_000  # Never registered.


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


# -- the link -------------------------------------------------------------------------------------


def setup() -> None:
  """The two namespaces and the veth pair between them (no rate yet)."""
  cleanup()
  _ip("netns", "add", NS_SYNCER)
  _ip("netns", "add", NS_LEARNERS)
  _ip("link", "add", VETH_SYNCER, "type", "veth", "peer", "name", VETH_LEARNERS)
  for ns, dev, addr in (
    (NS_SYNCER, VETH_SYNCER, IP_SYNCER),
    (NS_LEARNERS, VETH_LEARNERS, IP_LEARNERS),
  ):
    _ip("link", "set", dev, "netns", ns)
    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
    _ip("-n", ns, "link", "set", dev, "up")
    _ip("-n", ns, "link", "set", "lo", "up")


def shape(rate_mbit: float | None) -> None:
  """A token bucket of `rate_mbit` on each end: the same rate each way (None: none). Its burst is
  10 ms of the rate (at least 64 KiB, a GSO segment); its queue holds 100 ms more."""
  for ns, dev in ((NS_SYNCER, VETH_SYNCER), (NS_LEARNERS, VETH_LEARNERS)):
    if rate_mbit is None:
      _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
      continue
    burst = max(64 << 10, int(rate_mbit * 1e6 / 8 * 0.01))
    spec = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, *spec)


def cleanup() -> None:
  """Ends what still runs in the namespaces (this benchmark's processes) and removes them."""
  for ns in (NS_SYNCER, NS_LEARNERS):
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
      with contextlib.suppress(ProcessLookupError, ValueError):
        os.kill(int(pid), 9)
    _ip("netns", "del", ns, check=False)


# -- one case, in the learners' namespace ---------------------------------------------------------


class _Prober:
  """Status and Heartbeat round trips to the syncer every `PROBE_EVERY_S`, from a thread."""

  def __init__(self, cluster):
    self._cluster = cluster
    self._stop = threading.Event()
    self.latencies: dict[str, list[float]] = {"status": [], "heartbeat": []}
    self._thread = threading.Thread(target=self._run, name="control-prober", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    import grpc

    from ddiloco.transport.client import SyncerClient

    while self._cluster.port is None and not self._stop.wait(0.2):
      pass
    client = SyncerClient(
      f"{IP_SYNCER}:{self._cluster.port}", token=self._cluster.token, deadline_s=10.0
    )
    calls = {"status": client.status, "heartbeat": lambda: client.heartbeat(PROBE_ID)}
    try:
      while not self._stop.wait(PROBE_EVERY_S):
        for kind, call in calls.items():
          start = time.monotonic()
          try:
            call()
          except grpc.RpcError:
            continue  # Not answered: no latency to count (the run's own checks say why).
          self.latencies[kind].append(time.monotonic() - start)
    finally:
      client.close()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(15)


def _shaped_cluster(workdir: str, gin_args: list[str], learners: int):
  """A `LocalCluster` whose syncer runs in the syncer's namespace, reached at its address."""
  from ddiloco.launch import backend, local_cluster, processes

  class SyncerInItsNamespace(backend.LocalProcesses):
    """Child processes here; the syncer's started through `ip netns exec` in its namespace."""

    def start(self, launch: processes.Launch) -> subprocess.Popen:
      if launch.role == "syncer":
        argv = ["netns", "exec", NS_SYNCER, self.python, *launch.argv]
        return processes.spawn("ip", dataclasses.replace(launch, argv=argv))
      return super().start(launch)

  cluster = local_cluster.LocalCluster(
    workdir=workdir, gin_args=gin_args, num_learners=learners, backend=SyncerInItsNamespace()
  )
  cluster.syncer_host = IP_SYNCER
  return cluster


def run_case(case: dict) -> dict:
  """Runs the job of `case` across the link as shaped now; its row."""
  import numpy as np

  from ddiloco.testing import runs

  bindings = runs.quick(
    learners=case["learners"],
    steps=case["steps"],
    more=[f'UPLINK = "{case["codec"]}"', f'DOWNLINK = "{case["codec"]}"'],
  )
  gin_file = runs.config_path("local_tiny.gin")
  job = runs.parse_job(gin_file, bindings)
  cluster = _shaped_cluster(case["workdir"], runs.gin_args(gin_file, bindings), case["learners"])
  prober = _Prober(cluster)
  try:
    summary = cluster.run(job, timeout_s=case["timeout_s"], progress_every_s=10.0, control=False)
  finally:
    prober.stop()
    cluster.stop_all()
  learners = []
  for i in range(case["learners"]):
    with open(os.path.join(case["workdir"], f"learner_{i}", "summary.json")) as f:
      learners.append(json.load(f))
  span = [s["train_end"] - s["train_start"] for s in learners]
  waits = _waits(learners)
  # Seconds per step from each learner's first logged step to its last (start-up left out).
  steady = [
    (s["losses"][-1][1] - s["losses"][0][1]) / (s["losses"][-1][0] - s["losses"][0][0])
    for s in learners
  ]
  ledgers = [s["ledger"] for s in learners if s.get("ledger")]
  merged = sum(lg["token_fragments"]["merged"] for lg in ledgers)
  trained = sum(lg["trained"] * lg["num_fragments"] for lg in ledgers)
  probes = prober.latencies["status"] + prober.latencies["heartbeat"]
  schedule = job.run.the_schedule()
  wall = float(np.mean(span))
  rate = case["rate_mbit"]
  return {
    "link": "unshaped" if rate is None else f"{rate:g} Mbit/s",
    "rate_mbit": case["rate_mbit"],
    "codec": case["codec"],
    "learners": case["learners"],
    "steps": case["steps"],
    "fragments": schedule.num_fragments,
    "period": schedule.period,
    "overlap": schedule.overlap,
    "num_params": summary["num_params"],
    "step_time_s": [round(t, 4) for t in steady],  # Per learner, steady (module docstring).
    "block_size": job.run.the_service().block_size,
    "control_p50_s": round(float(np.percentile(probes, 50)), 4) if probes else None,
    "control_p99_s": round(float(np.percentile(probes, 99)), 4) if probes else None,
    "control_probes": len(probes),
    "merged_fraction": round(merged / trained, 4) if trained else None,
    "mean_quorum": round(summary["mean_quorum_size"], 3),
    "merges": summary["merges"],
    "late_answers": summary["dropped_reports"],
    "final_eval_loss": round(summary["final_eval_loss"], 4),
    "bytes_up": summary["bytes_up"],
    "bytes_down": summary["bytes_down"],
    "training_span_s": round(wall, 1),
    **waits,
    "digests_agree": summary["digests_agree"],
  }


def _waits(learners: list[dict]) -> dict:
  """Each learner's training span and its time blocked waiting for merges (its summary)."""
  return {
    "train_span_s": [round(s["train_end"] - s["train_start"], 2) for s in learners],
    "blocked_s": [round(s.get("blocked_s", 0.0), 3) for s in learners],
  }


def reread(workdir: str, rows: list[dict]) -> list[dict]:
  """`rows` of a finished sweep, their learners' waits read again from the sweep's folders and
  compared again: a change to the comparison, without running the links again."""
  out, reference = [], {}
  for old in rows:
    rate = old["rate_mbit"]
    case = os.path.join(workdir, f"{old['codec']}_{'unshaped' if rate is None else f'{rate:g}'}")
    learners = []
    for i in range(old["learners"]):
      with open(os.path.join(case, f"learner_{i}", "summary.json")) as f:
        learners.append(json.load(f))
    row = old | _waits(learners)
    reference.setdefault(row["codec"], row)  # The codec's unshaped run comes first.
    out.append(row | _compare(row, reference[row["codec"]]))
  return out


def _compare(row: dict, reference: dict) -> dict:
  """`util_measured` against the unshaped run of the codec, and the bandwidth model's
  utilization and knee for the row's settings (goodput/bandwidth.py)."""
  import numpy as np

  from ddiloco.goodput import bandwidth

  bits = {"int4": 4, "int8": 8, "bf16": 16, "fp32": 32}[row["codec"]]
  scaled = row["codec"] in ("int4", "int8")  # A float32 scale per block (docs/algorithm.md §5).
  wire = bandwidth.Wire(
    bits_per_value=bits, block_size=row["block_size"] if scaled else 0, scale_bits=32
  )
  step_time_s = float(np.mean(reference["step_time_s"]))
  link = bandwidth.DiLoCoLink(
    params=row["num_params"],
    step_time_s=step_time_s,
    fragments=row["fragments"],
    inner_steps=row["period"],
    overlap_steps=row["overlap"],
    wire=wire,
  )
  ratios = [t0 / t for t0, t in zip(reference["step_time_s"], row["step_time_s"], strict=True)]
  held = [b / s for b, s in zip(row["blocked_s"], row["train_span_s"], strict=True) if s > 0]
  rate = row["rate_mbit"]
  gbps = None if rate is None else rate / 1e3 / row["learners"]
  waiting = 1.0 if gbps is None else float(link.utilization(gbps))
  return {
    "util_measured": round(1.0 - float(np.mean(held)), 4) if held else None,
    "step_time_ratio": round(float(np.mean(ratios)), 4),
    "util_model": 1.0 if gbps is None else float(link.learner_utilization(gbps)),
    "util_waiting_model": round(waiting, 4),
    "knee_mbit": round(link.required_gbps() * 1e3 * row["learners"], 3),
    "link_load": None if gbps is None else round(float(link.link_load(gbps)), 3),
  }


# -- the sweep, in the root namespace -------------------------------------------------------------


def sweep(rates: list[float], codecs: list[str], workdir: str) -> list[dict]:
  """Every codec unshaped, then at every rate; the rows."""
  rows = []
  setup()
  try:
    for codec in codecs:
      reference = None
      for rate in [None, *rates]:
        shape(rate)
        case = {
          "rate_mbit": rate,
          "codec": codec,
          "learners": _LEARNERS.value,
          "steps": _STEPS.value,
          "timeout_s": _TIMEOUT.value,
          "workdir": os.path.join(
            workdir, f"{codec}_{'unshaped' if rate is None else f'{rate:g}'}"
          ),
        }
        out = case["workdir"] + ".json"
        cmd = ["ip", "netns", "exec", NS_LEARNERS, sys.executable, os.path.abspath(__file__)]
        cmd += [f"--case={json.dumps(case)}", f"--out={out}"]
        print(f"{codec}, link {rate or 'unshaped'} ...", flush=True)
        load = round(os.getloadavg()[0], 2)  # The machine's own noise, beside the link's.
        subprocess.run(cmd, check=True, cwd=ROOT, timeout=_TIMEOUT.value + 120)
        with open(out) as f:
          row = json.load(f)
        reference = reference or row
        rows.append(row | _compare(row, reference) | {"load_avg_1m_at_start": load})
        print("  " + json.dumps(rows[-1]), flush=True)
  finally:
    cleanup()
  return rows


def _machine() -> dict:
  return {
    "host": platform.node(),
    "cpus": os.cpu_count(),
    "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    "kernel": platform.release(),
  }


def main(argv: list[str]) -> None:
  del argv
  if _CASE.value:  # One case, in the learners' namespace.
    row = run_case(json.loads(_CASE.value))
    with open(_OUT.value, "w") as f:
      json.dump(row, f, indent=1)
    return
  if _REREAD.value:
    with open(_OUT.value) as f:
      result = json.load(f)
    result["rows"] = reread(_WORKDIR.value, result["rows"])
    result["reread"] = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)
    print(f"rewrote {_OUT.value}")
    return
  if os.geteuid() != 0:
    sys.exit("bench_links: needs root (ip netns, tc).")
  if _CLEANUP.value:
    cleanup()
    return
  machine = _machine()
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
  ).stdout.strip()
  rates = [float(r) for r in _RATES.value]
  with contextlib.ExitStack() as stack:
    workdir = _WORKDIR.value or stack.enter_context(tempfile.TemporaryDirectory(prefix="links_"))
    rows = sweep(rates, _CODECS.value, workdir)
  result = {
    "command": "python scripts/bench_links.py " + " ".join(sys.argv[1:]),
    "commit": commit,
    "date": datetime.date.today().isoformat(),
    "machine": machine,
    "rows": rows,
  }
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
