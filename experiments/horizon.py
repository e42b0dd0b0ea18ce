"""What the parity gap is made of: the outer optimizer and the number of outer rounds.

At the tiny scale the parity study runs, every DiLoCo variant trails data-parallel by 8-10 % with
only 4 outer rounds per fragment. This study asks two questions on the dense text run file
(`sim_tiny.gin`, M = 4, P = H = 24, τ = 2), at equal tokens:

1. **Sweep:** synchronous DiLoCo's outer learning rate and momentum (Nesterov), at 8 rounds.
2. **Horizon:** data-parallel, synchronous DiLoCo and Decoupled DiLoCo with one crash (the run
   file's learner 2 down for 20 s) at R = 4, 8, 16 and 32 outer rounds per fragment (STEPS =
   24 R; the inner cosine schedule always decays over the whole run), default outer settings
   (0.7 / 0.9). Does the gap to data-parallel shrink with R, and does asynchrony cost anything
   against synchronous DiLoCo at the same R?
3. **Model size:** data-parallel and synchronous DiLoCo with the "small" model (14M parameters,
   `runs/sim_small.gin` with sim_tiny's data sizes) at the sweep's horizons (seed 0): does the gap
   shrink with the model?
4. **One replica:** synchronous DiLoCo with M = 1 (one learner with the whole global batch, on
   data-parallel's 4 devices, with the outer optimizer every H steps) at R = 8 and 32 (seed 0):
   what the outer optimizer alone costs or gains, apart from splitting the batch over M replicas.
5. **Mixing:** Decoupled DiLoCo with α = 0.5 instead of 0 at R = 8 (every seed) and at the longest
   horizon (seed 0): with α = 0 an applied merge overwrites the τ steps a learner trained since its
   answer.

Runs are ordered so that an interrupted study keeps whole rows: the sweep first (seed 0), then
each horizon for every seed, shortest first. Writes docs/results/horizon.{md,png,json} and prints
the command that reproduces them.

  python experiments/horizon.py --seeds=0,1,2
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import math

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddiloco.launch import configurables
from ddiloco.simulation import study

_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table, plot and per-seed JSON")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/horizon", "run outputs")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of the horizon rows")
_HORIZONS = flags.DEFINE_list("horizons", ["4", "8", "16", "32"], "outer rounds per fragment")
_TIER = flags.DEFINE_enum(
  "tier", "all", ["sweep", "horizon", "size", "all", "report"], "what to run"
)
_SIZE_HORIZONS = flags.DEFINE_list("size_horizons", ["4", "8"], "size: outer rounds per fragment")
_LRS = flags.DEFINE_list("outer_lrs", ["0.4", "0.7", "1.0"], "sweep: outer learning rates")
_MOMENTA = flags.DEFINE_list("outer_momenta", ["0.0", "0.5", "0.9"], "sweep: outer momenta")
_SWEEP_ROUNDS = flags.DEFINE_integer("sweep_rounds", 8, "sweep: outer rounds per fragment")

STUDY = "horizon"
PERIOD = 24  # H of sim_tiny.gin and of the DiLoCo baseline: STEPS = PERIOD x rounds.
METHODS = {
  "data-parallel": ("sim_tiny.gin", "baselines/data_parallel.gin"),
  "DiLoCo": ("sim_tiny.gin", "baselines/diloco.gin"),
  "Decoupled DiLoCo, 1 crash": ("sim_tiny.gin",),
}


# The small model on sim_tiny's data sizes and evaluation cadence, so only the model differs.
SMALL = (
  "SEQ_LEN = 64",
  "transformer_config.max_len = 64",
  "RunConfig.eval_every_s = 24.0",
  "RunConfig.log_every = 8",
)


MIXED = ("LearnerConfig.mixing_alpha = 0.5",)
# DiLoCo with one learner holding the whole global batch on data-parallel's devices.
ONE_REPLICA = ("LEARNERS = 1", "BATCH = 32", "ClusterConfig.devices_per_learner = 4")


def make_system(method: str, rounds: int, *bindings: str, model: str = "tiny") -> study.System:
  """`method` at `rounds` outer rounds per fragment, with extra `bindings` (named in the row)."""
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}.")
  suffix = "".join(f", {b}" for b in bindings)
  files = METHODS[method]
  prefix, extra = "", ()
  if model == "small":
    files = ("runs/sim_small.gin", *files[1:])
    prefix, extra = "small, ", SMALL
  elif model != "tiny":
    raise ValueError(f"model must be 'tiny' or 'small', got {model!r}.")
  return study.System(
    name=f"{prefix}R = {rounds}: {method}{suffix}",
    gin_files=files,
    bindings=(f"STEPS = {PERIOD * rounds}", *extra, *bindings),
  )


def sweep_system(lr: str, momentum: str) -> study.System:
  return make_system(
    "DiLoCo",
    _SWEEP_ROUNDS.value,
    f"SyncerConfig.outer_lr = {lr}",
    f"SyncerConfig.outer_momentum = {momentum}",
  )


def plan_for(seeds: list[int], horizons: list[int], tier: str) -> list:
  """The runs of `tier`, in order (see the module docstring)."""
  plan = []
  if tier in ("sweep", "all"):
    plan.append((make_system("data-parallel", _SWEEP_ROUNDS.value), seeds[:1]))
    for lr in _LRS.value:
      for momentum in _MOMENTA.value:
        plan.append((sweep_system(lr, momentum), seeds[:1]))
  if tier in ("horizon", "all"):
    for rounds in sorted(horizons):
      for seed in seeds:
        plan += [(make_system(method, rounds), [seed]) for method in METHODS]
  if tier in ("size", "all"):
    for rounds in (8, max(horizons)):
      plan.append((make_system("DiLoCo", rounds, *ONE_REPLICA), seeds[:1]))
      plan.append(
        (
          make_system("Decoupled DiLoCo, 1 crash", rounds, *MIXED),
          seeds if rounds == 8 else seeds[:1],
        )
      )
    for rounds in sorted(int(r) for r in _SIZE_HORIZONS.value):
      for method in ("data-parallel", "DiLoCo"):
        plan.append((make_system(method, rounds, model="small"), seeds[:1]))
  return plan


def main(argv: list[str]) -> None:
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  horizons = [int(r) for r in _HORIZONS.value]
  study.enable_compilation_cache("workdirs/jax_cache")
  store = study.ResultStore(os.path.join(_OUT.value, f"{STUDY}.json"))
  if _TIER.value != "report":
    study.run_grid(
      plan_for(seeds, horizons, _TIER.value),
      store=store,
      workdir=_WORKDIR.value,
      simulate_files=configurables.simulate_files,
    )
  report(store, seeds, horizons)


def _losses(store: study.ResultStore, system: study.System, seeds: list[int]) -> dict[int, float]:
  return {s: r["final_eval_loss"] for s in seeds if (r := store.get(system, s))}


def _gap(values: dict[int, float], reference: dict[int, float]) -> str:
  rel = study.paired_relative_ci(values, reference)
  return rel.format(2, scale=100, unit=" %") if rel.n else "–"


def report(store: study.ResultStore, seeds: list[int], horizons: list[int]) -> None:
  args = [
    f"--seeds={','.join(map(str, seeds))}",
    f"--horizons={','.join(map(str, horizons))}",
    f"--size_horizons={','.join(_SIZE_HORIZONS.value)}",
  ]
  cmd = study.reproduce_command("experiments/horizon.py", args)
  parts = [
    "# The parity gap against the outer optimizer and the number of outer rounds",
    "",
    "Dense text (`sim_tiny.gin`: tiny transformer, M = 4, P = H = 24, τ = 2, RDA), equal tokens",
    "per row: data-parallel takes the whole global batch on one learner. R is the number of outer",
    "rounds per fragment (STEPS = 24 R); the inner cosine schedule decays over the whole run.",
    "DiLoCo is synchronous (P = 1, K = M, no overlap, no faults); Decoupled DiLoCo runs the run",
    "file as is (K = 1 + grace, learner 2 down for 20 s). Gaps are paired by seed; mean ± 95 %",
    "t-interval over seeds.",
    "",
    "Reproduce:",
    "",
    f"    {cmd}",
  ]

  # Sweep.
  dp_sweep = _losses(store, make_system("data-parallel", _SWEEP_ROUNDS.value), seeds[:1])
  rows, best = [], None
  for lr in _LRS.value:
    for momentum in _MOMENTA.value:
      loss = _losses(store, sweep_system(lr, momentum), seeds[:1])
      if not loss:
        rows.append([lr, momentum, "not run", "–"])
        continue
      value = next(iter(loss.values()))
      if best is None or value < best[2]:
        best = (lr, momentum, value)
      rows.append([lr, momentum, f"{value:.4f}", _gap(loss, dp_sweep)])
  parts += [
    "",
    f"## Outer learning rate and momentum (synchronous DiLoCo, R = {_SWEEP_ROUNDS.value}, "
    f"seed {seeds[0]})",
    "",
    f"Data-parallel at the same budget: {_cell(dp_sweep)}.",
    "",
    study.markdown_table(["outer lr", "momentum", "final eval loss", "vs data-parallel"], rows),
  ]
  if best is not None:
    parts += ["", f"Best: outer lr {best[0]}, momentum {best[1]} ({best[2]:.4f})."]

  # Horizon.
  headers = [
    "R",
    "steps",
    "data-parallel",
    "DiLoCo",
    "DiLoCo vs data-parallel",
    "Decoupled, 1 crash",
    "Decoupled vs data-parallel",
    "Decoupled vs DiLoCo",
    "Decoupled goodput",
    "seeds",
  ]
  rows, gaps = [], {"DiLoCo": [], "Decoupled DiLoCo, 1 crash": []}
  curves = {}
  for rounds in sorted(horizons):
    dp = _losses(store, make_system("data-parallel", rounds), seeds)
    dl = _losses(store, make_system("DiLoCo", rounds), seeds)
    dd_system = make_system("Decoupled DiLoCo, 1 crash", rounds)
    dd = _losses(store, dd_system, seeds)
    goodput = [r["goodput"] for r in store.runs(dd_system, seeds)]
    rows.append(
      [
        rounds,
        PERIOD * rounds,
        _cell(dp),
        _cell(dl),
        _gap(dl, dp),
        _cell(dd),
        _gap(dd, dp),
        _gap(dd, dl),
        study.mean_ci(goodput).format(3) if goodput else "–",
        min(len(dp), len(dl), len(dd)),
      ]
    )
    for method, values in (("DiLoCo", dl), ("Decoupled DiLoCo, 1 crash", dd)):
      rel = study.paired_relative_ci(values, dp)
      if rel.n:
        gaps[method].append((rounds, rel))
    if rounds == max(horizons):
      for method in METHODS:
        runs = store.runs(make_system(method, rounds), seeds)
        if runs:
          curves[f"{method} (R = {rounds})"] = runs
  replica_rows = []
  for rounds in (8, max(horizons)):
    dp = _losses(store, make_system("data-parallel", rounds), seeds[:1])
    m1 = _losses(store, make_system("DiLoCo", rounds, *ONE_REPLICA), seeds[:1])
    m4 = _losses(store, make_system("DiLoCo", rounds), seeds[:1])
    replica_rows.append(
      [rounds, _cell(dp), _cell(m1), _gap(m1, dp), _cell(m4), _gap(m4, dp), _gap(m4, m1)]
    )
  mix_rows = []
  for rounds in (8, max(horizons)):
    dd5 = _losses(store, make_system("Decoupled DiLoCo, 1 crash", rounds, *MIXED), seeds)
    ran = sorted(dd5) or seeds[:1]  # The seeds of the α = 0.5 row, for every column.
    dl = _losses(store, make_system("DiLoCo", rounds), ran)
    dd0 = _losses(store, make_system("Decoupled DiLoCo, 1 crash", rounds), ran)
    mix_rows.append(
      [rounds, _cell(dl), _cell(dd0), _gap(dd0, dl), _cell(dd5), _gap(dd5, dl), len(dd5)]
    )
  size_rows = []
  for rounds in sorted(int(r) for r in _SIZE_HORIZONS.value):
    cells = [rounds]
    for model in ("tiny", "small"):
      dp = _losses(store, make_system("data-parallel", rounds, model=model), seeds[:1])
      dl = _losses(store, make_system("DiLoCo", rounds, model=model), seeds[:1])
      cells += [_cell(dp), _cell(dl), _gap(dl, dp)]
    size_rows.append(cells)
  parts += [
    "",
    "## Gap against the horizon (default outer settings 0.7 / 0.9)",
    "",
    study.markdown_table(headers, rows),
    "",
    f"![gap against rounds]({STUDY}.png)",
    "",
    f"## One replica against four (synchronous DiLoCo, 0.7 / 0.9, seed {seeds[0]})",
    "",
    "M = 1: one learner with the global batch (32 sequences) on data-parallel's devices, the outer",
    "optimizer every H = 24 steps; M = 4: the run file's four learners of 8 sequences each.",
    "",
    study.markdown_table(
      [
        "R",
        "data-parallel",
        "DiLoCo M = 1",
        "M = 1 vs data-parallel",
        "DiLoCo M = 4",
        "M = 4 vs data-parallel",
        "M = 4 vs M = 1",
      ],
      replica_rows,
    ),
    "",
    "## Overwrite or mix at the apply (Decoupled DiLoCo)",
    "",
    "α = 0 (the default) overwrites θ_p with the merged Θ_p, dropping the τ = 2 steps the learner",
    "trained on p since its answer; α = 0.5 keeps half of θ_p (θ_p ← α θ_p + (1 − α) Θ_p).",
    "",
    study.markdown_table(
      ["R", "DiLoCo", "Decoupled, α = 0", "vs DiLoCo", "Decoupled, α = 0.5", "vs DiLoCo", "seeds"],
      mix_rows,
    ),
    "",
    f"## Gap against the model size (synchronous DiLoCo, 0.7 / 0.9, seed {seeds[0]})",
    "",
    "tiny: 4 layers, d = 128, 1.1M parameters (sim_tiny.gin); small: 6 layers, d = 384, 14M; the same",
    "data sizes (M = 4, 8 sequences of 64 tokens per learner step).",
    "",
    study.markdown_table(
      [
        "R",
        "tiny data-parallel",
        "tiny DiLoCo",
        "tiny gap",
        "small data-parallel",
        "small DiLoCo",
        "small gap",
      ],
      size_rows,
    ),
  ]

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, (method, points) in enumerate(gaps.items()):
    if not points:
      continue
    xs = [r for r, _ in points]
    ys = [100 * g.mean for _, g in points]
    err = [0.0 if math.isnan(g.half_width) else 100 * g.half_width for _, g in points]
    axes[0].errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=f"C{i + 1}", label=method)
  axes[0].set_xscale("log", base=2)
  axes[0].axhline(0.0, color="C0", lw=1, label="data-parallel")
  axes[0].axhline(2.0, color="grey", lw=0.8, ls="--", label="2 % goal")
  axes[0].set_xlabel("outer rounds per fragment R")
  axes[0].set_ylabel("final eval loss vs data-parallel (%)")
  axes[0].grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  study.plot_curves(axes[1], curves, x="tokens")
  axes[1].set_title(f"R = {max(horizons)}")
  fig.tight_layout()
  study.publish(_OUT.value, STUDY, "\n".join(parts), fig, cmd)


def _cell(values: dict[int, float]) -> str:
  return study.mean_ci(list(values.values())).format(4) if values else "–"


if __name__ == "__main__":
  app.run(main)
