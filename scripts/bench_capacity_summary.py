"""scripts/bench_capacity.py's analysis: a level's medians over its windows, CPU cost fits, the
CPU-bound projection, RSS per parameter.

python scripts/bench_capacity.py --analyze=capacity.json   # the summary of a saved run
"""

import numpy as np


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
  """(intercept, slope) of ys against xs by least squares; through 0 with fewer than 2 xs."""
  if len(set(xs)) < 2:
    return 0.0, sum(ys) / sum(xs) if sum(xs) else 0.0
  slope, intercept = np.polyfit(np.array(xs, float), np.array(ys, float), 1)
  if slope <= 0:  # Noise over too narrow a range: no fixed part to tell apart.
    return 0.0, sum(ys) / sum(xs)
  return max(float(intercept), 0.0), float(slope)


def per_core(run: dict) -> dict:
  """CPU costs of a ramp, fitted over its levels: `capacity.MeasuredShard`'s inputs.

  A shard's cores = shard_fixed_cores + shard_s_per_gb · its merged wire GB/s (receiving, decoding,
  filing, merging, adopting, publishing; the fixed part is its heartbeats, streams and merge
  thread); the fleet's likewise against the total. shard_gbps_per_core is the ingest one core
  carries at saturation, (1 - fixed) / per GB. merge_gbps: a round's decoded answer bytes
  (M · fragment · 4 B) over its quorum -> published time at the least loaded level.
  """
  lv = run["levels"]
  shard = _line(
    [s["gbps"] for r in lv for s in r["shards"]], [s["cores"] for r in lv for s in r["shards"]]
  )
  fleet = _line([r["gbps"] for r in lv], [r["fleet_cores"] for r in lv])
  low = lv[0]
  frag_bytes = low["point"]["fragment_params"] * 4 * low["point"]["learners"]
  merge = [frag_bytes / s["p50_merge_s"] / 1e9 for s in low["shards"]]
  return {
    "shard_fixed_cores": shard[0],
    "shard_s_per_gb": shard[1],
    "fleet_fixed_cores": fleet[0],
    "fleet_s_per_gb": fleet[1],
    "shard_gbps_per_core": (1 - shard[0]) / shard[1] if shard[1] > 0 else 0.0,
    "merge_gbps": float(np.mean(merge)),
  }


def cpu_bound(shards: int, cpus: int, c: dict) -> float:
  """The ingest (GB/s) `shards` shards pinned one per core sustain on `cpus` cores shared with the
  fleet, were CPU the only limit, at the costs `c` (`per_core`): each shard within its core, the
  shards and the fleet together within the machine."""
  one = shards * (1 - c["shard_fixed_cores"]) / c["shard_s_per_gb"]
  spare = cpus - shards * c["shard_fixed_cores"] - c["fleet_fixed_cores"]
  return min(one, spare / (c["shard_s_per_gb"] + c["fleet_s_per_gb"]))


def summarize(out: dict) -> None:
  """Prints (and adds to `out`) the per-core figures, the ratio and the RSS fit of the runs."""
  for run in out["runs"] + out["sweep"]:
    run["per_core"] = c = per_core(run)
    print(
      f"S={run['shards']} M={run['learners']} {run['fragment_mib']:g} MiB: sustained "
      f"{run['sustained_gbps']:.3f} GB/s ({run['sustained_fragments_per_s']:.1f} fragments/s), "
      f"peak {run['peak_gbps']:.3f}. CPU: shard {c['shard_fixed_cores']:.2f} cores + "
      f"{c['shard_s_per_gb']:.2f} s/GB (one core: {c['shard_gbps_per_core']:.3f} GB/s), fleet "
      f"{c['fleet_fixed_cores']:.2f} + {c['fleet_s_per_gb']:.2f} s/GB; merge {c['merge_gbps']:.2f} GB/s"
    )
  by_s = {r["shards"]: r for r in out["runs"]}
  if 1 in by_s and 2 in by_s:
    if by_s[1]["sustained_gbps"] > 0:
      ratio = by_s[2]["sustained_gbps"] / by_s[1]["sustained_gbps"]
      peak = by_s[2]["peak_gbps"] / by_s[1]["peak_gbps"]
      out["ratio"], out["peak_ratio"] = ratio, peak
      print(f"ingest(S=2)/ingest(S=1) = {ratio:.2f} sustained ({peak:.2f} at peak; goal >= 1.7)")
    else:  # A loaded machine can fail even the ramp's lowest level: say so, not a made-up ratio.
      out["ratio"] = out["peak_ratio"] = None
      print("ingest(S=2)/ingest(S=1) = n/a: S=1 kept up with no level of the ramp (start it lower)")
    cpus = out.get("cpus", 2)
    bound = [cpu_bound(s, cpus, by_s[s]["per_core"]) for s in (1, 2)]
    out["cpu_bound_gbps"] = bound
    print(
      f"CPU-bound on {cpus} cores at each one's measured costs (the fleet on the same cores): "
      f"S=1 {bound[0]:.3f} GB/s, S=2 {bound[1]:.3f} GB/s, ratio {bound[1] / bound[0]:.2f}"
    )
  rss = rss_per_param(out["runs"] + out["sweep"])
  if rss is not None:
    out["rss"] = rss
    print(
      f"RSS per parameter held: {rss['bytes_per_param']:.1f} B + {rss['base_mib']:.0f} MiB "
      f"(fit over {rss['points']} shards)"
    )


