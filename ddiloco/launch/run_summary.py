"""The summary of a `LocalCluster` run: summary.json (the keys of `ddiloco-simulate`) and loss.png.

`summarize` merges the syncer's and the learners' own summaries (plus the fleet's membership events,
for elastic runs) into the run's summary.json; `plot` draws each learner's loss over time with the
merge events. `ddiloco-local` calls both at the end of a run (launch/local_cluster.py).
"""

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ddiloco.launch import syncer_shards
from ddiloco.launch.job import JobConfig
from ddiloco.metrics.writer import read_event_lines, write_summary

# What a syncer summary holds before the syncer wrote one (a run interrupted while it started).
_NO_SYNCER = {
  "final_eval_loss": float("nan"),
  "initial_eval_loss": float("nan"),
  "merges": 0,
  "mean_quorum_size": 0.0,
  "stats": {},
  "bytes_up": 0,
  "bytes_down": 0,
  "digests": {},
  "refused": {},
  "quorum_size_counts": {},
  "uplink_codec": None,
  "downlink_codec": None,
  "evals": [],
  "merge_times": [],
  "num_params": None,
}


def read_json(path: str) -> dict:
  """A JSON file's content (a process's summary.json)."""
  with open(path) as f:
    return json.load(f)


def _syncer_summary(workdir: str, shard: int = 0) -> dict:
  """A syncer's (shard's) summary, its digests completed from its merge journal: a restarted
  syncer's summary lists only what it published since, and learners may hold older versions."""
  from ddiloco.checkpoint.journal import JOURNAL_NAME, read_journal_records  # Imports jax.

  folder = syncer_shards.shard_workdir(os.path.join(workdir, "syncer"), shard)
  path = os.path.join(folder, "summary.json")
  out = {**_NO_SYNCER, **read_json(path)} if os.path.exists(path) else dict(_NO_SYNCER)
  digests = dict(out["digests"])
  for p, versions in read_journal_records(os.path.join(folder, JOURNAL_NAME)).items():
    for v, digest in versions.items():
      if digest is not None:
        digests.setdefault(f"{p}:{v}", digest)
  out["digests"] = digests
  return out


def _mean_quorum(syncers: Sequence[dict]) -> float:
  """The mean quorum size over every shard's merges."""
  merges = sum(s["merges"] for s in syncers)
  return sum(s["mean_quorum_size"] * s["merges"] for s in syncers) / merges if merges else 0.0


def _shards(syncers: Sequence[dict], applies: Sequence[tuple[int, int, str]]) -> list[dict]:
  """Per syncer shard: its merges, its digest checks (the learners' applies of its fragments
  against its published digests) and whether its token ledger balances."""
  out = []
  for shard, syncer in enumerate(syncers):
    mine = [(p, v, d) for p, v, d in applies if p % len(syncers) == shard]
    ledger = syncer.get("token_ledger") or {}
    totals = [ledger.get(k, 0) for k in ("received", "merged", "dropped", "pending")]
    out.append(
      {
        "merges": syncer["merges"],
        "digest_checks": len(mine),
        "digests_agree": bool(mine)
        and all(d and syncer["digests"].get(f"{p}:{v}") == d for p, v, d in mine),
        "ledger_balanced": bool(ledger) and totals[0] == sum(totals[1:]),
        "final_versions": {
          p: v
          for p, v in enumerate(syncer["stats"].get("versions") or [])
          if p in syncer.get("owned", ())
        },
        "recovery": syncer.get("recovery"),
        "restarted": syncer.get("restored") is not None,
      }
    )
  return out


