"""`RayConfig.check_job`: a fixed syncer port must leave room for every shard's gRPC and bulk ports."""

import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch.job import JobConfig
from ddiloco.launch.ray_config import RayConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig


def _job(shards: int, bulk_port: int = 0) -> JobConfig:
  run = RunConfig(
    num_learners=2,
    model=configs.transformer_config("tiny", vocab_size=256, max_len=8),
    data=text_data.TextDataConfig(seq_len=8, batch_size=8),
    schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
    service=ServiceConfig(bulk_port=bulk_port),
  )
  return JobConfig(run=run, syncer_shards=shards)


@pytest.mark.parametrize(
  ("syncer_port", "bulk_port", "shards"),
  [(0, 9000, 3), (9000, 0, 3), (9000, 9003, 3), (9003, 9000, 3), (9000, 9001, 1), (65534, 0, 2)],
)
def test_ports_that_fit_and_do_not_meet_are_taken(syncer_port, bulk_port, shards):
  RayConfig(syncer_port=syncer_port).check_job(_job(shards, bulk_port))


@pytest.mark.parametrize(("syncer_port", "bulk_port"), [(9000, 9001), (9002, 9000), (9000, 9000)])
def test_ranges_that_meet_are_refused(syncer_port, bulk_port):
  with pytest.raises(ValueError, match="the two ranges meet"):
    RayConfig(syncer_port=syncer_port).check_job(_job(3, bulk_port))


def test_a_syncer_port_whose_shards_would_pass_65535_is_refused():
  with pytest.raises(ValueError, match="syncer_port=65534 with syncer_shards=3"):
    RayConfig(syncer_port=65534).check_job(_job(3))
