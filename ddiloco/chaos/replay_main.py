"""`ddiloco-replay`: replays a real chaos run's event tape on the simulated cluster.

  ddiloco-replay --tape=workdirs/chaos10/k1/chaos/tape.jsonl --gin_file=gin_configs/sim_tiny.gin \
      --workdir=workdirs/replay_k1

The tape's learner kills, restarts and pauses become simulator faults (ddiloco/chaos/replay.py), with
real seconds scaled so that a real learner step lasts one simulated step. Syncer kills and network
events have no simulator counterpart and are listed as skipped. Everything else (model, data, K, P,
H, τ) comes from the gin files, as for `ddiloco-simulate`. The real run's mean step time is read from
the learners' logged step times beside the tape unless `--real_step_time_s` is given. It prints the simulated
run's headline figures and writes them, with the replayed faults, to `<workdir>/summary.json`.
"""

import json
import os
import sys

from absl import app, flags

from ddiloco.launch import cli, gin_flags, sim_env  # noqa: F401 - sim_env: before numpy, jax.

_TAPE = flags.DEFINE_string("tape", None, "a chaos run's tape.jsonl", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output folder", required=True)
_STEP_TIME = flags.DEFINE_float(
  "real_step_time_s", None, "the real run's mean step time (default: from its learner summaries)"
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from ddiloco.chaos.replay import logged_step_time, replay
  from ddiloco.chaos.tape import read_tape
  from ddiloco.launch import configurables
  from ddiloco.metrics.writer import HEADLINE_KEYS
  from ddiloco.run_config import RunConfig
  from ddiloco.simulation.config import ClusterConfig
  from ddiloco.simulation.simulate import simulate

  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    run = configurables.configured(RunConfig)()
    fleet = configurables.configured(ClusterConfig)()  # The tape's faults replace its own.
    tape = read_tape(_TAPE.value)
    tape_dir = os.path.dirname(os.path.abspath(_TAPE.value))
    step_time = _STEP_TIME.value or logged_step_time(tape_dir)
  started = False

  def start() -> None:  # The replay's arguments were checked: from here on errors are the run's.
    nonlocal started
    started = True
    cli.make_workdir(_WORKDIR.value, config_text)

  try:
    summary = replay(
      tape,
      workdir=_WORKDIR.value,
      real_step_time_s=step_time,
      run=run,
      fleet=fleet,
      simulate_fn=configurables.configured(simulate),
      progress=lambda line: print(line, file=sys.stderr, flush=True),
      on_start=start,
    )
  except (ValueError, TypeError) as e:
    if started:
      raise
    raise app.UsageError(cli.describe_config_error(e)) from e
  plan = summary["replay"]
  print(f"replayed {len(plan['faults'])} faults (time scale {plan['time_scale']:.3f}):")
  print("  " + " ".join(plan["faults"]))
  print(f"skipped {len(plan['skipped'])} events without a simulator counterpart")
  if plan["outside_run"]:
    print(
      f"WARNING: {len(plan['outside_run'])} of the tape's faults fall after the simulated run ended "
      f"at {plan['end_s']:.1f} s and never fired: " + " ".join(plan["outside_run"])
    )
  print("summary:", {k: summary[k] for k in HEADLINE_KEYS})
  path = os.path.join(_WORKDIR.value, "summary.json")
  with open(path) as f:
    written = json.load(f)
  written["replay"] = plan
  with open(path, "w") as f:
    json.dump(written, f, indent=2)
  print(f"wrote {path}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-replay", module=__name__)


if __name__ == "__main__":
  run()
