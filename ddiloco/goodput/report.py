"""Studies behind `ddiloco-goodput`: run, print, write JSON and plot (docs/algorithm.md §7).

Plain Python: `ddiloco.launch.configurables` registers these dataclasses and `experiment` with gin,
and `ddiloco-goodput` builds `experiment` from its gin files.
"""

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

from ddiloco.goodput import bandwidth
from ddiloco.goodput import fleet as goodput
from ddiloco.goodput import model as goodput_model
from ddiloco.goodput.capacity import CapacityStudy
from ddiloco.goodput.model import Costs, Fleet, Result, System


def _pyplot():
  """matplotlib's pyplot, headless (plots go to files only); the `plots` extra."""
  try:
    import matplotlib
  except ImportError as e:
    raise ImportError("Plots need matplotlib: pip install 'ddiloco[plots]'.") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


@dataclasses.dataclass(frozen=True, kw_only=True)
class GoodputStudy:
  """Goodput and uptime of several systems over several fleet sizes.

  Attributes:
    systems: systems to simulate.
    chips: fleet sizes.
    fleet: failure, recovery and speed model.
    costs: pause lengths.
    seed: random seed.
    compare_with_paper: also print and plot docs/algorithm.md §7's table (systems matched by name).
  """

  systems: Sequence[System]
  chips: Sequence[int]
  fleet: Fleet = dataclasses.field(default_factory=Fleet)
  costs: Costs = dataclasses.field(default_factory=Costs)
  seed: int = 0
  compare_with_paper: bool = False

  def __post_init__(self):
    object.__setattr__(self, "systems", tuple(self.systems))
    object.__setattr__(self, "chips", tuple(int(c) for c in self.chips))
    if not self.systems or not self.chips:
      raise ValueError("GoodputStudy needs at least one system and one fleet size.")
    names = [s.name for s in self.systems]
    if len(set(names)) != len(names):
      raise ValueError(f"System names must be unique, got {names}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandwidthStudy:
  """Bandwidth that data-parallel and Decoupled DiLoCo variants need.

  Attributes:
    data_parallel: the data-parallel link model.
    diloco: Decoupled DiLoCo link models, by label.
    utilization: data-parallel's target compute utilization.
  """

  data_parallel: bandwidth.DataParallelLink
  diloco: Sequence[tuple[str, bandwidth.DiLoCoLink]]
  utilization: float = 0.9

  def __post_init__(self):
    object.__setattr__(self, "diloco", tuple((str(n), link) for n, link in self.diloco))


def experiment(
  *,
  goodput: GoodputStudy | None = None,
  bandwidth: BandwidthStudy | None = None,
  capacity: CapacityStudy | None = None,
) -> tuple[GoodputStudy | None, BandwidthStudy | None, CapacityStudy | None]:
  """What `ddiloco-goodput` runs: a goodput study, a bandwidth study, a syncer capacity study, or
  several (bound in .gin files as `goodput.experiment.<study>`).

  Raises:
    ValueError: if none is configured.
  """
  if goodput is None and bandwidth is None and capacity is None:
    raise ValueError(
      "Configure goodput.experiment.goodput, goodput.experiment.bandwidth and/or "
      "goodput.experiment.capacity."
    )
  return goodput, bandwidth, capacity


def paper_goodput(name: str) -> tuple[float, ...] | None:
  """docs/algorithm.md §7's row for a system name, or None."""
  for row_name, _, row in goodput_model.PAPER_GOODPUT:
    if row_name == name:
      return row
  return None


def format_table(results: Sequence[Result], *, compare_with_paper: bool = False) -> str:
  """Goodput (and uptime) in percent, one row per system, one column per fleet size."""
  chips = sorted({r.chips for r in results})
  names = list(dict.fromkeys(r.system for r in results))
  by_key = {(r.system, r.chips): r for r in results}
  width = max(len(n) for n in names) + 2
  # With the paper's figures the cells read "goodput [paper]"; otherwise "goodput (uptime)".
  title = "goodput % [paper %]" if compare_with_paper else "goodput % (uptime %)"
  head = title.ljust(width) + "".join(f"{_chips_label(c):>16}" for c in chips)
  lines = [head]
  for name in names:
    cells = []
    paper = paper_goodput(name) if compare_with_paper else None
    for j, c in enumerate(chips):
      r = by_key.get((name, c))
      if r is None:
        cells.append(f"{'-':>16}")
        continue
      if not compare_with_paper:
        cell = f"{100 * r.goodput:5.1f} ({100 * r.uptime:5.1f})"
      elif paper is not None and j < len(paper) and c == goodput_model.PAPER_CHIPS[j]:
        cell = f"{100 * r.goodput:5.1f} [{paper[j]:3.0f}]"
      else:  # No paper figure for this system or fleet size.
        cell = f"{100 * r.goodput:5.1f}"
      cells.append(f"{cell:>16}")
    lines.append(name.ljust(width) + "".join(cells))
  if compare_with_paper:
    lines.append("[n] = the paper's goodput (docs/algorithm.md §7); uptime is in goodput.json.")
  lines.append("useful work, million chip-hours")
  for name in names:
    cells = [by_key.get((name, c)) for c in chips]
    lines.append(
      name.ljust(width)
      + "".join(f"{r.useful_chip_hours / 1e6:16.2f}" if r else f"{'-':>16}" for r in cells)
    )
  return "\n".join(lines)


def _chips_label(chips: int) -> str:
  if chips >= 1_000_000:
    return f"{chips / 1e6:g}M chips"
  if chips >= 1000:
    return f"{chips / 1e3:g}k chips"
  return f"{chips} chips"


def plot_goodput(results: Sequence[Result], path: str, *, compare_with_paper: bool) -> None:
  """Goodput and uptime against chips, one line per system."""
  plt = _pyplot()
  names = list(dict.fromkeys(r.system for r in results))
  fig, (ax_g, ax_u) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, name in enumerate(names):
    rows = sorted((r for r in results if r.system == name), key=lambda r: r.chips)
    x = [r.chips for r in rows]
    color = f"C{i}"
    ax_g.plot(x, [100 * r.goodput for r in rows], "o-", color=color, label=name)
    ax_u.plot(x, [100 * r.uptime for r in rows], "o-", color=color, label=name)
    paper = paper_goodput(name) if compare_with_paper else None
    if paper is not None:
      ax_g.plot(goodput_model.PAPER_CHIPS, paper, "x", color=color, markersize=9)
  for ax, label in ((ax_g, "goodput (%)"), (ax_u, "uptime (%)")):
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel(label)
    ax.set_ylim(0, 101)
    ax.grid(True, which="both", alpha=0.3)
  title = "goodput (lines: simulator" + (", x: paper)" if compare_with_paper else ")")
  ax_g.set_title(title)
  ax_u.set_title("uptime: the system makes global progress")
  ax_u.legend(fontsize=8, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_goodput_study(study: GoodputStudy, workdir: str) -> list[Result]:
  """Simulates the study; writes goodput.json and goodput.png to `workdir`; prints the table.

  Args:
    study: what to simulate.
    workdir: output folder (created if missing).

  Returns:
    One result per (system, chips).
  """
  os.makedirs(workdir, exist_ok=True)
  results = goodput.run_table(
    study.systems, study.chips, fleet=study.fleet, costs=study.costs, seed=study.seed
  )
  with open(os.path.join(workdir, "goodput.json"), "w") as f:
    json.dump([r.record() for r in results], f, indent=1)
  plot_goodput(
    results, os.path.join(workdir, "goodput.png"), compare_with_paper=study.compare_with_paper
  )
  print(format_table(results, compare_with_paper=study.compare_with_paper))
  return results


def run_bandwidth_study(study: BandwidthStudy, workdir: str) -> dict[str, object]:
  """Computes the bandwidth figures; writes bandwidth.json and bandwidth.png; prints them.

  Args:
    study: the link models.
    workdir: output folder (created if missing).

  Returns:
    The figures written to bandwidth.json.
  """
  os.makedirs(workdir, exist_ok=True)
  dp = study.data_parallel
  dp_gbps = dp.required_gbps(study.utilization)
  exact = dp.exact_required_gbps(study.utilization)
  out: dict[str, object] = {
    "data_parallel": {"utilization": study.utilization, "gbps": dp_gbps, "exact_gbps": exact},
    "diloco": [],
  }
  lines = [
    f"data-parallel, exposed communication <= {1 - study.utilization:.0%} of the step: "
    f"{dp_gbps:8.2f} Gbit/s ({exact:.2f} for exactly {study.utilization:.0%} utilization)"
  ]
  for name, link in study.diloco:
    need = link.required_gbps()
    out["diloco"].append(
      {
        "name": name,
        "gbps": need,
        "deadline_gbps": link.deadline_gbps,
        "sustained_gbps": link.sustained_gbps,
        "bits_per_value": link.wire.bits,
        "reduction_vs_data_parallel": bandwidth.reduction_factor(dp_gbps, need),
      }
    )
    lines.append(
      f"{name}: {need:8.3f} Gbit/s (deadline {link.deadline_gbps:.3f}, sustained "
      f"{link.sustained_gbps:.3f}), {bandwidth.reduction_factor(dp_gbps, need):6.1f}x less"
    )
  with open(os.path.join(workdir, "bandwidth.json"), "w") as f:
    json.dump(out, f, indent=1)
  _plot_bandwidth(study, os.path.join(workdir, "bandwidth.png"))
  print("\n".join(lines))
  return out


def _plot_bandwidth(study: BandwidthStudy, path: str) -> None:
  plt = _pyplot()
  gbps = np.logspace(-2, 3, 400)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.plot(gbps, 100 * study.data_parallel.utilization(gbps), label="data-parallel")
  for name, link in study.diloco:
    ax.plot(gbps, 100 * link.utilization(gbps), label=name)
  ax.axhline(100 * study.utilization, color="grey", lw=0.8, ls="--")
  ax.set_xscale("log")
  ax.set_xlabel("bandwidth between sites (Gbit/s per direction)")
  ax.set_ylabel("compute utilization (%)")
  ax.set_ylim(0, 101)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="lower right")
  ax.set_title("utilization against bandwidth")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
