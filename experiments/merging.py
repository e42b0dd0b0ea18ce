"""Merging study: RDA vs plain weighted mean for M = 4, 8, 16; wire codecs fp32 to int4.

gin_configs/studies/merging.gin is sim_tiny without faults. Every row has the same global batch (32
sequences) and token budget: M learners with 32 / M sequences each. Merge rows differ only in
`SyncerConfig.merge_rule` (docs/algorithm.md §4.5; RDA keeps the update norm from shrinking like 1/√M when
outer gradients are near-orthogonal). Codec rows are the M = 4 RDA row with both the uplink (θ −
Θ^(anchor)) and the downlink (Θ_new − Θ_old) in one codec (docs/algorithm.md §5; the paper: int4 costs ≈ 0.1 %).

Writes docs/results/merging.{md,png,json} and prints the command that reproduces them.

  python experiments/merging.py --seeds=0
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddiloco.fragments.compression import CODECS
from ddiloco.launch import cli, configurables

from studylib import study

_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table, plot and per-seed JSON")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/merging", "run outputs")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds of every row")
_TIER = flags.DEFINE_enum("tier", "all", ["headline", "extra", "all", "report"], "what to run")
_ROWS = flags.DEFINE_list("rows", [], "run only the rows of these names (all if empty)")
_BINDINGS = flags.DEFINE_multi_string("binding", [], "extra gin bindings for every run")

STUDY = "merging"
GIN = ("studies/merging.gin",)
GLOBAL_BATCH = 32
FLEETS = (4, 8, 16)
METHODS = ("rda", "mean")
# Each method's merge rule, as gin names it (the rows keep the methods' names).
RULES = {"rda": "@RDA()", "mean": "@WeightedMean()"}


def merge_system(m: int, method: str) -> study.System:
  return study.System(
    name=f"{method} M = {m}",
    gin_files=GIN,
    bindings=(
      f"LEARNERS = {m}",
      f"BATCH = {GLOBAL_BATCH // m}",
      f"SyncerConfig.merge_rule = {RULES[method]}",
      *_BINDINGS.value,
    ),
  )


def codec_system(codec: str) -> study.System:
  if codec == "fp32":  # The M = 4 RDA row itself (the simulator's fp32 path is exact).
    return merge_system(4, "rda")
  base = merge_system(4, "rda")
  return study.System(
    name=f"{codec} (rda M = 4)",
    gin_files=GIN,
    bindings=(
      *base.bindings,
      f"ServiceConfig.uplink_codec = '{codec}'",
      f"ServiceConfig.downlink_codec = '{codec}'",
    ),
  )


def main(argv: list[str]) -> None:
  del argv
  cli.quiet_logs()  # gin's "Path not found" for each include it then finds on a search path.
  seeds = [int(s) for s in _SEEDS.value]
  study.enable_compilation_cache("workdirs/jax_cache")
  store = study.ResultStore(
    os.path.join(_OUT.value, f"{STUDY}.json"), resolve=configurables.resolved_config
  )
  plan = []
  if _TIER.value in ("headline", "all"):  # Cheapest first: M = 16 steps 4x as many learners.
    plan += [(merge_system(4, method), seeds) for method in METHODS]
    plan.append((codec_system("int4"), seeds))
    plan += [(merge_system(8, method), seeds) for method in METHODS]
    plan += [(codec_system(c), seeds) for c in ("bf16", "int8")]
  if _TIER.value in ("extra", "all"):
    plan += [(merge_system(16, method), seeds) for method in METHODS]
  if _ROWS.value:
    plan = [(system, s) for system, s in plan if system.name in _ROWS.value]
  study.run_grid(
    plan, store=store, workdir=_WORKDIR.value, simulate_files=configurables.simulate_files
  )
  report(store, seeds)


def _loss(store: study.ResultStore, system: study.System, seeds: list[int]) -> dict[int, float]:
  return {s: r["final_eval_loss"] for s in seeds if (r := store.get(system, s))}


def report(store: study.ResultStore, seeds: list[int]) -> None:
  args = [f"--seeds={','.join(map(str, seeds))}", *[f"--binding={b}" for b in _BINDINGS.value]]
  cmd = study.reproduce_command("experiments/merging.py", args)
  merge_rows, curves = [], {}
  for m in FLEETS:
    rda, mean = merge_system(m, "rda"), merge_system(m, "mean")
    rda_loss, mean_loss = _loss(store, rda, seeds), _loss(store, mean, seeds)
    gap = study.paired_relative_ci(mean_loss, rda_loss)
    extra = [store.runs(s, seeds) for s in (rda, mean)]
    merge_rows.append(
      [
        m,
        GLOBAL_BATCH // m,
        study.mean_ci(list(rda_loss.values())).format(4) if rda_loss else "not run",
        study.mean_ci(list(mean_loss.values())).format(4) if mean_loss else "not run",
        gap.format(2, scale=100, unit=" %") if gap.n else "–",
        " / ".join(
          f"{study.mean_ci([r['merges'] for r in e]).mean:.0f}" if e else "–" for e in extra
        ),
        " / ".join(
          f"{study.mean_ci([r['mean_quorum_size'] for r in e]).mean:.2f}" if e else "–"
          for e in extra
        ),
      ]
    )
    for system, runs in zip((rda, mean), extra, strict=True):
      if runs:
        curves[system.name] = runs
  fp32 = _loss(store, codec_system("fp32"), seeds)
  codec_rows = []
  for codec in CODECS:
    loss = _loss(store, codec_system(codec), seeds)
    rel = study.paired_relative_ci(loss, fp32)
    codec_rows.append(
      [
        codec,
        study.mean_ci(list(loss.values())).format(4) if loss else "not run",
        rel.format(2, scale=100, unit=" %") if rel.n else "–",
        len(loss),
      ]
    )
  text = "\n".join(
    [
      "# Merging: RDA vs weighted mean, and compression on the wire",
      "",
      "gin_configs/studies/merging.gin: sim_tiny's tiny model, no faults, global batch 32",
      "sequences of 64 bytes (M learners x 32 / M), 96 steps, token budget 196,608 for every",
      "row; default settings otherwise (K = 1 + grace, P = H = 24, τ = 2, outer Nesterov",
      "0.7 / 0.9). Mean ± 95 %",
      "t-interval where there are several seeds; relative gaps are paired by seed.",
      "",
      "Reproduce:",
      "",
      f"    {cmd}",
      "",
      "## RDA vs plain weighted mean (docs/algorithm.md §4.5)",
      "",
      study.markdown_table(
        [
          "M",
          "batch / learner",
          "RDA eval loss",
          "mean eval loss",
          "mean vs RDA",
          "merges (RDA / mean)",
          "mean quorum (RDA / mean)",
        ],
        merge_rows,
      ),
      "",
      "## Codecs, both directions (docs/algorithm.md §5), M = 4, RDA",
      "",
      study.markdown_table(["codec", "eval loss", "vs fp32", "seeds"], codec_rows),
      "",
      f"![eval loss]({STUDY}.png)",
    ]
  )
  fig, ax = plt.subplots(figsize=(7, 4.5))
  study.plot_curves(ax, curves, x="tokens")
  ax.set_title("RDA vs weighted mean (equal global batch and tokens)")
  fig.tight_layout()
  study.publish(_OUT.value, STUDY, text, fig, cmd)


if __name__ == "__main__":
  app.run(main)
