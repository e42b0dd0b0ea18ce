"""Tests of the sharded syncer's launcher side: the shard count's checks, `--shard_addresses`, the
shards' folders and final values, and the merged Status the launcher reads."""

import dataclasses
import os
import time

import grpc
import numpy as np
import pytest

from ddiloco.checkpoint.syncer import WorkdirMismatch
from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch import syncer_shards
from ddiloco.launch.job import JobConfig
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.transport.proto import syncer_pb2


def _run(slices: int = 1) -> RunConfig:
  return RunConfig(
    model=configs.transformer_config("tiny", vocab_size=256, max_len=8),
    data=text_data.TextDataConfig(seq_len=8, batch_size=8),
    schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1, slices=slices),
  )


def test_the_shard_count_sets_the_slices_of_every_fragment():
  # Every shard takes a slice of every fragment, so S may exceed P: 5 shards of 4 fragments.
  for shards in (1, 2, 5):
    job = JobConfig(run=_run(), syncer_shards=shards)
    schedule = job.run.the_schedule()
    assert (schedule.num_fragments, schedule.slices) == (4, shards)
    assert dataclasses.replace(schedule, slices=1) == _run().the_schedule()
  unsharded = JobConfig(run=_run())
  assert unsharded.run == _run()  # S = 1: the run as given.
  assert JobConfig(run=_run(slices=2), syncer_shards=2).run.the_schedule().slices == 2
  with pytest.raises(ValueError, match="syncer_shards=0"):
    JobConfig(run=_run(), syncer_shards=0)


@pytest.mark.parametrize(("slices", "shards"), [(2, 1), (2, 3), (3, 2)])
def test_slices_that_contradict_the_shard_count_are_refused(slices, shards):
  with pytest.raises(ValueError) as e:
    JobConfig(run=_run(slices=slices), syncer_shards=shards)
  assert str(e.value) == (
    f"FragmentSchedule.slices={slices} contradicts JobConfig.syncer_shards={shards}: slices "
    "follow the shard count; set only syncer_shards."
  )


def test_the_layout_of_a_sharded_job_has_a_slice_per_shard_of_every_fragment():
  unsharded = JobConfig(run=_run()).factory().layout
  sharded = JobConfig(run=_run(), syncer_shards=2).factory().layout
  assert (unsharded.num_fragments, sharded.num_fragments) == (4, 8)
  assert unsharded.digest == RunConfig.factory(_run()).layout.digest
  for p in range(4):  # Slices 2p and 2p + 1 hold fragment p's tensors, together and no more.
    leaves = {k.split("@")[0] for f in (2 * p, 2 * p + 1) for k in sharded.fragments[f]}
    assert leaves == {k.split("@")[0] for k in unsharded.fragments[p]}


def test_shard_addresses_must_name_every_shard():
  assert syncer_shards.parse_addresses("", 1) == ()
  assert syncer_shards.parse_addresses("a:1, b:2", 2) == ("a:1", "b:2")
  for text, num in (("", 2), ("a:1", 2), ("a:1,,c:3", 3), ("a:1,b:2", 1)):
    with pytest.raises(ValueError, match="--shard_addresses"):
      syncer_shards.parse_addresses(text, num)


def test_shard_folders_and_final_values(tmp_path):
  base = str(tmp_path / "syncer")
  assert syncer_shards.shard_workdir(base, 0) == base
  assert syncer_shards.shard_workdir(base, 2) == base + "_2"
  started = time.time() - 1.0
  one = syncer_shards.shard_workdir(base, 1)
  os.makedirs(one)
  values = {1: {"w": np.arange(3, dtype=np.float32)}, 3: {"v": np.ones(2, np.float32)}}
  syncer_shards.write_final_values(one, values, {1: 4, 3: 2})
  got = syncer_shards.read_final_values(base, [1], newer_than=started, timeout_s=0.0)
  assert set(got) == {1, 3}
  np.testing.assert_array_equal(got[1]["w"], values[1]["w"])
  # A file older than this start (a previous life's) is not taken.
  assert (
    syncer_shards.read_final_values(base, [1], newer_than=time.time() + 60, timeout_s=0.0) is None
  )


class _FakeClient:
  def __init__(self, status=None):
    self._status = status

  def status(self):
    if self._status is None:
      raise _Unavailable()
    return self._status

  def close(self):
    pass


class _Unavailable(grpc.RpcError):
  def code(self):
    return grpc.StatusCode.UNAVAILABLE


def _status(shard, versions, merges, alive, *, late, hist):
  return syncer_pb2.StatusResponse(
    versions=versions,
    merges=merges,
    alive=alive,
    counters={"late": late},
    quorum_histogram=hist,
    shard=shard,
    num_shards=2,
  )


def test_the_launcher_sees_the_shards_as_one_syncer():
  a = _status(0, [3, 0, 5, 0], 8, [0, 1], late=1, hist=[0, 2, 6])
  b = _status(1, [0, 4, 0, 2], 6, [1, 2], late=2, hist=[0, 6])
  merged = syncer_shards.ShardsStatus([_FakeClient(a), _FakeClient(b)])
  st = merged.status()
  assert list(st.versions) == [3, 4, 5, 2]  # Each fragment from its owner.
  assert st.merges == 14 and list(st.alive) == [0, 1, 2]
  assert st.counters["late"] == 3 and list(st.quorum_histogram) == [0, 8, 6]
  assert merged.shard_merges() == [8, 6]
  # A shard that is down: the other still answers; its fragments count at version 0.
  half = syncer_shards.ShardsStatus([_FakeClient(a), _FakeClient(None)])
  assert list(half.status().versions) == [3, 0, 5, 0]
  assert half.shard_merges() == [8, None]
  with pytest.raises(grpc.RpcError):
    syncer_shards.ShardsStatus([_FakeClient(None), _FakeClient(None)]).status()


def test_a_workdir_records_its_shard_and_refuses_another(tmp_path):
  workdir = str(tmp_path)
  assert not syncer_shards.check_workdir(workdir, 1, 2)  # Fresh: nothing recorded yet.
  syncer_shards.record_workdir(workdir, 1, 2)
  assert syncer_shards.check_workdir(workdir, 1, 2)
  for shard, num, theirs in ((0, 2, "syncer shard 0 of 2"), (1, 3, "syncer shard 1 of 3")):
    with pytest.raises(
      WorkdirMismatch, match=f"holds the state of syncer shard 1 of 2, not of {theirs}"
    ):
      syncer_shards.check_workdir(workdir, shard, num)
  with pytest.raises(WorkdirMismatch, match="not of an unsharded syncer"):
    syncer_shards.check_workdir(workdir, 0, 1)
  (tmp_path / syncer_shards.SHARD_FILE).write_text("{not json")
  with pytest.raises(WorkdirMismatch, match="unreadable"):
    syncer_shards.check_workdir(workdir, 1, 2)
