"""Tests for the JSONL/TensorBoard writer and summary.json."""

import json
import os

import numpy as np

from ddiloco.metrics import writer


def test_events_round_trip_and_summary(tmp_path):
  with writer.MetricsWriter(str(tmp_path)) as w:
    w.event("train", time=1.5, loss=np.float32(2.5), weights=np.array([1.0, 2.0]))
    w.event("eval", time=2.0, loss=float("nan"))
    w.scalars(3, {"loss": 1.0})
  events = writer.read_events(str(tmp_path))
  assert events[0] == {"kind": "train", "time": 1.5, "loss": 2.5, "weights": [1.0, 2.0]}
  assert writer.read_events(str(tmp_path), "eval")[0]["loss"] == "nan"
  assert os.listdir(tmp_path / "tb")
  path = writer.write_summary(str(tmp_path), {"goodput": np.float64(0.5)})
  with open(path) as f:
    assert json.load(f) == {"goodput": 0.5}
