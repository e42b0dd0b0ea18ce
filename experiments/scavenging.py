"""Scavenging study: extra learners for part of the run; virtual time to the same loss.

gin_configs/studies/scavenging.gin is sim_tiny without crashes (4 learners, 96 steps each, 1 s per
step), evaluated every 8 virtual seconds. The scavenged row adds 4 learners (indices 4-7) that join
at t = 16 s and leave at t = 48 s; the token budget is the same, so the run ends earlier. A joining
learner loads the global model (docs/algorithm.md §6) and starts its own inner LR schedule from warm-up
(docs/algorithm.md, known limits). "Time to the same loss" is read off each eval curve, linearly
interpolated, at the higher of the two rows' final eval losses (the lowest loss both reach), and
at the baseline's final loss (which the scavenged row may not reach).

The paper (docs/algorithm.md §7): +100 % compute gives 0.75x the wall-clock time for Decoupled DiLoCo, where
data-parallel barely gains. Data-parallel is not elastic in the simulator (one learner), so it has
no row here.

Writes docs/results/scavenging.{md,png,json} and prints the command that reproduces them.

  python experiments/scavenging.py --seeds=0
"""

import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddiloco.launch import cli, configurables

from studylib import study

_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table, plot and per-seed JSON")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/scavenging", "run outputs")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds of every row")
_TIER = flags.DEFINE_enum("tier", "all", ["headline", "extra", "all", "report"], "what to run")
_BINDINGS = flags.DEFINE_multi_string("binding", [], "extra gin bindings for every run")

STUDY = "scavenging"
GIN = ("studies/scavenging.gin",)
JOIN_S, LEAVE_S, EXTRA = 16, 48, (4, 5, 6, 7)
SCAVENGED = tuple(f"join:{i}@{JOIN_S}" for i in EXTRA) + tuple(
  f"leave:{i}@{LEAVE_S}" for i in EXTRA
)


def systems() -> tuple[study.System, study.System]:
  base = study.System(name="M = 4", gin_files=GIN, bindings=tuple(_BINDINGS.value))
  faults = "(" + ", ".join(f"'{f}'" for f in SCAVENGED) + ",)"
  scav = study.System(
    name=f"M = 4 + 4 scavenged (t = {JOIN_S}-{LEAVE_S} s)",
    gin_files=GIN,
    bindings=(f"FAULTS = {faults}", *_BINDINGS.value),
  )
  return base, scav


def main(argv: list[str]) -> None:
  del argv
  cli.quiet_logs()  # gin's "Path not found" for each include it then finds on a search path.
  seeds = [int(s) for s in _SEEDS.value]
  study.enable_compilation_cache("workdirs/jax_cache")
  store = study.ResultStore(
    os.path.join(_OUT.value, f"{STUDY}.json"), resolve=configurables.resolved_config
  )
  plan = [(s, seeds) for s in systems()] if _TIER.value in ("headline", "all") else []
  study.run_grid(
    plan, store=store, workdir=_WORKDIR.value, simulate_files=configurables.simulate_files
  )
  report(store, seeds)


def _time_to(run: dict, target: float) -> float:
  """Virtual seconds until the eval loss first reaches `target` (curve starts at loss(t=0) = ∞)."""
  return study.interpolate_crossing([(t, loss) for t, _, loss in run["curve"]], target)


def _fmt(seconds: float) -> str:
  return "not reached" if math.isinf(seconds) else f"{seconds:.1f} s"


def report(store: study.ResultStore, seeds: list[int]) -> None:
  args = [f"--seeds={','.join(map(str, seeds))}", *[f"--binding={b}" for b in _BINDINGS.value]]
  cmd = study.reproduce_command("experiments/scavenging.py", args)
  base, scav = systems()
  rows, curves = [], {}
  for seed in seeds:
    b, s = store.get(base, seed), store.get(scav, seed)
    if b is None or s is None:
      rows.append([seed, *["not run"] * 8])
      continue
    common = max(b["final_eval_loss"], s["final_eval_loss"])
    tb, ts = _time_to(b, common), _time_to(s, common)
    tb_ref, ts_ref = _time_to(b, b["final_eval_loss"]), _time_to(s, b["final_eval_loss"])
    learner_s = [r["provisioned_learner_s"] for r in (b, s)]
    rows.append(
      [
        seed,
        f"{b['final_eval_loss']:.4f} / {s['final_eval_loss']:.4f}",
        f"{b['virtual_time_s']:.1f} s / {s['virtual_time_s']:.1f} s",
        f"{learner_s[0]:.0f} / {learner_s[1]:.0f}",
        f"{common:.4f}",
        f"{_fmt(tb)} / {_fmt(ts)}",
        f"{ts / tb:.3f}" if math.isfinite(ts) and tb > 0 else "–",
        f"{_fmt(tb_ref)} / {_fmt(ts_ref)}",
        f"{ts_ref / tb_ref:.3f}" if math.isfinite(ts_ref) and tb_ref > 0 else "–",
      ]
    )
    curves.setdefault(base.name, []).append(b)
    curves.setdefault(scav.name, []).append(s)
  headers = [
    "seed",
    "final eval loss (M = 4 / scavenged)",
    "virtual time to the budget",
    "provisioned learner-seconds",
    "common loss level",
    "time to common level",
    "ratio",
    "time to M = 4's final loss",
    "ratio",
  ]
  text = "\n".join(
    [
      "# Scavenging: extra learners for part of the run",
      "",
      "gin_configs/studies/scavenging.gin: 4 tiny learners (sim_tiny, no crashes), 96 steps",
      f"of 1 s, default settings. Scavenged: learners {EXTRA[0]}-{EXTRA[-1]} join at t = {JOIN_S} s",
      f"and leave at t = {LEAVE_S} s; same token budget. Times are virtual seconds read off",
      "eval curves (every 8 s),",
      "linearly interpolated. 'Common level' is the higher of the two final losses.",
      "",
      "Reproduce:",
      "",
      f"    {cmd}",
      "",
      study.markdown_table(headers, rows),
      "",
      f"![eval loss vs time]({STUDY}.png)",
    ]
  )
  fig, ax = plt.subplots(figsize=(7, 4.5))
  study.plot_curves(ax, curves, x="time")
  ax.axvspan(JOIN_S, LEAVE_S, color="grey", alpha=0.15, label="scavenged learners up")
  ax.set_title("Scavenging: eval loss vs virtual time")
  fig.tight_layout()
  study.publish(_OUT.value, STUDY, text, fig, cmd)


if __name__ == "__main__":
  app.run(main)
