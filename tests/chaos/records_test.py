"""What a chaos run copies onto its tape from a sharded syncer's and the learners' files, checked
against the per-shard invariants."""

import json

from ddiloco.chaos import invariants
from ddiloco.chaos import records as chaos_records
from ddiloco.chaos.tape import TapeWriter, read_tape
from ddiloco.checkpoint import syncer as syncer_ckpt


def _shard(folder, *, journal, digests, ledger, loss=None):
  folder.mkdir(parents=True)
  with open(folder / syncer_ckpt.JOURNAL_NAME, "w") as f:
    for p, v, d in journal:
      f.write(json.dumps({"fragment": p, "version": v, "digest": d}) + "\n")
  summary = {"digests": digests, "token_ledger": ledger, "final_eval_loss": loss}
  (folder / "summary.json").write_text(json.dumps(summary))


def test_final_records_are_per_shard_and_pass_the_checks(tmp_path):
  book = {"received": 5, "merged": 3, "dropped": 1, "pending": 1}
  # Shard 0 owns fragments 0 and 2, shard 1 fragment 1 (p mod 2). Shard 1's summary has a version
  # newer than its journal's (published at shutdown).
  _shard(
    tmp_path / "syncer",
    journal=[(0, 1, "a1"), (2, 1, "c1"), (0, 2, "a2")],
    digests={"0:2": "a2"},
    ledger=book,
    loss=3.5,
  )
  _shard(
    tmp_path / "syncer_1",
    journal=[(1, 1, "b1")],
    digests={"1:2": "b2"},
    ledger={**book, "pending": 0, "received": 4},
  )
  learner = {
    "applies": [[0, 1, "a1"], [0, 2, "a2"], [1, 2, "b2"], [2, 1, "c1"]],
    "ledger": {
      "trained": 2,
      "num_fragments": 3,
      "token_fragments": {"merged": 4, "dropped": 1, "unsent": 1, "awaiting": 0, "pending": 0},
    },
  }
  with TapeWriter(tmp_path / "tape.jsonl") as tape:
    chaos_records.record_final(
      tape, str(tmp_path), num_shards=2, learner_summaries={0: learner, 1: None}
    )
  records = read_tape(tmp_path / "tape.jsonl")
  evals = [r for r in records if r["kind"] == "eval"]
  assert evals == [{"t": evals[0]["t"], "kind": "eval", "loss": 3.5, "final": True}]  # Shard 0's.
  syncer = {
    r["shard"]: r["digests"] for r in records if r.get("role") == "syncer" and "digests" in r
  }
  assert syncer == {
    0: {"0": {"version": 2, "digest": "a2"}, "2": {"version": 1, "digest": "c1"}},
    1: {"1": {"version": 2, "digest": "b2"}},
  }
  held = [r["digests"] for r in records if r["kind"] == "final_digests" and r["role"] == "learner"]
  assert held == [
    {
      "0": {"version": 2, "digest": "a2"},
      "1": {"version": 2, "digest": "b2"},
      "2": {"version": 1, "digest": "c1"},
    }
  ]
  digests = invariants.check_digests(records)
  assert digests.ok and "(per shard: 0: 2, 1: 1)" in digests.detail, digests.detail
  ledger = invariants.check_ledger(records)
  assert (
    ledger.ok and "syncer shard 1 received 4 = merged 3 + dropped 1 + pending 0" in ledger.detail
  )


def test_syncer_events_carry_their_shard(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  merge = {"kind": "merge", "time": 105.0, "fragment": 1, "version": 3, "contributors": [0],
           "tokens": 64, "digest": "d"}  # fmt: skip
  restore = {
    "kind": "restore",
    "time": 106.0,
    "lost_merges": 2,
    "to_recover": {"1": [3, "d", 1, 2]},
  }
  metrics.write_text(json.dumps(merge) + "\n" + json.dumps(restore) + "\n" + '{"kind": "mer')
  tail = chaos_records.Tail(str(metrics))
  with TapeWriter(tmp_path / "tape.jsonl") as tape:
    chaos_records.record_syncer_events(tape, tail.read(), shard=1, t=lambda wall: wall - 100.0)
    assert tail.read() == []  # The torn last line waits for its end.
  records = read_tape(tmp_path / "tape.jsonl")
  assert [(r["kind"], r["t"], r["shard"]) for r in records] == [
    ("merge", 5.0, 1),
    ("syncer_restore", 6.0, 1),
  ]
  assert invariants.merges_lost_at_restarts(records) == [2]
