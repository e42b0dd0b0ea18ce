"""The chaos run's event tape: an append-only JSONL file of what was injected and what was observed.

One JSON object per line, each with `t` (seconds since the run started, on one clock for every
event) and `kind`. The driver writes; `ddiloco.chaos.invariants` and `ddiloco.chaos.replay` read.

Kinds and their fields (extra fields are allowed and kept):
  injected (ddiloco.faults.KINDS), as executed, with real times (`TapeWriter.record_event`):
    learner (learner kinds), shard (a syncer or network event aimed at one shard of a sharded
    syncer), the event's params, `scheduled_t` (the planned time).
  observed (`shard`: the syncer shard it comes from or is about, 0 for an unsharded syncer; a
  record without one is about shard 0):
    run_start / run_end       the observation window (invariants measure gaps up to run_end).
    merge                     fragment, version, contributors (list), tokens (int), digest (str,
                              optional): copied from the syncer's metrics.jsonl "merge" events
                              (launch/runtime.py SyncerRun._on_merge), with `t` on the tape's clock;
                              shard.
    learner_up / learner_down learner (process state; learner_down may carry a `reason`).
    learner_done              learner, step (its final step), target (the step it had to reach).
    syncer_up / syncer_down   a syncer (shard) process's state: shard, optional `port`.
    final_digests             role ("learner" | "syncer"), learner (for a learner), shard (for a
                              syncer shard), digests:
                              {"<fragment>": {"version": int, "digest": str}}, the newest version
                              of each fragment that holder has.
    ledger                    role ("learner" | "syncer"), learner or shard; a learner's trained,
                              merged, dropped, in_flight, a syncer shard's received, merged,
                              dropped, pending: token counts (ints).
    eval                      loss (optional `final`: true for the end-of-run evaluation).
    proxy_traffic             what a proxy forwarded over the run: shard, port ("control", the
                              gRPC port, or "data", the bulk port), bytes_up, bytes_down,
                              connections, resets.

Durability: each record is one `write` of a whole line followed by a flush, so a SIGKILL of the
driver loses at most the line being written; `read_tape` ignores such a truncated last line, and a
new `TapeWriter` on the same file cuts it off before appending.
"""

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ddiloco import storage
from ddiloco.faults import KINDS as INJECTED_KINDS
from ddiloco.faults import FaultEvent

log = logging.getLogger(__name__)

OBSERVED_KINDS = (
  "run_start",
  "run_end",
  "merge",
  "learner_up",
  "learner_down",
  "learner_done",
  "syncer_up",
  "syncer_down",
  "final_digests",
  "ledger",
  "eval",
  "syncer_restore",  # A restarted syncer (shard)'s restore: the merges its checkpoint lacked.
  "syncer_recovery",  # A lost version handed back by a learner, or republished without; shard.
  "proxy_traffic",
)
TAPE_KINDS = INJECTED_KINDS + OBSERVED_KINDS


def _json_default(x: Any) -> Any:
  """numpy scalars and arrays (what metrics often carry) as plain JSON values."""
  if isinstance(x, np.generic | np.ndarray):
    return x.tolist()
  if isinstance(x, tuple | set | frozenset):
    return list(x)
  raise TypeError(f"Not JSON-serialisable on the tape: {type(x).__name__} {x!r}")


class TapeWriter:
  """Appends events to a JSONL tape; thread-safe; usable as a context manager.

  Args:
    path: the tape file; created if missing, appended to otherwise (after cutting a partial line).
    clock: returns seconds; `record` without `t` uses clock() − t0, t0 being clock() at
      construction. With clock=time.time, a wall time w from another process's metrics (the
      syncer's "merge" time) is at t = w − t0 on this tape.
  """

  def __init__(self, path: str | os.PathLike, *, clock: Callable[[], float] = time.monotonic):
    self.path = os.fspath(path)
    storage.cut_partial_line(self.path)
    self._clock = clock
    self.t0 = clock()
    self._lock = threading.Lock()
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close().

  def now(self) -> float:
    """Seconds since this writer was created (the default `t` of a record)."""
    return self._clock() - self.t0

  def record(self, kind: str, *, t: float | None = None, **fields: Any) -> dict[str, Any]:
    """Appends one event and flushes it.

    Args:
      kind: one of TAPE_KINDS.
      t: seconds since the run started (default: `now()`).
      **fields: the kind's fields (module docstring); JSON-serialisable, numpy allowed.

    Returns:
      The record as written.

    Raises:
      ValueError: for an unknown kind or a closed writer.
    """
    if kind not in TAPE_KINDS:
      raise ValueError(f"Unknown tape kind {kind!r}; expected one of {TAPE_KINDS}.")
    rec = {"t": round(float(self.now() if t is None else t), 6), "kind": kind, **fields}
    line = json.dumps(rec, default=_json_default) + "\n"
    with self._lock:
      if self._file.closed:
        raise ValueError(f"The tape {self.path} is closed.")
      self._file.write(line)  # One write of the whole line, then out of our buffer at once.
      self._file.flush()
    return rec

  def record_event(self, event: FaultEvent, *, t: float | None = None, **fields: Any) -> dict:
    """Records an injected schedule event as executed at `t` (its planned time is `scheduled_t`)."""
    extra = {} if event.learner is None else {"learner": event.learner}
    extra.update({} if event.shard is None else {"shard": event.shard})
    return self.record(
      event.kind, t=t, scheduled_t=event.t, **extra, **dict(event.params), **fields
    )

  def close(self) -> None:
    with self._lock:
      self._file.close()

  def __enter__(self) -> "TapeWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_tape(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads a tape, in file order.

  A last line without its newline that does not parse (a writer killed mid-line) is ignored.

  Raises:
    ValueError: for a malformed line anywhere else, or a record without `t` and `kind`.
  """
  with open(path, encoding="utf-8") as f:
    text = f.read()
  lines = text.split("\n")
  out = []
  for i, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines):  # No newline after it: a truncated last line.
        log.warning("Ignoring the truncated last line of %s: %r", path, line[:80])
        continue
      raise ValueError(f"{path}:{i}: malformed tape line: {e}") from e
    if not isinstance(rec, dict) or "t" not in rec or "kind" not in rec:
      raise ValueError(f"{path}:{i}: a tape record needs 't' and 'kind': {line[:80]!r}")
    out.append(rec)
  return out
