"""Invariants of a chaos run, checked on its event tape (ddiloco.chaos.tape).

Each check is a pure function of the tape records (and the fault-free baseline loss) returning an
`InvariantResult`; `check_all` runs them, `format_table` prints them, `all_ok` is the exit code.

Merge gaps (docs/algorithm.md §4 "zero global downtime": the syncer never stalls while >= K learners are alive).
A gap is a maximal interval with no merge during which >= K learners were up throughout:
  - "up" is from learner_up to learner_down or learner_done (a paused process is up);
  - the time before the first merge is start-up (processes start, compile, and the first fragment
    becomes due only after its offset and τ), not downtime, so gaps are measured from the first merge;
    with >= K learners up and no merge at all the invariant fails;
  - the observation ends at run_end (or the last record);
  - a gap that overlaps a syncer outage (syncer_down .. syncer_up) cannot be closed by any merge, so
    it is reported separately and not held to `max_gap_s`; its length is in the detail.

A sharded syncer (records with a `shard`; one without is shard 0's): each shard merges only its own
fragments, so the gaps are measured per shard, between that shard's merges and against that shard's
outages: a shard killed alone excuses its own gap, not the others'. The syncer's digests and token
ledger are checked per shard too, and `merges_lost_at_restarts` counts each shard's restarts.
"""

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Tape = Sequence[Mapping[str, Any]]
_LEDGER_KEYS = ("trained", "merged", "dropped", "in_flight")
_SYNCER_LEDGER_KEYS = ("received", "merged", "dropped", "pending")


@dataclasses.dataclass(frozen=True)
class InvariantResult:
  """The outcome of one invariant: its name, whether it holds, and the evidence in one line."""

  name: str
  ok: bool
  detail: str


@dataclasses.dataclass(frozen=True)
class Gap:
  """A merge-free interval with >= K learners up; `during_outage` if it overlaps syncer downtime."""

  start: float
  end: float
  during_outage: bool

  @property
  def length(self) -> float:
    return self.end - self.start


def _sorted(tape: Tape) -> list[Mapping[str, Any]]:
  return sorted(tape, key=lambda r: r["t"])  # Stable: same-time records keep tape order.


def _end_time(tape: Tape) -> float:
  ends = [r["t"] for r in tape if r["kind"] == "run_end"]
  return max(ends) if ends else max((r["t"] for r in tape), default=0.0)


def _quorum_intervals(tape: Tape, min_quorum: int, end: float) -> list[tuple[float, float]]:
  """Maximal intervals [a, b] with >= min_quorum learners up."""
  up: set[int] = set()
  out, since = [], None
  for r in _sorted(tape):
    if r["kind"] == "learner_up":
      up.add(r["learner"])
    elif r["kind"] in ("learner_down", "learner_done"):
      up.discard(r["learner"])
    else:
      continue
    if len(up) >= min_quorum and since is None:
      since = r["t"]
    elif len(up) < min_quorum and since is not None:
      out.append((since, r["t"]))
      since = None
  if since is not None and since < end:
    out.append((since, end))
  return [(a, min(b, end)) for a, b in out if a < end]


def _shard(r: Mapping[str, Any]) -> int:
  return int(r.get("shard", 0))


def shards_on(tape: Tape) -> list[int]:
  """The syncer shards a tape's records speak of ([0] for an unsharded syncer's tape)."""
  kinds = ("merge", "syncer_up", "syncer_down", "syncer_restore")
  found = {_shard(r) for r in tape if r["kind"] in kinds or r.get("role") == "syncer"}
  return sorted(found | {0})


def _outages(tape: Tape, end: float, shard: int = 0) -> list[tuple[float, float]]:
  """A syncer shard's downtime intervals [syncer_down, next syncer_up or end]."""
  out, since = [], None
  for r in _sorted(tape):
    if r["kind"] not in ("syncer_down", "syncer_up") or _shard(r) != shard:
      continue
    if r["kind"] == "syncer_down" and since is None:
      since = r["t"]
    elif r["kind"] == "syncer_up" and since is not None:
      out.append((since, r["t"]))
      since = None
  if since is not None:
    out.append((since, end))
  return out


