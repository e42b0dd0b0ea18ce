"""`JobConfig` and `RunConfig` refuse, at start, fleets the syncer's service settings cannot serve."""

import dataclasses

import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch.job import JobConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig


def _run(**service) -> RunConfig:
  return RunConfig(
    num_learners=2,
    model=configs.transformer_config("tiny", vocab_size=256, max_len=8),
    data=text_data.TextDataConfig(seq_len=8, batch_size=8),
    schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
    service=ServiceConfig(**service),
  )


def test_more_senders_than_the_syncer_lets_a_learner_stream_are_refused():
  # Each sender holds a push open and the puller a pull: 4 senders need 5 streams.
  JobConfig(run=_run(max_data_streams_per_learner=4), senders=3)
  with pytest.raises(ValueError, match="max_data_streams_per_learner=4 must be at least 5"):
    JobConfig(run=_run(max_data_streams_per_learner=4), senders=4)
  JobConfig(run=_run(max_data_streams_per_learner=5), senders=4)


def test_a_bulk_port_whose_shards_would_pass_65535_is_refused():
  # Shard i serves its bulk port on bulk_port + i.
  JobConfig(run=_run(bulk_port=65534), syncer_shards=2)
  with pytest.raises(ValueError, match="bulk_port=65534 with syncer_shards=3"):
    JobConfig(run=_run(bulk_port=65534), syncer_shards=3)


def test_a_fleet_larger_than_the_syncers_rounds_streams_is_refused():
  # Without the check a simulation stopped at its third learner's subscription with a Refusal,
  # and a distributed run's third learner was refused its Rounds stream while the others stayed.
  dataclasses.replace(_run(max_rounds_streams=2), num_learners=2)
  with pytest.raises(ValueError, match=r"num_learners=3 exceeds .*max_rounds_streams=2"):
    dataclasses.replace(_run(max_rounds_streams=2), num_learners=3)
  with pytest.raises(ValueError, match="max_members=2"):
    dataclasses.replace(_run(max_members=2), num_learners=3)
