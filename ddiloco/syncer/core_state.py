"""The syncer core's state for a checkpoint: all of it as a flat dict of arrays and scalars (docs/algorithm.md §6).

`SyncerCore.state_dict()` / `load_state_dict()` call `state_dict` / `load_state_dict` here with its
collaborators, whose public surface they read and restore. The flat {name: numpy array | python
scalar} form needs no pytree structure to save.
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ddiloco.syncer.accounts import Accounts
from ddiloco.syncer.grace import GraceModel
from ddiloco.syncer.learners import LearnerRegistry
from ddiloco.syncer.pacing import RoundPacer
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.types import (
  COUNTERS,
  NEW_COUNTERS,
  LearnerRecord,
  Report,
  Round,
  RoundEntry,
  readonly,
)
from ddiloco.syncer.updates import FragmentUpdater
from ddiloco.syncer.versions import VersionStore

_REPORT_SCALARS = (
  "tokens",
  "steps",
  "anchor_version",
  "step",
  "step_time_s",
  "new_tokens",
  "round_step",
  "outer_gradient",
)
# Entries added after checkpoints were first written, and their value in an older checkpoint
# (whose answers were all θ, none an outer gradient as sent).
_REPORT_DEFAULTS = {"new_tokens": 0, "round_step": -1, "outer_gradient": 0}
_LEDGER = ("received", "merged", "dropped")


def state_dict(
  *,
  versions: VersionStore,
  updater: FragmentUpdater,
  rounds: RoundTable,
  learners: LearnerRegistry,
  accounts: Accounts,
  grace: GraceModel,
) -> dict[str, Any]:
  """The syncer core's whole state (held by these collaborators) as a flat {name: numpy array |
  python scalar} dict, for a checkpoint.

  Holds kept versions of every fragment (current included), versions, the flattened optax states,
  open rounds (with the syncer's copies of the reports), membership and deliveries, counters and the
  grace EMAs. Unset times are stored as NaN. `load_state_dict` restores it bit for bit.
  """
  num_fragments = versions.num_fragments
  d: dict[str, Any] = {
    "layout_fingerprint": versions.layout_fingerprint(),
    "num_fragments": num_fragments,
  }
  for p in range(num_fragments):
    pre = f"fragment/{p}/"
    kept = versions.kept_versions(p)
    d[pre + "version"] = versions.version(p)
    d[pre + "kept_versions"] = np.array(sorted(kept), np.int64)
    for v, vals in kept.items():
      for k, a in vals.items():
        d[f"{pre}v{v}/{k}"] = np.array(a)
    leaves = updater.state_leaves(p)
    d[pre + "opt/num_leaves"] = len(leaves)
    for i, leaf in enumerate(leaves):
      d[f"{pre}opt/{i}"] = np.array(leaf)
    rnd = rounds[p]
    d[pre + "round/step"] = rnd.step
    d[pre + "round/base_version"] = rnd.base_version
    d[pre + "round/last_step"] = rounds.last_step(p)
    d[pre + "round/learners"] = np.array(sorted(rnd.entries), np.int64)
    for name in ("open_time", "quorum_time", "deadline", "first_time"):
      t = getattr(rnd, name)
      d[f"{pre}round/{name}"] = math.nan if t is None else float(t)
    d[pre + "round/grace_s"] = rnd.grace_s
    closed = rounds.closed_first(p)
    d[pre + "closed/step"] = -1 if closed is None else closed[0]
    d[pre + "closed/first_time"] = math.nan if closed is None else float(closed[1])
    for i, e in rnd.entries.items():
      q = f"{pre}round/{i}/"
      d[q + "weight"], d[q + "epoch"] = e.weight, e.epoch
      for name in _REPORT_SCALARS:
        d[q + name] = getattr(e.report, name)
      d[q + "outer_gradient"] = int(e.report.outer_gradient)  # Saved as a number.
      for k, a in e.report.values.items():
        # Widened to the tensor's dtype if kept as sent (bfloat16, exact): the checkpoint's
        # layout is the tensors'; a restored answer's norms are computed at its merge.
        d[f"{q}value/{k}"] = np.array(a, dtype=versions.values(p)[k].dtype)
  records = dict(learners.items())
  ids = sorted(records)
  d["learners/ids"] = np.array(ids, np.int64)
  d["learners/alive"] = np.array([records[i].alive for i in ids], bool)
  d["learners/epoch"] = np.array([records[i].epoch for i in ids], np.int64)
  delivered = np.full((len(ids), num_fragments), -1, np.int64)
  for row, i in enumerate(ids):
    for p, v in records[i].delivered.items():
      delivered[row, p] = v
  d["learners/delivered"] = delivered
  merged_step = np.full((len(ids), num_fragments), -1, np.int64)
  for row, i in enumerate(ids):
    for p, step in records[i].merged_step.items():
      merged_step[row, p] = step
  d["learners/merged_step"] = merged_step
  d["learners/ledger"] = np.array(
    [[records[i].ledger[k] for k in _LEDGER] for i in ids], np.int64
  ).reshape(len(ids), len(_LEDGER))
  for name, value in accounts.counters().items():
    d["stats/" + name] = value
  d["stats/quorum_size_hist"] = accounts.quorum_hist()
  for name, value in grace.state_dict().items():
    d["grace/" + name] = value
  fleet_step_time = accounts.fleet_step_time()
  d["fleet/step_time"] = math.nan if fleet_step_time is None else fleet_step_time
  return d


def load_state_dict(
  d: Mapping[str, Any],
  *,
  versions: VersionStore,
  updater: FragmentUpdater,
  rounds: RoundTable,
  pacer: RoundPacer,
  learners: LearnerRegistry,
  accounts: Accounts,
  grace: GraceModel,
) -> None:
  """Replaces the syncer core's whole state with one from `state_dict` (same layout; the config may
  differ).

  Raises:
    ValueError: if the checkpoint was made for another layout or its arrays do not fit.
    KeyError: if an entry is missing.
  """
  if d["layout_fingerprint"] != versions.layout_fingerprint():
    raise ValueError("Checkpoint was written for a different fragment layout.")
  num_fragments = versions.num_fragments
  history, opt_state, round_list = [], [], []
  unrestorable: dict[int, int] = {}  # learner -> ledger tokens of open rounds that cannot be kept.
  for p in range(num_fragments):
    pre = f"fragment/{p}/"
    kept = {}
    for v in (int(x) for x in d[pre + "kept_versions"]):
      kept[v] = {k: readonly(versions.fitting(d[f"{pre}v{v}/{k}"], k, p)) for k in versions.keys(p)}
    if int(d[pre + "version"]) not in kept:
      raise ValueError(f"Checkpoint lacks the current version of fragment {p}.")
    history.append(kept)
    opt_state.append(
      updater.state_from_leaves(
        p, int(d[pre + "opt/num_leaves"]), lambda i, pre=pre: d[f"{pre}opt/{i}"]
      )
    )
    rnd = _load_round(d, p, versions)
    if rnd.step < 0:  # See `_load_round`: its answers' tokens are dropped.
      for i, e in rnd.entries.items():
        unrestorable[i] = unrestorable.get(i, 0) + e.report.new_tokens
      rnd = Round()
    round_list.append(rnd)
  records = {}
  ids = [int(x) for x in d["learners/ids"]]
  # Checkpoints from before the token ledger have no ledger entries: they start at zero.
  merged_steps = d.get("learners/merged_step", np.full((len(ids), num_fragments), -1))
  ledgers = d.get("learners/ledger", np.zeros((len(ids), len(_LEDGER)), np.int64))
  for row, i in enumerate(ids):
    delivered = {p: int(v) for p, v in enumerate(d["learners/delivered"][row]) if v >= 0}
    alive, epoch = bool(d["learners/alive"][row]), int(d["learners/epoch"][row])
    records[i] = LearnerRecord(
      alive=alive,
      epoch=epoch,
      delivered=delivered,
      merged_step={p: int(v) for p, v in enumerate(merged_steps[row]) if v >= 0},
      ledger={k: int(ledgers[row][j]) for j, k in enumerate(_LEDGER)},
    )
  # Everything parsed: only now mutate, so a bad checkpoint leaves the core as it was.
  versions.restore(history, [int(d[f"fragment/{p}/version"]) for p in range(num_fragments)])
  updater.restore(opt_state)
  learners.restore(records)
  closed_first = []
  for p in range(num_fragments):
    step = int(d.get(f"fragment/{p}/closed/step", -1))
    t = float(d.get(f"fragment/{p}/closed/first_time", math.nan))
    closed_first.append(None if step < 0 or math.isnan(t) else (step, t))
  # The step clock restarts past every restored round; rounds before are too old to tell apart.
  rounds.restore(
    round_list,
    [int(d.get(f"fragment/{p}/round/last_step", -1)) for p in range(num_fragments)],
    closed_first,
  )
  pacer.restart()
  counters = {
    name: int(d.get("stats/" + name, 0) if name in NEW_COUNTERS else d["stats/" + name])
    for name in COUNTERS
  }
  for i, tokens in unrestorable.items():
    counters["ledger_dropped"] += tokens
    if i in records:
      records[i].ledger["dropped"] += tokens
  t = float(d["fleet/step_time"])
  accounts.restore(
    counters, np.array(d["stats/quorum_size_hist"], np.int64), None if math.isnan(t) else t
  )
  grace.load_state_dict({k[len("grace/") :]: v for k, v in d.items() if k.startswith("grace/")})


def _load_round(d: Mapping[str, Any], p: int, versions: VersionStore) -> Round:
  pre = f"fragment/{p}/round/"
  times = {}
  for name in ("open_time", "quorum_time", "deadline", "first_time"):
    t = float(d.get(pre + name, math.nan))  # No first_time in older checkpoints.
    times[name] = None if math.isnan(t) else t
  # A checkpoint from before syncer-paced rounds has no round ids: its open round cannot be
  # answered, so it comes back with step -1 and entries, and `load_state_dict` drops it and books
  # its answers' tokens as dropped.
  rnd = Round(
    step=int(d.get(pre + "step", -1)),
    base_version=int(d.get(pre + "base_version", -1)),
    grace_s=float(d[pre + "grace_s"]),
    **times,
  )
  for i in (int(x) for x in d[pre + "learners"]):
    q = f"{pre}{i}/"
    values = {k: versions.fitting(d[f"{q}value/{k}"], k, p) for k in versions.keys(p)}
    scalars = {
      name: int(
        d.get(q + name, _REPORT_DEFAULTS[name]) if name in _REPORT_DEFAULTS else d[q + name]
      )
      for name in _REPORT_SCALARS
      if name != "step_time_s"
    }
    scalars["step_time_s"] = float(d[q + "step_time_s"])
    scalars["outer_gradient"] = bool(scalars["outer_gradient"])
    report = Report(learner_id=i, fragment=p, values=values, **scalars)
    rnd.entries[i] = RoundEntry(report, float(d[q + "weight"]), int(d[q + "epoch"]))
  return rnd
