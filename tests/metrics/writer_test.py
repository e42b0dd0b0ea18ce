"""Tests for the JSONL/TensorBoard writer and summary.json."""

import json
import os

import numpy as np

from ddiloco.metrics import writer


def test_events_round_trip_and_summary(tmp_path):
  with writer.MetricsWriter(str(tmp_path)) as w:
    w.event("train", time=1.5, loss=np.float32(2.5), weights=np.array([1.0, 2.0]))
    w.event("eval", time=2.0, loss=float("nan"))
    w.scalars({"loss": 1.0}, tokens=3)
  events = writer.read_events(str(tmp_path))
  assert events[0] == {"kind": "train", "time": 1.5, "loss": 2.5, "weights": [1.0, 2.0]}
  assert writer.read_events(str(tmp_path), "eval")[0]["loss"] == "nan"
  assert os.listdir(tmp_path / "tb")
  path = writer.write_summary(str(tmp_path), {"goodput": np.float64(0.5)})
  with open(path) as f:
    assert json.load(f) == {"goodput": 0.5}


def test_scalars_read_back_on_tokens_with_a_steps_view(tmp_path):
  with writer.MetricsWriter(str(tmp_path)) as w:
    w.scalars({"learner_0/loss": 2.5}, tokens=512, step=1)
    w.scalars({"learner_0/loss": 2.0}, tokens=1024, step=2)
    w.scalars({"eval/loss": 2.25}, tokens=1024)
  scalars = writer.read_scalars(str(tmp_path))
  assert scalars["learner_0/loss"] == [(512, 2.5), (1024, 2.0)]
  assert scalars["steps/learner_0/loss"] == [(1, 2.5), (2, 2.0)]
  assert scalars["eval/loss"] == [(1024, 2.25)]
  assert "steps/eval/loss" not in scalars


def test_each_writer_gets_its_own_run_folder(tmp_path):
  with writer.MetricsWriter(str(tmp_path)) as first:
    first.scalars({"eval/loss": 3.0}, tokens=10)
  with writer.MetricsWriter(str(tmp_path)) as second:
    second.scalars({"eval/loss": 1.0}, tokens=10)
  assert sorted(os.listdir(tmp_path / "tb")) == ["run_000", "run_001"]
  assert first.tb_dir != second.tb_dir
  assert writer.read_scalars(first.tb_dir)["eval/loss"] == [(10, 3.0)]
  assert writer.read_scalars(second.tb_dir)["eval/loss"] == [(10, 1.0)]
  assert writer.MetricsWriter(str(tmp_path / "no_tb"), tensorboard=False).tb_dir is None
  assert not os.path.exists(tmp_path / "no_tb" / "tb")


def test_deferred_scalars_are_written_at_close(tmp_path):
  """A deferred writer runs no event writer during the run; its scalars all land at close."""
  w = writer.MetricsWriter(str(tmp_path), deferred=True)
  w.scalars({"learner_0/loss": 3.0}, tokens=64, step=1)
  w.scalars({"learner_0/loss": 2.5}, tokens=128, step=2)
  w.flush()
  assert writer.read_scalars(str(tmp_path)) == {}
  w.close()
  scalars = writer.read_scalars(str(tmp_path))
  assert scalars["learner_0/loss"] == [(64, 3.0), (128, 2.5)]
  assert scalars["steps/learner_0/loss"] == [(1, 3.0), (2, 2.5)]


def test_event_lines_reach_the_file_without_an_explicit_flush(tmp_path):
  # A process killed with SIGKILL never reaches flush/close: its lines must already be on disk.
  path = tmp_path / "metrics.jsonl"
  buffered = writer.MetricsWriter(str(tmp_path / "a"), tensorboard=False, flush_every_s=None)
  buffered.event("merge", version=1)
  assert (tmp_path / "a" / "metrics.jsonl").read_text() == ""  # Still in the write buffer.
  eager = writer.MetricsWriter(str(tmp_path), tensorboard=False, flush_every_s=0.0)
  eager.event("merge", version=1)
  assert json.loads(path.read_text())["version"] == 1
  buffered.close()
  eager.close()
