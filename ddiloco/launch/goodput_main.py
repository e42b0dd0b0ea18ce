r"""`ddiloco-goodput`: fleet-scale goodput simulator, bandwidth and syncer capacity models (docs/algorithm.md §7).

  ddiloco-goodput --workdir=/tmp/goodput --gin_file=gin_configs/goodput/paper_table.gin
  ddiloco-goodput --workdir=/tmp/bandwidth --gin_file=gin_configs/goodput/bandwidth.gin
  ddiloco-goodput --workdir=/tmp/capacity --gin_file=gin_configs/goodput/syncer_capacity.gin
  ddiloco-goodput --workdir=/tmp/goodput --gin_file=gin_configs/goodput/paper_table.gin \
      --gin.goodput.Fleet.chip_mtbi_hours=4380

Writes config.gin, goodput.json / goodput.png (one record per system and chip count),
bandwidth.json / bandwidth.png and capacity.json to --workdir. The simulator and the models are plain Python in
ddiloco.goodput (what to run is `goodput.experiment`, ddiloco/goodput/report.py); gin binds them
here only (registered in launch/configurables.py).
"""

from collections.abc import Sequence

from absl import app, flags

from ddiloco.goodput import capacity
from ddiloco.goodput import report as goodput_report
from ddiloco.launch import cli, gin_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.", required=True)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from ddiloco.launch import configurables

  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    goodput_study, bandwidth_study, capacity_study = configurables.configured(
      goodput_report.experiment
    )()
  workdir = cli.make_workdir(_WORKDIR.value, config_text)
  if goodput_study is not None:
    goodput_report.run_goodput_study(goodput_study, workdir)
  if bandwidth_study is not None:
    goodput_report.run_bandwidth_study(bandwidth_study, workdir)
  if capacity_study is not None:
    capacity.run_capacity_study(capacity_study, workdir)


def run() -> None:
  """Console-script entry point (`ddiloco-goodput`)."""
  cli.run(main, prog="ddiloco-goodput", module=__name__)


if __name__ == "__main__":
  run()
