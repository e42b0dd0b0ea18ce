"""`LearnerFleet` without processes: which data slot an added learner reads (launch/elastic.py)."""

import logging

from ddiloco.data.text import TextDataConfig
from ddiloco.launch import elastic
from ddiloco.launch.job import JobConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig


def _fleet(tmp_path, data_slots: int) -> tuple[elastic.LearnerFleet, list[int]]:
  started = []
  fleet = elastic.LearnerFleet(
    workdir=str(tmp_path),
    num_learners=2,
    devices_per_learner=1,
    processes_per_learner=1,
    learners={},
    start_learner=lambda learner_id, **_: started.append(learner_id),
  )
  fleet.job = JobConfig(
    run=RunConfig(
      model=configs.transformer_config("tiny", max_len=16),
      data=TextDataConfig(seq_len=16, batch_size=4),
      num_learners=2,
      data_slots=data_slots,
    )
  )
  return fleet, started


def _joins(fleet) -> dict[int, tuple[int, bool]]:
  return {
    e["learner_id"]: (e["data_slot"], e["shares_data"])
    for e in fleet.membership
    if e["event"] == "join"
  }


def test_learners_added_within_the_data_slots_read_slots_of_their_own(tmp_path, caplog):
  fleet, started = _fleet(tmp_path, data_slots=4)
  with caplog.at_level(logging.WARNING):
    assert [fleet.add(), fleet.add()] == [2, 3]
  assert started == [2, 3]
  assert _joins(fleet) == {2: (2, False), 3: (3, False)}
  assert not caplog.records
  assert fleet.add() == 4  # Beyond the 4 slots: slot 0, learner 0's.
  assert _joins(fleet)[4] == (0, True)
  assert "reads data slot 0, which learner 0 reads too" in caplog.text


def test_by_default_a_learner_added_shares_a_starting_learners_slot(tmp_path, caplog):
  fleet, _ = _fleet(tmp_path, data_slots=0)
  assert fleet.job.run.the_data_slots() == 2
  with caplog.at_level(logging.WARNING):
    assert fleet.add() == 2
  assert _joins(fleet) == {2: (0, True)}
  assert "set RunConfig.data_slots above 2" in caplog.text


def test_the_learners_data_is_cut_into_the_slots(tmp_path):
  fleet, _ = _fleet(tmp_path, data_slots=4)
  assert fleet.job.run.factory().num_shards == 4  # Learner i reads slot i mod 4.