def merge_gaps(tape: Tape, *, min_quorum: int, shard: int = 0) -> list[Gap]:
  """Every merge gap of one syncer shard (module docstring), in time order.

  Args:
    tape: the records.
    min_quorum: K (docs/algorithm.md §4.1).
    shard: the syncer shard (0 for an unsharded syncer).

  Returns:
    Gaps from the shard's first merge on; empty if it did not merge.
  """
  merges = sorted(r["t"] for r in tape if r["kind"] == "merge" and _shard(r) == shard)
  if not merges:
    return []
  end = _end_time(tape)
  outages = _outages(tape, end, shard)
  gaps = []
  for up_from, b in _quorum_intervals(tape, min_quorum, end):
    a = max(up_from, merges[0])
    if a >= b:
      continue
    cuts = [a, *(m for m in merges if a < m < b), b]
    for s, e in itertools.pairwise(cuts):
      if e > s:
        overlap = any(s < oe and os_ < e for os_, oe in outages)
        gaps.append(Gap(s, e, overlap))
  return gaps


def check_merge_gap(tape: Tape, *, min_quorum: int, max_gap_s: float) -> InvariantResult:
  """The longest merge gap outside syncer outages is at most max_gap_s, for every syncer shard
  (module docstring)."""
  name = "max_merge_gap"
  if not any(r["kind"] == "learner_up" for r in tape):
    return InvariantResult(name, False, "no learner_up on the tape: up time unknown")
  shards = shards_on(tape)
  results = [_shard_gap(tape, min_quorum, max_gap_s, s) for s in shards]
  if len(shards) == 1:
    return InvariantResult(name, *results[0])
  detail = "; ".join(f"shard {s}: {d}" for s, (_, d) in zip(shards, results))
  return InvariantResult(name, all(ok for ok, _ in results), detail)


def _shard_gap(tape: Tape, min_quorum: int, max_gap_s: float, shard: int) -> tuple[bool, str]:
  if not any(r["kind"] == "merge" and _shard(r) == shard for r in tape):
    up = _quorum_intervals(tape, min_quorum, _end_time(tape))
    if up:
      return False, f"no merge at all while >= {min_quorum} learners were up"
    return False, "no merge and never a quorum of learners up"
  gaps = merge_gaps(tape, min_quorum=min_quorum, shard=shard)
  normal = [g for g in gaps if not g.during_outage]
  outage = [g for g in gaps if g.during_outage]
  worst = max(normal, key=lambda g: g.length, default=None)
  longest = 0.0 if worst is None else worst.length
  detail = f"longest {longest:.3f} s (bound {max_gap_s:g} s)"
  if worst is not None:
    detail += f" at [{worst.start:.3f}, {worst.end:.3f}]"
  if outage:
    w = max(outage, key=lambda g: g.length)
    detail += (
      f"; {len(outage)} gap(s) overlapping syncer downtime, longest {w.length:.3f} s at "
      f"[{w.start:.3f}, {w.end:.3f}] (not bounded)"
    )
  return longest <= max_gap_s, detail


def check_monotonic_versions(tape: Tape) -> InvariantResult:
  """Each fragment's merge versions strictly increase in tape order (jumps forward allowed).

  A fragment is merged by one shard only, so this holds per shard, across its restarts.
  """
  last: dict[int, int] = {}
  merges = jumps = 0
  for r in tape:
    if r["kind"] != "merge":
      continue
    merges += 1
    p, v = r["fragment"], r["version"]
    if p in last and v <= last[p]:
      return InvariantResult(
        "monotonic_versions", False, f"fragment {p}: version {v} after {last[p]} (t={r['t']})"
      )
    jumps += p in last and v > last[p] + 1
    last[p] = v
  if merges == 0:
    return InvariantResult("monotonic_versions", False, "no merge on the tape")
  detail = f"{merges} merges over {len(last)} fragments, {jumps} forward jump(s)"
  return InvariantResult("monotonic_versions", True, detail)


def check_digests(tape: Tape) -> InvariantResult:
  """Every learner's final (fragment, version) digest equals the syncer's for that version.

  The syncer's digests are its final_digests record(s), completed by the digests of earlier versions
  carried by merge events (later records win), so a learner one version behind is compared too when
  that version's merge carried a digest, and skipped otherwise. Zero comparisons is a failure, for
  the syncer and for each shard of a sharded one (the shard whose records gave the digest).
  """
  syncer: dict[tuple[int, int], tuple[str, int]] = {}
  for r in tape:
    if r["kind"] == "merge" and r.get("digest"):
      syncer[(int(r["fragment"]), int(r["version"]))] = (r["digest"], _shard(r))
  for r in tape:
    if r["kind"] == "final_digests" and r.get("role") == "syncer":
      for p, d in r["digests"].items():
        syncer[(int(p), int(d["version"]))] = (d["digest"], _shard(r))
  shards = shards_on(tape)
  compared = dict.fromkeys(shards, 0)
  skipped = 0
  bad = []
  for r in tape:
    if r["kind"] != "final_digests" or r.get("role") != "learner":
      continue
    for p, d in r["digests"].items():
      key = (int(p), int(d["version"]))
      if key not in syncer:
        skipped += 1
        continue
      digest, shard = syncer[key]
      compared[shard] = compared.get(shard, 0) + 1
      if digest != d["digest"]:
        bad.append(f"learner {r['learner']} fragment {key[0]} v{key[1]}")
  total = sum(compared.values())
  detail = f"{total} compared, {len(bad)} mismatched, {skipped} without a syncer digest"
  if len(compared) > 1:
    detail += " (per shard: " + ", ".join(f"{s}: {n}" for s, n in sorted(compared.items())) + ")"
  if bad:
    detail += ": " + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
  return InvariantResult("digests_agree", min(compared.values()) > 0 and not bad, detail)