def summarize(
  workdir: str,
  job: JobConfig,
  *,
  num_learners: int,
  wall_time_s: float,
  learner_ids: Sequence[int] | None = None,
  membership: Sequence[dict[str, Any]] | None = None,
  syncer_alive_at_end: Sequence[int] | None = None,
  interrupted: bool = False,
) -> dict:
  """The run's summary.json from the syncer's and learners' summaries (the keys of simulate).

  Args:
    workdir: the run's folder.
    job: its config (the token budget).
    num_learners: M; the learners read are 0..M-1 unless `learner_ids` says otherwise.
    wall_time_s: the run's duration.
    learner_ids: every learner of the fleet, added ones included.
    membership: the fleet's events (`elastic.LearnerFleet.membership`: join, leave, finish,
      fail), kept as is.
    syncer_alive_at_end: the syncer's `alive` learners just before it was stopped.
    interrupted: the run was stopped by Ctrl-C: a partial run, never "ok" (the processes that had
      not written their summaries yet count as empty).
  """
  syncers = [_syncer_summary(workdir, i) for i in range(job.syncer_shards)]
  syncer = syncers[0]
  learners = {}
  for i in range(num_learners) if learner_ids is None else learner_ids:
    path = os.path.join(workdir, f"learner_{i}", "summary.json")
    if os.path.exists(path):
      learners[i] = read_json(path)
  digests = {k: d for s in syncers for k, d in s["digests"].items()}  # Each its own fragments'.
  applies = [(p, v, d) for s in learners.values() for p, v, d in s["applies"]]
  agree = bool(applies) and all(d and digests.get(f"{p}:{v}") == d for p, v, d in applies)
  agree = agree and all(s["digest_mismatches"] == 0 for s in learners.values())
  busy = sum(s["train_time_s"] for s in learners.values())
  provisioned = sum(s["train_end"] - s["start_time"] for s in learners.values())
  spans = sorted((s["train_start"], s["train_end"]) for s in learners.values())
  downtime, reach = 0.0, spans[0][1] if spans else 0.0
  for start, end in spans[1:]:
    downtime += max(0.0, start - reach)
    reach = max(reach, end)
  tokens = sum(s["tokens"] for s in learners.values())
  push = {}
  for s in learners.values():
    for k, n in s["push_status"].items():
      push[k] = push.get(k, 0) + n
  summary = {
    "final_eval_loss": syncer["final_eval_loss"],
    "initial_eval_loss": syncer["initial_eval_loss"],
    "tokens_trained": tokens,
    "goodput": busy / provisioned if provisioned > 0 else 0.0,
    "global_downtime_s": downtime,
    "merges": sum(s["merges"] for s in syncers),
    "mean_quorum_size": _mean_quorum(syncers),
    "dropped_reports": sum(int(s["stats"].get("late", 0)) for s in syncers),
    "bytes_up": sum(s["bytes_up"] for s in syncers),
    "bytes_down": sum(s["bytes_down"] for s in syncers),
    "wall_time_s": wall_time_s,
    "virtual_time_s": wall_time_s,  # Real processes: virtual time is wall time.
    "digests_agree": agree,
    "digest_checks": len(applies),
    "token_budget": job.run.token_budget(),
    "budget_reached": tokens >= job.run.token_budget(),
    "stalled": False,
    "learners": {
      str(i): {
        "steps": s["steps"],
        "tokens": s["tokens"],
        "step_time_s": s["step_time_s"],
        "push_status": s["push_status"],
        "applies": len(s["applies"]),
        "zero_weight_pushes": s.get("zero_weight_pushes", 0),
        "bytes_up": s["bytes_up"],
        "bytes_down": s["bytes_down"],
        "final_loss": s["losses"][-1][2] if s["losses"] else None,
      }
      for i, s in learners.items()
    },
    "push_status": push,
    "syncer": {
      k: syncer[k]
      for k in ("stats", "refused", "quorum_size_counts", "uplink_codec", "downlink_codec")
    },
    "evals": syncer["evals"],
    "num_params": syncer["num_params"],
    "membership": list(membership or []),
    "syncer_alive_at_end": None if syncer_alive_at_end is None else list(syncer_alive_at_end),
    "interrupted": interrupted,
  }
  if len(syncers) > 1:
    summary["shards"] = _shards(syncers, applies)
  summary["ok"] = bool(
    agree
    and summary["budget_reached"]
    and np.isfinite(summary["final_eval_loss"])
    and not interrupted
  )
  write_summary(workdir, summary)
  return summary


