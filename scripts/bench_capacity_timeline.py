"""scripts/bench_capacity.py's round timeline (`--timeline`): where a shard's round spends its time.

A shard started with `--timeline` wraps a few of its own functions (in its own process, for the
benchmark only) and logs, on the service's clock (time.monotonic), with the thread's CPU time and
the process's:

- `tick`: the step clock opened rounds (RoundPacer.tick);
- `conn`: a bulk push connection, from its hello to its answer sent (BulkServer._run);
- `decode`: a push's chunks read and decoded into its arrays (messages.chunks_to_report, in the
  handler's thread; the socket reads run in its read-ahead thread);
- `file`: the answer filed in the core (SyncerCore.report: the NaN check fused with RDA's norms),
  under the service's lock;
- `merge`: a round's close (RoundCloser.merge), and inside it `step` (the merge fused with the outer
  step, until its outputs are read), `adopt` (the downlink codec's adoption) and `summary` (digest
  and norm of the adopted values);
- `publish`: the merged version served (Publisher.publish: the adopter's cached messages, the
  announcement).

`rounds` turns them into one row per merged round of the measured windows: offsets from the
round's opening, and the process CPU spent between its opening and its publication.
"""

import threading
import time

import numpy as np

_EVENTS: list = []
_LOCK = threading.Lock()


def _log(kind: str, t0: float, t1: float, cpu: float, **info) -> None:
  with _LOCK:
    _EVENTS.append((kind, t0, t1, cpu, time.process_time(), info))


def _wrap(owner, name: str, kind: str, info=None) -> None:
  inner = getattr(owner, name)

  def timed(*args, **kwargs):
    t0, c0 = time.monotonic(), time.thread_time()
    try:
      return inner(*args, **kwargs)
    finally:
      extra = info(args, kwargs) if info is not None else {}
      _log(kind, t0, time.monotonic(), time.thread_time() - c0, **extra)

  setattr(owner, name, timed)


def install() -> None:
  """Wraps the shard's functions named in the module docstring (call before building it)."""
  from ddiloco.service import bulk_server, downlink, publication
  from ddiloco.syncer import blockwise, closing, core, pacing, updates
  from ddiloco.transport import messages

  def report_info(args, kwargs):
    r = args[1]
    return {"p": int(r.fragment), "learner": int(r.learner_id), "round": int(r.round_step)}

  _wrap(pacing.RoundPacer, "tick", "tick")
  _wrap(core.SyncerCore, "report", "file", report_info)
  _wrap(bulk_server.BulkServer, "_run", "conn")
  _wrap(messages, "chunks_to_report", "decode")
  _wrap(closing.RoundCloser, "merge", "merge", lambda a, k: {"p": int(a[1])})
  _wrap(updates.FragmentUpdater, "_merge_and_step", "step_dispatch")
  _wrap(downlink.DownlinkAdopter, "__call__", "adopt")
  _wrap(blockwise, "summarize", "summary")
  _wrap(publication.Publisher, "publish", "publish")
  # The fused step is asynchronous: its time runs until `updated` reads its outputs, i.e. until
  # the adoption starts; `rounds` takes merge start -> adopt start as "step".


def events() -> list:
  """Everything logged so far (JSON-able)."""
  with _LOCK:
    return [[*e[:5], e[5]] for e in _EVENTS]


def rounds(events_: list, merges: list, start: float, end: float, asks: list) -> list[dict]:
  """One row per round merged in [start, end): offsets (s) from its opening, CPU (s).

  `merges`: the shard's (fragment, time, open_time, quorum_time, contributors) rows; `asks`: the
  fleet's (shard, learner, time, fragment, round_step) of each round request it received (the
  same clock: CLOCK_MONOTONIC is the machine's).
  """
  by_kind: dict[str, list] = {}
  for e in events_:
    by_kind.setdefault(e[0], []).append(e)
  out = []
  for p, t_pub, t_open, _, n in merges:
    if not start <= t_pub < end:
      continue
    files = [e for e in by_kind.get("file", []) if e[5].get("p") == p and t_open <= e[1] <= t_pub]
    conns = [e[1] for e in by_kind.get("conn", []) if t_open <= e[1] <= t_pub]
    asked = [a[2] for a in asks if a[3] == p and t_open <= a[2] <= t_pub]
    decodes = [e for e in by_kind.get("decode", []) if t_open <= e[2] <= t_pub]
    merge = [e for e in by_kind.get("merge", []) if e[5].get("p") == p and e[1] <= t_pub <= e[2]]
    if not files or not merge:
      continue
    m = merge[0]
    inside = {
      k: [e for e in by_kind.get(k, []) if m[1] <= e[1] and e[2] <= m[2]]
      for k in ("adopt", "summary")
    }
    pub = [e for e in by_kind.get("publish", []) if e[1] >= m[2]]
    adopt = inside["adopt"][0] if inside["adopt"] else None
    # Process CPU at the round's opening: logged as the tick that opened it returned.
    ticks = [e for e in by_kind.get("tick", []) if e[1] <= t_open]
    cpu_open = max(ticks, key=lambda e: e[1])[4] if ticks else float("nan")
    last_pub = pub[0] if pub else m
    out.append(
      {
        "p": p,
        "answers": n,
        "last_asked": (max(asked) if asked else t_open) - t_open,
        "first_conn": (min(conns) if conns else t_open) - t_open,
        "last_conn": (max(conns) if conns else t_open) - t_open,
        "first_filed": min(e[2] for e in files) - t_open,
        "last_filed": max(e[2] for e in files) - t_open,
        "merge_start": m[1] - t_open,
        "step": (adopt[1] if adopt else m[2]) - m[1],
        "adopt": adopt[2] - adopt[1] if adopt else 0.0,
        "summary": sum(e[2] - e[1] for e in inside["summary"]),
        "merge": m[2] - m[1],
        "merge_cpu": m[3],
        "published": last_pub[2] - t_open,
        "decode_s": float(np.mean([e[2] - e[1] for e in decodes])) if decodes else 0.0,
        "decode_cpu": sum(e[3] for e in decodes) / max(len(decodes), 1),
        "file_s": float(np.mean([e[2] - e[1] for e in files])),
        "file_cpu": float(np.mean([e[3] for e in files])),
        "round_cpu": last_pub[4] - cpu_open,
      }
    )
  return out


_COLUMNS = (
  "last_asked",
  "first_conn",
  "last_conn",
  "first_filed",
  "last_filed",
  "merge_start",
  "step",
  "adopt",
  "summary",
  "merge",
  "published",
  "decode_s",
  "decode_cpu",
  "file_s",
  "file_cpu",
  "merge_cpu",
  "round_cpu",
)


def print_rounds(label: str, rows: list[dict]) -> None:
  """Medians and p90 of each column (ms) over `rows`."""
  if not rows:
    print(f"    {label}: no round with a full timeline")
    return
  med = " ".join(f"{c}={1e3 * np.median([r[c] for r in rows]):.0f}" for c in _COLUMNS)
  p90 = " ".join(
    f"{c}={1e3 * np.percentile([r[c] for r in rows], 90):.0f}"
    for c in ("last_filed", "merge", "published", "round_cpu")
  )
  print(f"    {label}, {len(rows)} rounds, median ms: {med}\n      p90 ms: {p90}")