def check_ledger(tape: Tape) -> InvariantResult:
  """Every token ledger on the tape balances, in exact integer counts (learner/ledger.py).

  The last "ledger" record of each learner (role "learner", the default) must have trained ==
  merged + dropped + in_flight, and each syncer shard's (role "syncer", if any) received == merged +
  dropped + pending; all counts ints >= 0. The detail sums the learners' books.
  """
  last: dict[tuple[str, Any], Mapping[str, Any]] = {}
  for r in tape:
    if r["kind"] == "ledger":
      role = r.get("role", "learner")
      last[(role, r.get("learner") if role == "learner" else _shard(r))] = r
  sharded = len({who for role, who in last if role == "syncer"}) > 1
  if not any(role == "learner" for role, _ in last):
    return InvariantResult("ledger_balances", False, "no learner ledger record on the tape")
  sums = dict.fromkeys(_LEDGER_KEYS, 0)
  bad = []
  for (role, who), r in sorted(last.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
    keys = _LEDGER_KEYS if role == "learner" else _SYNCER_LEDGER_KEYS
    name = f"learner {who}" if role == "learner" else f"syncer{f' shard {who}' * sharded}"
    missing = [k for k in keys if k not in r]
    if missing:
      return InvariantResult("ledger_balances", False, f"{name}'s ledger lacks {missing}")
    vals = [r[k] for k in keys]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vals):
      return InvariantResult("ledger_balances", False, f"{name}: counts must be ints >= 0: {vals}")
    if vals[0] != sum(vals[1:]):
      bad.append(f"{name}: {keys[0]} {vals[0]} != {' + '.join(map(str, vals[1:]))}")
    if role == "learner":
      for k, v in zip(keys, vals):
        sums[k] += v
  t, m, d, f = (sums[k] for k in _LEDGER_KEYS)
  detail = f"trained {t} vs merged {m} + dropped {d} + in flight {f} = {m + d + f}"
  for who, s in sorted((who, r) for (role, who), r in last.items() if role == "syncer"):
    detail += (
      f"; syncer{f' shard {who}' * sharded} received {s['received']} = merged {s['merged']} + "
      f"dropped {s['dropped']} + pending {s['pending']}"
    )
  if bad:
    detail += "; unbalanced: " + ", ".join(bad)
  return InvariantResult("ledger_balances", not bad, detail)


def check_training_finished(tape: Tape) -> InvariantResult:
  """Every learner seen on the tape has a last learner_done with step >= target."""
  learners = {
    r["learner"] for r in tape if r["kind"] in ("learner_up", "learner_down", "learner_done")
  }
  done = {r["learner"]: r for r in tape if r["kind"] == "learner_done"}
  if not learners:
    return InvariantResult("training_finished", False, "no learner on the tape")
  short = [
    f"learner {i}: "
    + (f"step {done[i]['step']} < {done[i]['target']}" if i in done else "not done")
    for i in sorted(learners)
    if i not in done or done[i]["step"] < done[i]["target"]
  ]
  detail = f"{len(learners) - len(short)}/{len(learners)} learners reached their target"
  if short:
    detail += ": " + ", ".join(short)
  return InvariantResult("training_finished", not short, detail)


