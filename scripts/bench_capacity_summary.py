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


def run_figures(shards: int, learners: int, fragment_mib: float, lv: list[dict]) -> dict:
  """A shard count's ramp so far: its levels, and the best one kept up with."""
  kept = [r for r in lv if r["keeps_up"]]
  best = max(kept, key=lambda r: r["gbps"]) if kept else None
  return {
    "shards": shards,
    "learners": learners,
    "fragment_mib": fragment_mib,
    "levels": lv,
    "sustained_gbps": best["gbps"] if best else 0.0,
    "sustained_fragments_per_s": best["fragments_per_s"] if best else 0.0,
    # The worst shard's p99 open -> published at the sustained level (NaN if none).
    "sustained_p99_open_s": max(s["p99_open_s"] for s in best["shards"]) if best else float("nan"),
    "peak_gbps": max(r["gbps"] for r in lv),
  }


def print_level(r: dict) -> None:
  """One line of the ramp: a level's figures (bench_capacity.measure), its shards' in brackets."""
  shard_txt = "  ".join(
    f"[{s['gbps']:.3f} {s['opened_rounds']:.0f}/{s['scheduled_rounds']:.0f} "
    f"{1e3 * s['p50_open_s']:.0f}/{1e3 * s['p99_open_s']:.0f} "
    f"{1e3 * s['p99_merge_s']:.0f} {s['cores']:.2f} {s['rss_mib']:.0f} {s['push_status']}"
    f"{' retried {:.0f}'.format(s['retried']) if s['retried'] else ''}]"
    for s in r["shards"]
  )
  overruns = f", overrun rounds {r['overrun_rounds']}" if any(r["overrun_rounds"]) else ""
  lo, hi = r["gbps_range"]
  p_lo, p_hi = r["p99_open_range_s"]
  ph = r.get("phase_s", {})
  started = (
    f", shards up in {ph['shards_up']:.1f} s, fleet {ph['fleet_up'] - ph['shards_up']:.1f} s, "
    f"all done {ph['stopped']:.1f} s"
    if "stopped" in ph
    else ""
  )
  print(
    f"{r['point']['shards']:2d} {r['offered_gbps']:8.3f} {r['gbps']:7.3f} "
    f"{r['fragments_per_s']:7.1f} {1e3 * r['budget_s']:5.0f}ms {r['fleet_cores']:6.2f}  "
    f"{shard_txt}  kept {r['kept_windows']}/{len(r['windows'])}, {lo:.3f}-{hi:.3f} GB/s, "
    f"p99 {1e3 * p_lo:.0f}-{1e3 * p_hi:.0f} ms{overruns}{started}"
    f"{'' if r['keeps_up'] else '  <- does not keep up'}",
    flush=True,
  )


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
  if "memcpy_gbps" in out:  # The machine's speed (`bench_capacity.memcpy_probe`).
    print(f"memcpy GB/s by core: {out['memcpy_gbps']}")
  by_s = {r["shards"]: r for r in out["runs"]}
  for s, run in sorted(by_s.items()):
    p99 = run.get("sustained_p99_open_s", float("nan"))
    print(
      f"S={s}: {run['sustained_gbps'] / s:.3f} GB/s per shard core sustained, p99 open->published "
      f"{1e3 * p99:.0f} ms there"
    )
  if 1 in by_s and len(by_s) > 1:
    if by_s[1]["sustained_gbps"] > 0:
      out["ratios"] = {}
      for s in sorted(by_s)[1:]:
        ratio = by_s[s]["sustained_gbps"] / by_s[1]["sustained_gbps"]
        peak = by_s[s]["peak_gbps"] / by_s[1]["peak_gbps"]
        out["ratios"][str(s)] = ratio
        if s == 2:
          out["ratio"], out["peak_ratio"] = ratio, peak
        print(f"ingest(S={s})/ingest(S=1) = {ratio:.2f} sustained ({peak:.2f} at peak; ideal {s})")
    else:  # A loaded machine can fail even the ramp's lowest level: say so, not a made-up ratio.
      out["ratio"] = out["peak_ratio"] = None
      print("ingest(S)/ingest(S=1) = n/a: S=1 kept up with no level of the ramp (start it lower)")
    cpus = out.get("cpus", 2)
    counts = sorted(by_s)
    bound = [cpu_bound(s, cpus, by_s[s]["per_core"]) for s in counts]
    out["cpu_bound_gbps"] = bound
    print(
      f"CPU-bound on {cpus} cores at each one's measured costs (the fleet on the same cores): "
      + ", ".join(f"S={s} {b:.3f} GB/s" for s, b in zip(counts, bound))
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
        held = pt["fragment_params"] * pt["fragments"] * pt.get("slices", 1)
        xs.append(held / pt["shards"])
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
  # P = H: one group a step, its `slices` rounds over all shards.
  scheduled = pt.window_s / pt.step_s * pt.slices / pt.shards
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
