"""Core parity study: data-parallel vs DiLoCo vs Streaming DiLoCo vs Decoupled DiLoCo at equal tokens.

Every system is the same code (`simulate`) with a baseline gin file stacked on the run file, so the
token budget, model, data and inner optimizer are identical. Decoupled DiLoCo runs with the run
file's fault schedule (one learner crash); the baselines run without faults.

Writes docs/results/core_parity.md (table) and docs/results/core_parity.png (eval loss vs tokens),
and prints the command that reproduces them.

  python experiments/core_parity.py --run=gin_configs/runs/sim_small.gin --out=docs/results
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import sys
import time

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddiloco.launch import configurables
from ddiloco.metrics.writer import read_events

_RUN = flags.DEFINE_string("run", "gin_configs/runs/sim_small.gin", "run gin file")
_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table and the plot")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/core_parity", "run outputs")
_BINDINGS = flags.DEFINE_multi_string("binding", [], "extra gin bindings for every system")
_ONLY = flags.DEFINE_list("only", [], "run only these systems")

SYSTEMS = {
  "data-parallel": "gin_configs/baselines/data_parallel.gin",
  "DiLoCo (P=1, K=M)": "gin_configs/baselines/diloco.gin",
  "Streaming DiLoCo (P=3, K=M, α=0.5)": "gin_configs/baselines/streaming_diloco.gin",
  "Decoupled DiLoCo (K=1+grace, 1 crash)": None,
}


def _slug(name: str) -> str:
  return name.split(" (", maxsplit=1)[0].lower().replace(" ", "_").replace("-", "_")


def run_system(name: str, baseline: str | None) -> dict:
  files = [_RUN.value] + ([baseline] if baseline else [])
  workdir = os.path.join(_WORKDIR.value, _slug(name))
  t0 = time.time()
  summary = configurables.simulate_files(
    files,
    _BINDINGS.value,
    search_paths=["gin_configs"],
    workdir=workdir,
    progress=lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True),
  )
  summary["elapsed_s"] = time.time() - t0
  summary["workdir"] = workdir
  return summary


def main(argv: list[str]) -> None:
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  results_path = os.path.join(_WORKDIR.value, "results.json")
  results = {}
  if os.path.exists(results_path):
    with open(results_path) as f:
      results = json.load(f)
  for name, baseline in SYSTEMS.items():
    if _ONLY.value and _slug(name) not in _ONLY.value:
      continue
    results[name] = run_system(name, baseline)
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(results_path, "w") as f:
      json.dump(results, f, indent=2, default=str)
  write_report(results)


def write_report(results: dict) -> None:
  ref = results.get("data-parallel", {}).get("final_eval_loss")
  cmd = f"python experiments/core_parity.py --run={_RUN.value} --out={_OUT.value}" + "".join(
    f" --binding='{b}'" for b in _BINDINGS.value
  )
  lines = [
    "# Core parity: eval loss at equal tokens",
    "",
    f"Run file `{_RUN.value}`; reproduce with:",
    "",
    f"    {cmd}",
    "",
    "| system | final eval loss | vs data-parallel | tokens | goodput | merges | mean quorum |"
    " dropped | wall time |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, s in results.items():
    rel = f"{100 * (s['final_eval_loss'] / ref - 1):+.2f} %" if ref else "n/a"
    lines.append(
      f"| {name} | {s['final_eval_loss']:.4f} | {rel} | {s['tokens_trained']:,} | "
      f"{s['goodput']:.3f} | {s['merges']} | {s['mean_quorum_size']:.2f} | "
      f"{s['dropped_reports']} | {s['wall_time_s']:.0f} s |"
    )
  with open(os.path.join(_OUT.value, "core_parity.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, s in results.items():
    evals = read_events(s["workdir"], "eval")
    ax.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], marker="o", label=name)
  ax.set_xlabel("tokens trained")
  ax.set_ylabel("held-out loss (global model)")
  ax.set_title("Equal-token comparison")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(_OUT.value, "core_parity.png"), dpi=120)
  print("\n".join(lines))
  print(f"\nreproduce: {cmd}")


if __name__ == "__main__":
  app.run(main)
