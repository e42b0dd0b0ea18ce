"""Checkpointing of the syncer core: its whole state as a flat dict of arrays and scalars (docs/algorithm.md §6).

`SyncerCore` inherits `CheckpointMixin`, so `SyncerCore.state_dict()` / `load_state_dict()` /
`layout_fingerprint()` are its public methods; they live here to keep the round and merge logic in
`core.py` short. The flat {name: numpy array | python scalar} form needs no pytree structure to save.
"""

import collections
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.fragments.digest import values_digest
from ddiloco.syncer.grace import GraceModel
from ddiloco.syncer.types import (
  COUNTERS,
  NEW_COUNTERS,
  LearnerRecord,
  Report,
  Round,
  RoundEntry,
  readonly,
)

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


class CheckpointMixin:
  """`state_dict` / `load_state_dict` of `SyncerCore`; not usable on its own.

  The annotations below are the core's state, set by `SyncerCore.__init__`; this mixin reads all of it
  and replaces all of it on load.
  """

  _keys: tuple[tuple[str, ...], ...]
  _global: list[dict[str, np.ndarray]]
  _version: list[int]
  _digest: list[str]
  _history: list[dict[int, dict[str, np.ndarray]]]
  _opt: optax.GradientTransformation
  _opt_state: list[optax.OptState]
  _rounds: list[Round]
  _last_round_step: list[int]
  _closed_first: list[tuple[int, float] | None]
  _next_round_step: int | None
  _recent_rounds: list[collections.deque]
  _rounds_known_after: list[int]
  _restored: bool
  _cadence: float | None
  _learners: dict[int, LearnerRecord]
  _counters: dict[str, int]
  _fleet_step_time: float | None
  _quorum_hist: np.ndarray
  _grace: GraceModel
  num_fragments: int
  _params32: Callable[[int], dict[str, jax.Array]]

  def state_dict(self) -> dict[str, Any]:
    """The whole state as a flat {name: numpy array | python scalar} dict, for a checkpoint.

    Holds kept versions of every fragment (current included), versions, the flattened optax states,
    open rounds (with the syncer's copies of the reports), membership and deliveries, counters and the
    grace EMAs. Unset times are stored as NaN. `load_state_dict` restores it bit for bit.
    """
    d: dict[str, Any] = {
      "layout_fingerprint": self.layout_fingerprint(),
      "num_fragments": self.num_fragments,
    }
    for p in range(self.num_fragments):
      pre = f"fragment/{p}/"
      d[pre + "version"] = self._version[p]
      d[pre + "kept_versions"] = np.array(sorted(self._history[p]), np.int64)
      for v, vals in self._history[p].items():
        for k, a in vals.items():
          d[f"{pre}v{v}/{k}"] = np.array(a)
      leaves = jax.tree_util.tree_leaves(self._opt_state[p])
      d[pre + "opt/num_leaves"] = len(leaves)
      for i, leaf in enumerate(leaves):
        d[f"{pre}opt/{i}"] = np.array(leaf)
      rnd = self._rounds[p]
      d[pre + "round/step"] = rnd.step
      d[pre + "round/base_version"] = rnd.base_version
      d[pre + "round/last_step"] = self._last_round_step[p]
      d[pre + "round/learners"] = np.array(sorted(rnd.entries), np.int64)
      for name in ("open_time", "quorum_time", "deadline", "first_time"):
        t = getattr(rnd, name)
        d[f"{pre}round/{name}"] = math.nan if t is None else float(t)
      d[pre + "round/grace_s"] = rnd.grace_s
      closed = self._closed_first[p]
      d[pre + "closed/step"] = -1 if closed is None else closed[0]
      d[pre + "closed/first_time"] = math.nan if closed is None else float(closed[1])
      for i, e in rnd.entries.items():
        q = f"{pre}round/{i}/"
        d[q + "weight"], d[q + "epoch"] = e.weight, e.epoch
        for name in _REPORT_SCALARS:
          d[q + name] = getattr(e.report, name)
        d[q + "outer_gradient"] = int(e.report.outer_gradient)  # Saved as a number.
        for k, a in e.report.values.items():
          d[f"{q}value/{k}"] = np.array(a)
    ids = sorted(self._learners)
    d["learners/ids"] = np.array(ids, np.int64)
    d["learners/alive"] = np.array([self._learners[i].alive for i in ids], bool)
    d["learners/epoch"] = np.array([self._learners[i].epoch for i in ids], np.int64)
    delivered = np.full((len(ids), self.num_fragments), -1, np.int64)
    for row, i in enumerate(ids):
      for p, v in self._learners[i].delivered.items():
        delivered[row, p] = v
    d["learners/delivered"] = delivered
    merged_step = np.full((len(ids), self.num_fragments), -1, np.int64)
    for row, i in enumerate(ids):
      for p, step in self._learners[i].merged_step.items():
        merged_step[row, p] = step
    d["learners/merged_step"] = merged_step
    d["learners/ledger"] = np.array(
      [[self._learners[i].ledger[k] for k in _LEDGER] for i in ids], np.int64
    ).reshape(len(ids), len(_LEDGER))
    for name, value in self._counters.items():
      d["stats/" + name] = value
    d["stats/quorum_size_hist"] = self._quorum_hist.copy()
    for name, value in self._grace.state_dict().items():
      d["grace/" + name] = value
    d["fleet/step_time"] = math.nan if self._fleet_step_time is None else self._fleet_step_time
    return d

  def load_state_dict(self, d: Mapping[str, Any]) -> None:
    """Replaces the whole state with one from `state_dict` (same layout; the config may differ).

    Raises:
      ValueError: if the checkpoint was made for another layout or its arrays do not fit.
      KeyError: if an entry is missing.
    """
    if d["layout_fingerprint"] != self.layout_fingerprint():
      raise ValueError("Checkpoint was written for a different fragment layout.")
    history, opt_state, rounds = [], [], []
    unrestorable: dict[
      int, int
    ] = {}  # learner -> ledger tokens of open rounds that cannot be kept.
    for p in range(self.num_fragments):
      pre = f"fragment/{p}/"
      kept = {}
      for v in (int(x) for x in d[pre + "kept_versions"]):
        kept[v] = {k: readonly(self._fitting(d[f"{pre}v{v}/{k}"], k, p)) for k in self._keys[p]}
      if int(d[pre + "version"]) not in kept:
        raise ValueError(f"Checkpoint lacks the current version of fragment {p}.")
      history.append(kept)
      template, treedef = jax.tree_util.tree_flatten(self._opt.init(self._params32(p)))
      if int(d[pre + "opt/num_leaves"]) != len(template):
        raise ValueError(f"Optimizer state of fragment {p} does not match the outer optimizer.")
      leaves = []
      for i, t in enumerate(template):
        leaf = np.asarray(d[f"{pre}opt/{i}"])
        if leaf.shape != t.shape or leaf.dtype != t.dtype:
          raise ValueError(f"Optimizer leaf {i} of fragment {p} is {leaf.dtype}{leaf.shape}.")
        leaves.append(jnp.asarray(leaf))
      opt_state.append(jax.tree_util.tree_unflatten(treedef, leaves))
      rnd = self._load_round(d, p)
      if rnd.step < 0:  # See `_load_round`: its answers' tokens are dropped.
        for i, e in rnd.entries.items():
          unrestorable[i] = unrestorable.get(i, 0) + e.report.new_tokens
        rnd = Round()
      rounds.append(rnd)
    learners = {}
    ids = [int(x) for x in d["learners/ids"]]
    # Checkpoints from before the token ledger have no ledger entries: they start at zero.
    merged_steps = d.get("learners/merged_step", np.full((len(ids), self.num_fragments), -1))
    ledgers = d.get("learners/ledger", np.zeros((len(ids), len(_LEDGER)), np.int64))
    for row, i in enumerate(ids):
      delivered = {p: int(v) for p, v in enumerate(d["learners/delivered"][row]) if v >= 0}
      alive, epoch = bool(d["learners/alive"][row]), int(d["learners/epoch"][row])
      learners[i] = LearnerRecord(
        alive=alive,
        epoch=epoch,
        delivered=delivered,
        merged_step={p: int(v) for p, v in enumerate(merged_steps[row]) if v >= 0},
        ledger={k: int(ledgers[row][j]) for j, k in enumerate(_LEDGER)},
      )
    # Everything parsed: only now mutate, so a bad checkpoint leaves the core as it was.
    self._history = history
    self._version = [int(d[f"fragment/{p}/version"]) for p in range(self.num_fragments)]
    self._global = [history[p][v] for p, v in enumerate(self._version)]
    self._digest = [values_digest(v) for v in self._global]
    self._opt_state, self._rounds, self._learners = opt_state, rounds, learners
    self._last_round_step = [
      max(int(d.get(f"fragment/{p}/round/last_step", -1)), rounds[p].step)
      for p in range(self.num_fragments)
    ]
    # The step clock restarts past every restored round; rounds before are too old to tell apart.
    self._next_round_step, self._cadence = None, None
    self._recent_rounds = [collections.deque(maxlen=r.maxlen) for r in self._recent_rounds]
    self._rounds_known_after = list(self._last_round_step)
    self._restored = True
    self._closed_first = []
    for p in range(self.num_fragments):
      step = int(d.get(f"fragment/{p}/closed/step", -1))
      t = float(d.get(f"fragment/{p}/closed/first_time", math.nan))
      self._closed_first.append(None if step < 0 or math.isnan(t) else (step, t))
    self._counters = {
      name: int(d.get("stats/" + name, 0) if name in NEW_COUNTERS else d["stats/" + name])
      for name in COUNTERS
    }
    for i, tokens in unrestorable.items():
      self._counters["ledger_dropped"] += tokens
      if i in self._learners:
        self._learners[i].ledger["dropped"] += tokens
    t = float(d["fleet/step_time"])
    self._fleet_step_time = None if math.isnan(t) else t
    self._quorum_hist = np.array(d["stats/quorum_size_hist"], np.int64)
    self._grace.load_state_dict(
      {k[len("grace/") :]: v for k, v in d.items() if k.startswith("grace/")}
    )

  def _load_round(self, d: Mapping[str, Any], p: int) -> Round:
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
      values = {k: self._fitting(d[f"{q}value/{k}"], k, p) for k in self._keys[p]}
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

  def _fitting(self, a: Any, key: str, p: int) -> np.ndarray:
    """A copy of `a`, checked against the shape and dtype of key in fragment p."""
    ref = self._global[p][key]
    a = np.array(a, copy=True)
    if a.shape != ref.shape or a.dtype != ref.dtype:
      raise ValueError(
        f"Checkpoint has {key!r} as {a.dtype}{a.shape}, expected {ref.dtype}{ref.shape}."
      )
    return a

  def layout_fingerprint(self) -> str:
    """Hash of fragment keys, shapes and dtypes; guards `load_state_dict` against another layout."""
    h = hashlib.sha256()
    for p, vals in enumerate(self._global):
      for k in self._keys[p]:
        h.update(f"{p}|{k}|{vals[k].dtype}|{vals[k].shape};".encode())
    return h.hexdigest()[:32]