def rss_per_param(runs: list[dict]) -> dict | None:
  """Least-squares line of a shard's RSS against the parameters it holds (needs 2 sizes)."""
  xs, ys = [], []
  for run in runs:
    for level in run["levels"]:
      pt = level["point"]
      for s in level["shards"]:
        xs.append(pt["fragment_params"] * pt["fragments"] / pt["shards"])
        ys.append(s["rss_mib"] * 2**20)
  if len(set(xs)) < 2:
    return None
  slope, base = np.polyfit(np.array(xs, float), np.array(ys, float), 1)
  return {"bytes_per_param": float(slope), "base_mib": float(base / 2**20), "points": len(xs)}


def clock_lag(samples: list, t0: float, at: float, step_s: float) -> float:
  """The fleet's step minus the shard's step clock at the last sample before `at` (NaN if none)."""
  before = [(t, c) for t, c in samples if t <= at]
  if not before:
    return float("nan")
  t, c = before[-1]
  return (t - t0) / step_s - c


def medians(windows: list[dict]) -> dict:
  """Each figure of a level as the median over its windows (push statuses summed)."""
  out = {k: float(np.median([w[k] for w in windows])) for k in ("fragments_per_s", "gbps")}
  out["fleet_cores"] = float(np.median([w["fleet_cores"] for w in windows]))
  shards = []
  for i in range(len(windows[0]["shards"])):
    per = [w["shards"][i] for w in windows]
    fig = {
      k: float(np.median([s[k] for s in per]))
      for k, v in per[0].items()
      if isinstance(v, int | float) and not isinstance(v, bool)
    }
    fig["keeps_up"] = 2 * sum(s["keeps_up"] for s in per) > len(per)
    status: dict[str, int] = {}
    for s in per:
      for k, n in s["push_status"].items():
        status[k] = status.get(k, 0) + n
    fig["push_status"] = status
    shards.append(fig)
  out["shards"] = shards
  return out


def statuses(pushes: list, shard: int, start: float, end: float) -> dict:
  """The final status of each answer the shard's fleet finished in [start, end), and how many of
  them needed more than one try (a transient refusal retried, as a learner does)."""
  done = [q for q in pushes if q[0] == shard and start <= q[2] < end]
  counts = {s: sum(1 for q in done if q[3] == s) for s in sorted({q[3] for q in done})}
  return {"push_status": counts, "retried": sum(1 for q in done if q[7] > 1)}


def shard_figures(pt, merges: list, opened: int, *, keep_up: float, wire: int) -> dict:
  """A shard's figures over the window. It keeps up when it opened the rounds its schedule has
  in the window (a late clock skips a round whose previous one is still open), merged the
  answers to those it opened (one round of lag allowed; `--keep_up` of each), and its p99 round
  latency (open -> published) is within the grace budget. `pt` is bench_capacity.Point; `wire` the
  bytes one pushed fragment puts on the wire."""
  answers = sum(m[4] for m in merges)
  open_s = np.array([m[1] - m[2] for m in merges] or [np.inf])
  merge_s = np.array([m[1] - m[3] for m in merges] or [np.inf])
  rate = answers / pt.window_s
  scheduled = pt.window_s / pt.step_s / pt.shards  # P = H: one round a step over all shards.
  due = keep_up * pt.learners * max(opened - 1, 0)
  budget = pt.overlap * pt.step_s
  return {
    "keeps_up": opened >= keep_up * scheduled - 1
    and answers >= due
    and float(np.quantile(open_s, 0.99)) <= budget,
    "scheduled_rounds": scheduled,
    "opened_rounds": opened,
    "merges": len(merges),
    "fragments_per_s": rate,
    "gbps": rate * wire / 1e9,
    "p50_open_s": float(np.median(open_s)),
    "p99_open_s": float(np.quantile(open_s, 0.99)),
    "p50_merge_s": float(np.median(merge_s)),
    "p99_merge_s": float(np.quantile(merge_s, 0.99)),
  }
