"""The bring-your-own example (experiments/custom_task.py, docs/custom_tasks.md) keeps working.

A user's task is the one thing ddiloco asks for, so its example is tested as users run it: the
records it writes, the grain iterator (sharded, endless, restorable), a short simulated run that
learns, and its gin file building a distributed job.
"""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)  # `experiments` is imported as users run it, from the repository root.

from experiments import custom_task  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return custom_task.RecordsTask(data_dir=str(tmp_path_factory.mktemp("records")), batch_size=16)


def test_records_are_written_once(tmp_path):
  train, evaluation = custom_task.write_records(str(tmp_path), num_train=64, num_eval=16)
  stamps = [os.path.getmtime(p) for p in [*train, evaluation]]
  assert custom_task.write_records(str(tmp_path), num_train=64, num_eval=16) == (train, evaluation)
  assert [os.path.getmtime(p) for p in [*train, evaluation]] == stamps
  assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]


def test_shards_are_disjoint_and_restorable(task):
  def first(shard, n=6):
    it = task.make_train_iterator(shard_index=shard, num_shards=2)
    return it, [next(it) for _ in range(n)]

  it0, batches0 = first(0)
  _, batches1 = first(1)
  seen0 = {row.tobytes() for b in batches0 for row in b["inputs"]}
  seen1 = {row.tobytes() for b in batches1 for row in b["inputs"]}
  assert not seen0 & seen1  # Each learner reads its own examples.
  b = batches0[0]
  assert b["inputs"].shape == (16, custom_task.NUM_FEATURES) and b["inputs"].dtype == np.float32
  assert b["targets"].shape == (16,) and task.units_in_batch(b) == 16
  state = it0.get_state()  # What a learner checkpoint holds.
  expected = [next(it0) for _ in range(3)]
  fresh = task.make_train_iterator(shard_index=0, num_shards=2)
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])


def test_eval_batches_are_fixed(task):
  a, b = task.eval_batches(3), task.eval_batches(3)
  assert len(a) == 3
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])


def test_a_short_simulated_run_learns(tmp_path):
  summary = custom_task.run(str(tmp_path), steps=32, num_learners=2)
  import ddiloco

  evals = [e for e in ddiloco.read_events(str(tmp_path)) if e["kind"] == "eval"]
  assert summary["merges"] > 0 and summary["digests_agree"] is True
  assert evals[-1]["loss"] < evals[0]["loss"]
  assert evals[-1]["accuracy"] > 0.2  # Chance is 0.1.


def test_its_gin_file_builds_a_distributed_job(tmp_path):
  from ddiloco.launch import configurables
  from ddiloco.launch.job import JobConfig

  try:
    configurables.parse(
      [os.path.join(ROOT, "gin_configs", "examples", "custom_task.gin")],
      [f"RecordsTask.data_dir = '{tmp_path}'"],
      search_paths=[os.path.join(ROOT, "gin_configs")],
    )
    job = configurables.configured(JobConfig)()
  finally:
    configurables.clear()
  assert isinstance(job.run.the_task(), custom_task.RecordsTask)
  assert job.factory().layout.num_fragments == 4
  assert os.path.exists(os.path.join(tmp_path, "eval.array_record"))
