"""Run outputs: `metrics.jsonl` (one JSON object per event), TensorBoard events, `summary.json`.

Every event carries a `kind` ("train", "eval", "merge", "fault", ...) and a `time` (seconds on the run's
clock: virtual in simulations, wall in distributed runs), so one file serves plots and audits alike.

TensorBoard scalars share one x-axis, tokens trained (`scalars(..., tokens=)`): the fleet's in a
simulation; in a distributed run the syncer's writer counts the tokens the fleet reported and each
learner's its own. Per-learner curves also appear under `steps/` against the learner's step. Each
writer opens a new run folder, `<workdir>/tb/run_000`, `run_001`, ...: a second run (or a restarted
process) in the same workdir never appends to the first one's curves. Events are written with
tensorboardX (no TensorFlow); `tensorboard --logdir <workdir>` shows them.

The workdir may be an object store path (gs://...): the appended files are then written to a local
staging folder and copied up as they grow and at `close` (ddiloco/storage.py).
"""

import glob
import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter

from ddiloco import storage


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


TB_DIR = "tb"


def quantiles(samples: Mapping[str, Any]) -> dict[str, dict[str, float]]:
  """{name: {"p50", "p90"}} of each non-empty sequence of samples (seconds, rounded to 0.1 ms)."""
  out = {}
  for name, values in samples.items():
    v = np.asarray(values, dtype=np.float64)
    if v.size:
      out[name] = {
        "p50": round(float(np.median(v)), 4),
        "p90": round(float(np.quantile(v, 0.9)), 4),
      }
  return out


def new_run_dir(workdir: str, *, first: int = 0) -> str:
  """Creates and returns the next free `workdir/tb/run_NNN`, NNN >= `first` (mkdir is atomic: no
  two writers share)."""
  root = os.path.join(workdir, TB_DIR)
  os.makedirs(root, exist_ok=True)
  n = max(first, len(glob.glob(os.path.join(root, "run_*"))))
  while True:
    path = os.path.join(root, f"run_{n:03d}")
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      n += 1


class MetricsWriter:
  """Appends events to `workdir/metrics.jsonl` and scalars to TensorBoard under `workdir/tb/run_NNN`.

  Args:
    workdir: output folder (created if missing); a local path or an object store URI.
    tensorboard: also write TensorBoard event files, in a new run folder (`tb_dir`).
    deferred: keep the TensorBoard scalars in memory and write them at `close`, with no event
      writer (and its thread) alive before. A learner process uses it: with tensorboardX's writer
      thread running beside its training, sender and receiver threads, 10 % of its answers to
      rounds took 6-9 s instead of under 0.5 s on 2 cores (measured with the main job), and missed
      their rounds.
    sync_every_s: with an object store workdir, the least time between two copies of the growing
      files (at `flush`); `close` copies the rest.
    flush_every_s: event lines reach the file at most this long after they are written (checked
      at each event), so a process killed with SIGKILL loses at most that much of its log; None
      leaves them to `flush`/`close`.
  """

  def __init__(
    self,
    workdir: str,
    *,
    tensorboard: bool = True,
    deferred: bool = False,
    sync_every_s: float = 30.0,
    flush_every_s: float | None = 1.0,
  ):
    self.workdir = workdir
    self._flush_every_s = flush_every_s
    self._last_flush = time.monotonic()
    self._mirror: storage.Mirror | None = None
    local, first_run = workdir, 0
    if storage.is_remote(workdir):
      self._mirror = storage.Mirror(workdir, names=("metrics.jsonl",), every_s=sync_every_s)
      local = self._mirror.local
      first_run = len(storage.glob(storage.join(workdir, TB_DIR), "run_*"))
    os.makedirs(local, exist_ok=True)
    self._jsonl = open(os.path.join(local, "metrics.jsonl"), "a")  # noqa: SIM115
    self._tb_local = new_run_dir(local, first=first_run) if tensorboard else None
    # Where the events end up (the object store's folder for a remote workdir).
    self.tb_dir = self._tb_local
    if self._mirror is not None and self._tb_local is not None:
      self.tb_dir = storage.join(workdir, os.path.relpath(self._tb_local, local))
    self._deferred: list[tuple[str, float, int]] | None = (
      [] if deferred and self._tb_local else None
    )
    self._tb = (
      SummaryWriter(self._tb_local, flush_secs=10)
      if self._tb_local and self._deferred is None
      else None
    )

  def event(self, kind: str, **fields: Any) -> None:
    """Writes one event line."""
    self._jsonl.write(json.dumps({"kind": kind, **_plain(fields)}) + "\n")
    if self._flush_every_s is not None:
      now = time.monotonic()
      if now - self._last_flush >= self._flush_every_s:
        self._jsonl.flush()
        self._last_flush = now

  def scalars(self, values: Mapping[str, float], *, tokens: int, step: int | None = None) -> None:
    """Writes TensorBoard scalars at x = `tokens`; with `step`, also as `steps/<tag>` at x = step.

    A no-op without TensorBoard; non-finite values are written as they are (TensorBoard shows them).
    """
    points = []
    for tag, value in values.items():
      points.append((tag, float(value), int(tokens)))
      if step is not None:
        points.append((f"steps/{tag}", float(value), int(step)))
    if self._deferred is not None:
      self._deferred.extend(points)
    elif self._tb is not None:
      for tag, value, x in points:
        self._tb.add_scalar(tag, value, x)

  def flush(self) -> None:
    self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()
    if self._mirror is not None:
      self._mirror.sync()  # Throttled.

  def close(self) -> None:
    self._jsonl.close()
    if self._deferred:
      self._tb = SummaryWriter(self._tb_local, flush_secs=10)
      for tag, value, x in self._deferred:
        self._tb.add_scalar(tag, value, x)
      self._deferred = []
    if self._tb is not None:
      self._tb.close()
    if self._mirror is not None:
      self._mirror.close()

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
  path = storage.join(workdir, "summary.json")
  storage.write_text(path, json.dumps(_plain(summary), indent=2, sort_keys=True))
  return path


def read_events(workdir: str, kind: str | None = None) -> list[dict[str, Any]]:
  """Reads `metrics.jsonl` back, optionally only events of one kind."""
  text = storage.read_text(storage.join(workdir, "metrics.jsonl"))
  events = [json.loads(line) for line in text.splitlines() if line.strip()]
  return [e for e in events if kind is None or e.get("kind") == kind]


def read_event_lines(path: str) -> list[dict[str, Any]]:
  """Every event of a metrics.jsonl file, over all the incarnations that appended to it; a torn
  line (a process SIGKILLed mid-write) is skipped."""
  events = []
  with open(path) as f:
    for line in f:
      try:
        events.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return events


def read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
  """TensorBoard scalars under `path` (a workdir or one run folder), read back with TensorBoard's
  own event reader: {tag: [(x, value), ...]} in the order written, runs in name order."""
  from tensorboard.backend.event_processing import event_accumulator

  out: dict[str, list[tuple[int, float]]] = {}
  files = glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True)
  for folder in sorted({os.path.dirname(f) for f in files}):
    acc = event_accumulator.EventAccumulator(folder, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
      out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
  return out
