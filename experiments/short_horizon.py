"""Outer optimizers at the README's short horizons: are the shipped defaults safe with few outer steps?

The scaling table (experiments/scaling_table.py) picks outer settings at 192 outer steps per
fragment. A default must hold at every horizon, and the README's runs are short: the simulated
quick start (`sim_tiny.gin`, 96 steps: 4 outer steps per fragment at H = 24) and the main job's
length (`local_tiny.gin`, 240 steps: 10). This study runs `sim_tiny.gin` as shipped (Decoupled
DiLoCo, M = 4, P = H = 24, τ = 2, K = 1 + grace, learner 2 down for 20 s) at both lengths with
each candidate outer optimizer, against data-parallel at the same tokens, on one held-out set of
512 windows; gaps are paired by seed. The candidates merge by RDA, the default when they ran, but
the last, the shipped default, which merges by the weighted mean (experiments/scaling_table.py).

  python experiments/short_horizon.py --seeds=0,1,2 --candidates=old,plain,warmup20
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags

from ddiloco.launch import cli, configurables

from studylib import study

_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table and JSON")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/short_horizon", "run outputs")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds")
_STEPS = flags.DEFINE_list("steps", ["96", "240"], "run lengths (inner steps per learner)")
_CANDIDATES = flags.DEFINE_list("candidates", None, "candidates to run (default: all)")
_TIER = flags.DEFINE_enum("tier", "all", ["all", "report"], "run what is missing, or only report")

STUDY = "short_horizon"
COMMON = (
  "ClusterConfig.devices_per_learner = 1",  # One core per run: 4 fake devices only add waits.
  "RunConfig.eval_batches = 16",
  "RunConfig.eval_batch_size = 32",
  "RunConfig.eval_every_s = 24.0",
)


def _sgd(lr: float, momentum: float) -> tuple[str, ...]:
  return (
    "SyncerConfig.outer_optimizer = @outer/optax.sgd",
    f"outer/optax.sgd.learning_rate = {lr}",
    f"outer/optax.sgd.momentum = {momentum}",
    "outer/optax.sgd.nesterov = True",
  )


def _warmup(lr: float, momentum: float, steps: int, lr0: float | None = None) -> tuple[str, ...]:
  return (
    "SyncerConfig.outer_optimizer = @outer/nesterov_warmup",
    f"outer/nesterov_warmup.learning_rate = {lr}",
    f"outer/nesterov_warmup.momentum = {momentum}",
    f"outer/nesterov_warmup.warmup_steps = {steps}",
    # Bound either way: the run files ramp the learning rate from 0.7, None keeps it constant.
    f"outer/nesterov_warmup.initial_learning_rate = {lr0}",
  )


CANDIDATES = {
  "old": _sgd(0.7, 0.9),
  "plain": _sgd(1.0, 0.0),
  "0.7/0.5": _sgd(0.7, 0.5),
  "0.4/0.9": _sgd(0.4, 0.9),
  "1.0/0.9": _sgd(1.0, 0.9),
  "warmup20": _warmup(0.7, 0.9, 20),
  "warmup50": _warmup(0.7, 0.9, 50),
  "1.0 warmup20": _warmup(1.0, 0.9, 20),
  "0.4 warmup20": _warmup(0.4, 0.9, 20),
  "0.7 to 0.4 warmup20": _warmup(0.4, 0.9, 20, lr0=0.7),
  "0.7 to 0.4 warmup20 mean": (
    *_warmup(0.4, 0.9, 20, lr0=0.7),
    "SyncerConfig.merge_rule = @WeightedMean()",
  ),
}


DESCRIPTIONS = {
  "old": "Nesterov, lr 0.7, momentum 0.9 (DiLoCo's)",
  "plain": "plain averaging (SGD lr 1.0, no momentum)",
  "0.7/0.5": "Nesterov, lr 0.7, momentum 0.5",
  "0.4/0.9": "Nesterov, lr 0.4, momentum 0.9",
  "1.0/0.9": "Nesterov, lr 1.0, momentum 0.9",
  "warmup20": "Nesterov, lr 0.7, momentum 0.9 ramped over 20 outer steps",
  "warmup50": "Nesterov, lr 0.7, momentum 0.9 ramped over 50 outer steps",
  "1.0 warmup20": "Nesterov, lr 1.0, momentum 0.9 ramped over 20 outer steps",
  "0.4 warmup20": "Nesterov, lr 0.4, momentum 0.9 ramped over 20 outer steps",
  "0.7 to 0.4 warmup20": "Nesterov, momentum 0.9 ramped and lr from 0.7 to 0.4 over 20 outer steps",
  "0.7 to 0.4 warmup20 mean": "the same, merged by the weighted mean: the shipped default",
}


def data_parallel(steps: int) -> study.System:
  return study.System(
    name=f"{steps} steps: data-parallel",
    gin_files=("sim_tiny.gin", "baselines/data_parallel.gin"),
    bindings=(f"STEPS = {steps}", *COMMON),
  )


def decoupled(steps: int, candidate: str) -> study.System:
  """A candidate's run, merged by RDA unless it binds its own rule (RDA was the default when
  those rows ran; the weighted mean is now)."""
  bindings = CANDIDATES[candidate]
  rule = () if any("merge_rule" in b for b in bindings) else ("SyncerConfig.merge_rule = @RDA()",)
  return study.System(
    name=f"{steps} steps: Decoupled DiLoCo, outer {candidate}",
    gin_files=("sim_tiny.gin",),
    bindings=(f"STEPS = {steps}", *COMMON, *bindings, *rule),
  )


def report(store: study.ResultStore, seeds: list[int], steps_list: list[int]) -> None:
  headers = ["outer optimizer", *(f"{s} steps vs data-parallel" for s in steps_list)]
  rows = []
  for name in CANDIDATES:
    cells = [DESCRIPTIONS[name]]
    for steps in steps_list:
      ref = {s: r["final_eval_loss"] for s in seeds if (r := store.get(data_parallel(steps), s))}
      got = {s: r["final_eval_loss"] for s in seeds if (r := store.get(decoupled(steps, name), s))}
      gap = study.paired_relative_ci(got, ref)
      cells.append(gap.format(2, scale=100, unit=" %") if gap.n else "–")
    rows.append(cells)
  dp = [
    f"{steps} steps: "
    + study.mean_ci([r["final_eval_loss"] for r in store.runs(data_parallel(steps), seeds)]).format(
      4
    )
    for steps in steps_list
  ]
  parts = [
    "# Outer optimizers at short horizons (sim_tiny.gin as shipped)",
    "",
    "Decoupled DiLoCo (M = 4, P = H = 24, τ = 2, K = 1 + grace, one crash), merged by RDA unless",
    "the row says otherwise, against data-parallel at equal tokens; gaps paired by seed (mean ±",
    "95 % t-interval). The shipped default is the last row. Data-parallel: " + "; ".join(dp),
    "",
    study.markdown_table(headers, rows),
  ]
  cmd = study.reproduce_command(
    "experiments/short_horizon.py",
    [f"--seeds={','.join(map(str, seeds))}", f"--steps={','.join(map(str, steps_list))}"],
  )
  parts += ["", f"Reproduce: `{cmd}`"]
  path = study.write_report(_OUT.value, STUDY, "\n".join(parts))
  print("\n".join(parts))
  print(f"\nwrote {path}")


def main(argv: list[str]) -> None:
  del argv
  cli.quiet_logs()  # gin's "Path not found" for each include it then finds on a search path.
  seeds = [int(s) for s in _SEEDS.value]
  steps_list = [int(s) for s in _STEPS.value]
  names = _CANDIDATES.value or list(CANDIDATES)
  store = study.ResultStore(
    os.path.join(_OUT.value, f"{STUDY}.json"), resolve=configurables.resolved_config
  )
  if _TIER.value != "report":
    study.enable_compilation_cache("workdirs/jax_cache")
    plan = []
    for steps in steps_list:
      plan.append((data_parallel(steps), seeds))
      plan += [(decoupled(steps, name), seeds) for name in names]
    study.run_grid(
      plan, store=store, workdir=_WORKDIR.value, simulate_files=configurables.simulate_files
    )
  report(store, seeds, steps_list)


if __name__ == "__main__":
  app.run(main)
