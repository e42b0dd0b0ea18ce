r"""`ddiloco-goodput`: fleet-scale goodput simulator, bandwidth and syncer capacity models (docs/algorithm.md §7).

  ddiloco-goodput --workdir=/tmp/goodput --gin_file=gin_configs/goodput/paper_table.gin
  ddiloco-goodput --workdir=/tmp/bandwidth --gin_file=gin_configs/goodput/bandwidth.gin
  ddiloco-goodput --workdir=/tmp/capacity --gin_file=gin_configs/goodput/syncer_capacity.gin
  ddiloco-goodput --workdir=/tmp/goodput --gin_file=gin_configs/goodput/paper_table.gin \
      --gin.goodput.Fleet.chip_mtbi_hours=4380

Writes config.gin, goodput.json / goodput.png (one record per system and chip count),
bandwidth.json / bandwidth.png and capacity.json to --workdir. The simulator and the models are plain Python in
ddiloco.simulation; gin binds them here only.
"""

from collections.abc import Sequence

import gin
from absl import app, flags

from ddiloco.goodput import bandwidth, capacity
from ddiloco.goodput import model as goodput_model
from ddiloco.goodput import report as goodput_report
from ddiloco.launch import cli, gin_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.", required=True)

for _cls in (
  goodput_model.RecoveryDelay,
  goodput_model.Fleet,
  goodput_model.Costs,
  goodput_model.DataParallel,
  goodput_model.DecoupledDiLoCo,
  goodput_model.Scavenging,
  goodput_report.GoodputStudy,
):
  gin.external_configurable(_cls, module="goodput")
for _cls in (
  bandwidth.Wire,
  bandwidth.DataParallelLink,
  bandwidth.DiLoCoLink,
  goodput_report.BandwidthStudy,
):
  gin.external_configurable(_cls, module="bandwidth")
for _cls in (capacity.SyncerCosts, capacity.SyncerLoad, capacity.CapacityStudy):
  gin.external_configurable(_cls, module="capacity")


@gin.configurable(module="goodput")
def experiment(
  *,
  goodput: goodput_report.GoodputStudy | None = None,
  bandwidth: goodput_report.BandwidthStudy | None = None,
  capacity: capacity.CapacityStudy | None = None,
) -> tuple[
  goodput_report.GoodputStudy | None,
  goodput_report.BandwidthStudy | None,
  capacity.CapacityStudy | None,
]:
  """What to run: a goodput study, a bandwidth study, a syncer capacity study, or several (bound
  in .gin files).

  Raises:
    ValueError: if none is configured.
  """
  if goodput is None and bandwidth is None and capacity is None:
    raise ValueError(
      "Configure goodput.experiment.goodput, goodput.experiment.bandwidth and/or "
      "goodput.experiment.capacity."
    )
  return goodput, bandwidth, capacity


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  with cli.bad_config():
    config_text = gin_flags.parse_gin()
    goodput_study, bandwidth_study, capacity_study = experiment()
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
