"""`ddiloco-simulate`: run Decoupled DiLoCo on a simulated cluster (virtual clock, real steps).

  ddiloco-simulate --gin_file=gin_configs/sim_tiny.gin --workdir=/tmp/sim \
      --gin.RunConfig.num_learners=8
"""

import os
import sys

from absl import app, flags

from ddiloco.launch import cli, gin_flags, sim_env  # noqa: F401 - sim_env: before numpy, jax.

_WORKDIR = flags.DEFINE_string("workdir", None, "output folder", required=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from ddiloco.launch import configurables  # After flags and XLA_FLAGS: it imports jax.
  from ddiloco.metrics.writer import HEADLINE_KEYS
  from ddiloco.simulation.simulate import simulate

  with cli.bad_config():
    config_text = gin_flags.parse_gin()
  started = False

  def start() -> None:  # simulate() checked its arguments: from here on errors are the run's.
    nonlocal started
    started = True
    cli.make_workdir(_WORKDIR.value, config_text, remote_ok=True)

  try:
    summary = configurables.configured(simulate)(
      workdir=_WORKDIR.value,
      progress=lambda line: print(line, file=sys.stderr, flush=True),
      on_start=start,
    )
  except (ValueError, TypeError) as e:
    if started:
      raise
    raise app.UsageError(cli.describe_config_error(e)) from e
  print("summary:", {k: summary[k] for k in HEADLINE_KEYS})
  print(f"wrote {os.path.join(_WORKDIR.value, 'summary.json')}")


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-simulate", module=__name__)


if __name__ == "__main__":
  run()