def check_eval(tape: Tape, *, baseline_loss: float, tolerance: float = 0.03) -> InvariantResult:
  """The final eval loss is at most `tolerance` above the fault-free baseline, relatively.

  The final eval is the last record with final=true, else the last eval record.
  """
  name = "eval_within_tolerance"
  evals = [r for r in tape if r["kind"] == "eval"]
  finals = [r for r in evals if r.get("final")]
  if not evals:
    return InvariantResult(name, False, "no eval record on the tape")
  if not baseline_loss > 0 or not math.isfinite(baseline_loss):
    return InvariantResult(name, False, f"baseline loss must be finite and > 0: {baseline_loss}")
  loss = float((finals or evals)[-1]["loss"])
  rel = (loss - baseline_loss) / baseline_loss
  ok = math.isfinite(rel) and rel <= tolerance
  detail = f"loss {loss:.4f} vs baseline {baseline_loss:.4f}: {100 * rel:+.2f} % (bound +{100 * tolerance:g} %)"
  return InvariantResult(name, ok, detail)


def check_schedule_on_time(tape: Tape, *, max_late_s: float = 1.0) -> InvariantResult:
  """Every injected fault fired within `max_late_s` of its planned time (`scheduled_t`).

  A driver that blocks (on a restarting syncer, say) fires later faults late, and they overlap:
  the run then tests another schedule than the one planned.
  """
  injected = [r for r in tape if "scheduled_t" in r]
  if not injected:
    return InvariantResult("faults_on_time", True, "no fault was scheduled")
  late = [(r["t"] - r["scheduled_t"], r) for r in injected]
  worst, record = max(late, key=lambda lr: lr[0])
  detail = f"{len(injected)} faults, latest {worst:.2f} s after its planned time ({record['kind']})"
  over = [lr for lr in late if lr[0] > max_late_s]
  if over:
    detail += f"; {len(over)} later than {max_late_s:g} s"
  return InvariantResult("faults_on_time", not over, detail)


def check_all(
  tape: Tape,
  *,
  min_quorum: int,
  max_gap_s: float,
  baseline_loss: float | None,
  eval_tolerance: float = 0.03,
  max_late_s: float = 1.0,
) -> list[InvariantResult]:
  """Every invariant of a chaos run, in a fixed order.

  Args:
    tape: the records.
    min_quorum: K of the run's syncer.
    max_gap_s: the merge-gap bound (ChaosConfig.max_gap_s).
    baseline_loss: the fault-free run's final eval loss; None leaves the eval check out.
    eval_tolerance: relative bound on the eval loss (ChaosConfig.eval_tolerance).
    max_late_s: how late after its planned time a fault may fire.

  Returns:
    The results.
  """
  results = [
    check_merge_gap(tape, min_quorum=min_quorum, max_gap_s=max_gap_s),
    check_monotonic_versions(tape),
    check_digests(tape),
    check_ledger(tape),
    check_training_finished(tape),
    check_schedule_on_time(tape, max_late_s=max_late_s),
  ]
  if baseline_loss is not None:
    results.append(check_eval(tape, baseline_loss=baseline_loss, tolerance=eval_tolerance))
  return results


def merges_lost_at_restarts(tape: Tape) -> list[int]:
  """Per syncer (shard) restart, in time order, the merges it lost: those its checkpoint lacked,
  less the ones the learners handed back to that shard before its next restart (a fragment not
  handed back by the run's end counts as lost)."""
  out: list[tuple[float, int]] = []
  open_: dict[int, tuple[Mapping[str, Any], set[str]]] = {}  # shard: (its restore, recovered)
  for r in _sorted(tape):
    if r["kind"] == "syncer_restore":
      if _shard(r) in open_:
        out.append((open_[_shard(r)][0]["t"], _lost(*open_[_shard(r)])))
      open_[_shard(r)] = (r, set())
    elif r["kind"] == "syncer_recovery" and r["how"] == "recovered" and _shard(r) in open_:
      open_[_shard(r)][1].add(str(r["fragment"]))
  out += [(restore["t"], _lost(restore, got)) for restore, got in open_.values()]
  return [lost for _, lost in sorted(out, key=lambda x: x[0])]


def _lost(restore: Mapping[str, Any], recovered: set[str]) -> int:
  back = sum(v[3] for p, v in restore["to_recover"].items() if p in recovered and len(v) > 3)
  return int(restore["lost_merges"]) - back


def all_ok(results: Iterable[InvariantResult]) -> bool:
  """True iff every invariant holds (the chaos driver exits non-zero otherwise)."""
  return all(r.ok for r in results)


def format_table(results: Sequence[InvariantResult]) -> str:
  """A fixed-width table: one line per invariant, PASS/FAIL, detail."""
  width = max((len(r.name) for r in results), default=9)
  lines = [f"{'invariant':<{width}}  result  detail", "-" * (width + 16)]
  lines += [f"{r.name:<{width}}  {'PASS' if r.ok else 'FAIL':<6}  {r.detail}" for r in results]
  return "\n".join(lines)
