"""What a chaos run copies from its processes' files onto its event tape (`ddiloco.chaos.tape`).

While it runs, `ChaosRun` tails each syncer shard's metrics.jsonl (`Tail`) and records its merges,
evaluations, restores and recoveries (`record_syncer_events`), each with the shard it came from.
At the end, `record_final` records the final evaluation, every holder's final digests and the
token ledgers: per shard for the syncer (its journal and summary in its own workdir,
launch/syncer_shards.py), per learner from its summary.
"""

import json
import os
from collections.abc import Callable
from typing import Any

from ddiloco.chaos.tape import TapeWriter
from ddiloco.checkpoint import syncer as syncer_ckpt
from ddiloco.launch import syncer_shards

SYNCER_BOOK = ("received", "merged", "dropped", "pending")


class Tail:
  """Reads the complete new lines of a JSONL file (a process's metrics.jsonl) as it grows."""

  def __init__(self, path: str):
    self.path = path
    self.offset = 0

  def read(self) -> list[dict]:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return []
    end = data.rfind(b"\n") + 1
    self.offset += end
    out = []
    for line in data[:end].splitlines():
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
    return out


def syncer_folder(workdir: str, shard: int) -> str:
  """Shard `shard`'s folder in a cluster's workdir (`W/syncer`, `W/syncer_<i>`)."""
  return syncer_shards.shard_workdir(os.path.join(workdir, "syncer"), shard)


def record_syncer_events(
  tape: TapeWriter, events: list[dict], *, shard: int, t: Callable[[float], float]
) -> None:
  """Records a syncer shard's new metrics events on the tape; `t` maps their wall times to it."""
  for ev in events:
    kind = ev.get("kind")
    if kind == "merge":
      tape.record(
        "merge",
        t=t(ev["time"]),
        shard=shard,
        fragment=ev["fragment"],
        version=ev["version"],
        contributors=ev["contributors"],
        tokens=ev["tokens"],
        digest=ev.get("digest"),
      )
    elif kind == "eval":
      tape.record("eval", t=t(ev["time"]), loss=ev["loss"], merges=ev["merges"])
    elif kind == "restore":  # A restarted syncer (shard): what its checkpoint lacked.
      tape.record(
        "syncer_restore",
        t=t(ev["time"]),
        shard=shard,
        lost_merges=ev["lost_merges"],
        to_recover=ev.get("to_recover", {}),
        from_log=ev.get("from_log", {}),  # Taken back from its version log: nothing lost.
      )
    elif kind == "recovery":  # A lost version handed back by a learner, or republished.
      tape.record(
        "syncer_recovery",
        t=t(ev["time"]),
        shard=shard,
        fragment=ev["fragment"],
        version=ev["version"],
        how=ev["how"],
      )


def _syncer_digests(folder: str, summary: dict[str, Any]) -> dict[str, dict]:
  """A shard's newest digest of each of its fragments: its journal's, or its summary's if newer."""
  newest: dict[str, dict] = {}
  journal = os.path.join(folder, syncer_ckpt.JOURNAL_NAME)
  if os.path.exists(journal):  # A shard that never merged may have none.
    with open(journal) as f:
      for line in f:
        e = json.loads(line)
        newest[str(e["fragment"])] = {"version": e["version"], "digest": e["digest"]}
  for key, digest in summary["digests"].items():  # Newer than the journal: none expected.
    p, v = key.split(":")
    if int(v) >= newest.get(p, {"version": -1})["version"]:
      newest[p] = {"version": int(v), "digest": digest}
  return newest


def record_final(
  tape: TapeWriter,
  workdir: str,
  *,
  num_shards: int,
  learner_summaries: dict[int, dict | None],
) -> None:
  """Final eval (shard 0's), each syncer shard's and each learner's final digests, and every token
  ledger on the tape."""
  for shard in range(num_shards):
    folder = syncer_folder(workdir, shard)
    with open(os.path.join(folder, "summary.json")) as f:
      syncer = json.load(f)
    if shard == 0:  # Shard 0 evaluates the global model, joined from every shard's values.
      tape.record("eval", loss=syncer["final_eval_loss"], final=True)
    digests = _syncer_digests(folder, syncer)
    tape.record("final_digests", role="syncer", shard=shard, digests=digests)
    book = syncer.get("token_ledger")
    if book:
      tape.record("ledger", role="syncer", shard=shard, **{k: book[k] for k in SYNCER_BOOK})
  for i, s in sorted(learner_summaries.items()):
    if s is None:
      continue
    held = {str(p): {"version": int(v), "digest": d} for p, v, d in s["applies"]}
    tape.record("final_digests", role="learner", learner=i, digests=held)
    if "ledger" in s:  # Exact token-fragment counts of its surviving history (ledger.py).
      book, num = s["ledger"]["token_fragments"], s["ledger"]["num_fragments"]
      tape.record(
        "ledger",
        role="learner",
        learner=i,
        trained=s["ledger"]["trained"] * num,
        merged=book["merged"],
        dropped=book["dropped"],
        in_flight=book["unsent"] + book["awaiting"] + book["pending"],
      )
