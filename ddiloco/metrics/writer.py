"""Run outputs: `metrics.jsonl` (one JSON object per event), TensorBoard events, `summary.json`.

Every event carries a `kind` ("train", "eval", "merge", "fault", ...) and a `time` (seconds on the run's
clock: virtual in simulations, wall in distributed runs), so one file serves plots and audits alike.
"""

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter


def _plain(value: Any) -> Any:
  """Converts numpy/jax scalars and arrays to JSON-friendly Python values."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_plain(v) for v in value]
  if hasattr(value, "tolist"):
    return _plain(np.asarray(value).tolist())
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN/Inf; keep them visible rather than dropping them.
  return value


class MetricsWriter:
  """Appends events to `workdir/metrics.jsonl` and scalars to TensorBoard under `workdir/tb`.

  Args:
    workdir: output folder (created if missing).
    tensorboard: also write TensorBoard event files.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
    self._tb = SummaryWriter(os.path.join(workdir, "tb")) if tensorboard else None

  def event(self, kind: str, **fields: Any) -> None:
    """Writes one event line."""
    self._jsonl.write(json.dumps({"kind": kind, **_plain(fields)}) + "\n")

  def scalars(self, step: int, values: Mapping[str, float], *, prefix: str = "") -> None:
    """Writes TensorBoard scalars (no-op without TensorBoard)."""
    if self._tb is None:
      return
    for name, value in values.items():
      self._tb.add_scalar(f"{prefix}{name}", float(value), step)

  def flush(self) -> None:
    self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


# The summary keys the entry points print at the end (ddiloco-simulate, ddiloco-local).
HEADLINE_KEYS = (
  "final_eval_loss",
  "tokens_trained",
  "goodput",
  "global_downtime_s",
  "merges",
  "mean_quorum_size",
  "dropped_reports",
  "digests_agree",
  "wall_time_s",
)


def write_summary(workdir: str, summary: Mapping[str, Any]) -> str:
  """Writes `workdir/summary.json` atomically and returns its path."""
  path = os.path.join(workdir, "summary.json")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(_plain(summary), f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


def read_events(workdir: str, kind: str | None = None) -> list[dict[str, Any]]:
  """Reads `metrics.jsonl` back, optionally only events of one kind."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    events = [json.loads(line) for line in f if line.strip()]
  return [e for e in events if kind is None or e.get("kind") == kind]
