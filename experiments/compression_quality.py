"""Quality cost of compression on the wire: eval loss per codec over seeds, paired ratios.

The same simulated Decoupled DiLoCo run (the run file's model, fleet and fault schedule) with the
uplink and downlink codecs set to each codec in turn (`ServiceConfig.uplink_codec` /
`downlink_codec`): the syncer sees what the gRPC service would decode from θ − Θ^(anchor) and adopts
what learners decode from Θ_new − Θ_old, exactly as `ddiloco-syncer` does (docs/algorithm.md §5).

One seed cannot separate a 0.5 % effect from noise (fp32 and bf16 can differ by 0.2 % on one
seed), so every codec runs over seeds (parameter init, data shuffle and step-time jitter
together, `study.TEXT_SEEDS`) and the headline is the per-seed (paired) ratio int4 / bf16 with its
95 % Student-t interval. The goal is int4 within 0.5 % of bf16: "met" if the interval's upper
end is <= 1.005, "not met" if its lower end is > 1.005, "inconclusive" otherwise.

A codec entry is `UP[/DOWN][@BLOCK]`: "int4" is int4 both ways, "int4/bf16" int4 on the uplink
and bf16 on the downlink (which direction costs quality), "int4@32" int4 both ways with 32 values
per absmax scale (`ServiceConfig.block_size`, default 64).

Tiers: "headline" runs bf16 and int4 (the pair the goal is about), "extra" fp32 and int8 (context),
"all" both, "report" only rewrites the table from the store, "quick" is a smoke check (bf16 and
int4, a few steps, first seed; its store and table go under --workdir/quick, never into docs).
Runs are interleaved by seed, so an interrupted study leaves complete pairs. Per-seed results are
kept in docs/results/compression.json; a rerun skips what is stored.

Writes docs/results/compression.{md,png,json} and prints the command that reproduces them.

  python experiments/compression_quality.py --seeds=0,1,2 --tier=headline
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags

from ddiloco.launch import cli, configurables

from studylib import study
from studylib.codec_study import (
  CODECS,
  DEFAULT_BINDINGS,
  QUICK_BINDINGS,
  STUDY,
  codec_system,
  gin_relative,
  parse_codec,
  plan_for,
  ratio_figure,
  report_markdown,
)

_RUN = flags.DEFINE_string("run", "gin_configs/runs/sim_small.gin", "run gin file")
_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table, plot and per-seed JSON")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/compression", "run outputs")
_BINDINGS = flags.DEFINE_multi_string(
  "binding", list(DEFAULT_BINDINGS), "gin bindings for every run (replace the defaults)"
)
_CODECS = flags.DEFINE_list("codecs", list(CODECS), "codec entries UP[/DOWN][@BLOCK] to report")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of every codec")
_TIER = flags.DEFINE_enum(
  "tier", "all", ["quick", "headline", "extra", "all", "report"], "what to run"
)


def main(argv: list[str]) -> None:
  del argv
  cli.quiet_logs()  # gin's "Path not found" for each include it then finds on a search path.
  seeds = [int(s) for s in _SEEDS.value]
  specs = list(_CODECS.value)
  for spec in specs:
    parse_codec(spec)  # Fail on a typo before hours of runs.
  quick = _TIER.value == "quick"
  bindings = [*_BINDINGS.value, *(QUICK_BINDINGS if quick else ())]
  out = os.path.join(_WORKDIR.value, "quick") if quick else _OUT.value
  run_seeds = seeds[:1] if quick else seeds
  run_file = gin_relative(_RUN.value)
  systems = {s: codec_system(s, run_file=run_file, bindings=bindings) for s in specs}
  study.enable_compilation_cache("workdirs/jax_cache")
  store = study.ResultStore(
    os.path.join(out, f"{STUDY}.json"), resolve=configurables.resolved_config
  )
  # Seed-major order: after each seed every codec of the tier has a run, so pairs are complete.
  plan = [(systems[s], [seed]) for seed in run_seeds for s in plan_for(specs, _TIER.value)]
  study.run_grid(
    plan,
    store=store,
    workdir=os.path.join(_WORKDIR.value, "quick" if quick else ""),
    simulate_files=configurables.simulate_files,
  )
  runs = {
    spec: {seed: r for seed in run_seeds if (r := store.get(systems[spec], seed)) is not None}
    for spec in specs
  }
  args = [
    f"--run={_RUN.value}",
    *[f"--binding={b}" for b in _BINDINGS.value],
    f"--codecs={','.join(specs)}",
    f"--seeds={','.join(map(str, seeds))}",
    *(["--tier=quick"] if quick else []),
  ]
  cmd = study.reproduce_command("experiments/compression_quality.py", args)
  setup = f"Run file {run_file} (gin root gin_configs), bindings {', '.join(bindings)}."
  text = report_markdown(runs, command=cmd, setup=setup)
  fig = ratio_figure(
    {spec: {s: r["final_eval_loss"] for s, r in by.items()} for spec, by in runs.items()}
  )
  study.publish(out, STUDY, text, fig, cmd)


if __name__ == "__main__":
  app.run(main)