def plot(workdir: str, *, interrupted: bool = False) -> str | None:
  """loss.png: training loss over time per learner, the global eval loss, and merge events (the
  title says when the run was interrupted). None, with a warning, without matplotlib (the
  `plots` extra)."""
  try:
    import matplotlib
  except ImportError:
    logging.warning("loss.png needs matplotlib: pip install 'ddiloco[plots]'.")
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  syncer = _syncer_summary(workdir)
  t0 = min([e[0] for e in syncer["evals"]] or [0.0])
  fig, ax = plt.subplots(figsize=(9, 4.5))
  ids = sorted(
    int(name[len("learner_") :])
    for name in os.listdir(workdir)
    if name.startswith("learner_") and name[len("learner_") :].isdigit()
  )  # Every learner of the fleet, added ones included.
  for i in ids:
    path = os.path.join(workdir, f"learner_{i}", "summary.json")
    losses = read_json(path)["losses"] if os.path.exists(path) else []
    if losses:
      ax.plot(
        [x[1] - t0 for x in losses], [x[2] for x in losses], lw=1, label=f"learner {i} (train)"
      )
  evals = syncer["evals"]
  ax.plot(
    [e[0] - t0 for e in evals], [e[2] for e in evals], "k-o", lw=2, label="global model (eval)"
  )
  merges = syncer["merge_times"]
  if merges:
    lo, hi = ax.get_ylim()
    ax.vlines(
      [m[0] - t0 for m in merges], lo, lo + 0.04 * (hi - lo), color="0.5", lw=0.5, label="merges"
    )
    ax.set_ylim(lo, hi)
  ax.set_xlabel("wall time since the syncer started (s)")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title(
    f"{syncer['merges']} merges, uplink {syncer['uplink_codec']}, downlink {syncer['downlink_codec']}"
    + (" (interrupted)" if interrupted else "")
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = os.path.join(workdir, "loss.png")
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def data_segments(workdir: str) -> list[tuple[int, int, int, int, int]]:
  """(learner, slot, slots, start, end) of every learner's data positions in the run: the
  positions it read (data/token_shards.py, `data_ledger`).

  A distributed run's learners each write learner_i/summary.json, and their metrics.jsonl holds
  every life's start (its "restore" event's `data`) and how far it had read at each logged step
  ("train" events' `data_position`): one segment per life, a killed one's ending at its last
  logged step (it may have read up to `log_every` steps further: repeats are counted at least).
  Without those events (an older run), a learner restored from its own checkpoint is taken to
  have read its slot from the start in its earlier lives. A simulated run
  (`ddiloco-simulate`) has no learner folders: its summary.json lists every learner's data, one
  segment per life (a start, a restart, a join), each from where it started reading to where it
  stopped (simulation/slot.py).

  Raises:
    ValueError: if a learner wrote no summary, or its summary has no data positions.
  """
  names = [n for n in os.listdir(workdir) if n.startswith("learner_") and n[8:].isdigit()]
  if not names:
    return _simulated_segments(workdir)
  out = []
  for learner in sorted(int(n[8:]) for n in names):
    path = os.path.join(workdir, f"learner_{learner}", "summary.json")
    if not os.path.exists(path):
      raise ValueError(f"learner {learner} wrote no summary ({path}): did it end?")
    with open(path) as f:
      s = json.load(f)
    data = s.get("data") or {}
    start, end = data.get("start"), data.get("end")
    if start is None or end is None:
      raise ValueError(f"learner {learner} has no data positions: not a token-corpus run?")
    lives = _lives(os.path.join(workdir, f"learner_{learner}", "metrics.jsonl"))
    if lives:
      lives[-1][1] = end["position"]  # The last life ended with the run: its summary says where.
      out += [(learner, end["slot"], end["slots"], a, max(a, b)) for a, b in lives]
      continue
    first = 0 if str(s.get("restored_from", "")).startswith("own") else start["position"]
    out.append((learner, end["slot"], end["slots"], first, end["position"]))
  return out


def _lives(path: str) -> list[list[int]]:
  """[start, furthest logged position] of each life of a learner, from its metrics.jsonl's
  "restore" and "train" events; [] if they do not say (a run without the positions)."""
  if not os.path.exists(path):
    return []
  lives: list[list[int]] = []
  for event in read_event_lines(path):
    if event.get("kind") == "restore":
      data = event.get("data")
      if not data:
        return []
      lives.append([data["position"], data["position"]])
    elif event.get("kind") == "train" and lives and "data_position" in event:
      lives[-1][1] = max(lives[-1][1], int(event["data_position"]))
  return lives


def _simulated_segments(workdir: str) -> list[tuple[int, int, int, int, int]]:
  """`data_segments` of a simulated run's summary.json: a segment per learner life."""
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    raise ValueError(f"{workdir} holds no learner_i folders and no summary.json: not a run?")
  learners = read_json(path).get("learners") or {}
  if not learners:
    raise ValueError(f"{path} lists no learners.")
  out = []
  for learner in sorted(learners, key=int):
    data = learners[learner].get("data")
    if not data:
      raise ValueError(f"learner {learner} has no data positions: not a token-corpus run?")
    end = data["end"]
    for start, stop in data["lives"]:
      out.append((int(learner), end["slot"], end["slots"], start, stop))
  return out
