"""Which data positions a run's learners read: repeats and unread positions, by slot.

  python scripts/data_ledger.py --workdir=W

For a run on a pre-tokenized corpus (`RunConfig.data = @TokenShardDataConfig()`), every learner's
summary.json (W/learner_i/summary.json) says where its data stream started and ended (`data`:
position, slot, slots; a learner restored from its own checkpoint read its slot from the start in
its earlier runs, and continued from where it stopped). A simulated run's W/summary.json holds the
same for each learner, with one segment per life (a start, a restart, a join). The script prints
the segments, the positions read, those read twice or more, and those below the furthest read
that nobody read, by slot (data/token_shards.py states which of these a fleet change may cause),
and writes them as JSON with `--out`.
"""

import json

from absl import app, flags

from ddiloco.data.token_shards import data_ledger
from ddiloco.launch.run_summary import data_segments

_WORKDIR = flags.DEFINE_string("workdir", None, "the run's folder", required=True)
_OUT = flags.DEFINE_string("out", None, "where the ledger's JSON goes (optional)")


def main(argv: list[str]) -> None:
  del argv
  try:
    rows = data_segments(_WORKDIR.value)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  for learner, slot, slots, start, end in rows:
    print(f"learner {learner}: slot {slot} of {slots}, positions [{start}, {end})")
  ledger = data_ledger([r[1:] for r in rows])
  print(
    f"positions below {ledger.end}: {ledger.read} read, {ledger.repeated} read more than once, "
    f"unread by slot {ledger.unread}"
  )
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"segments": rows, **ledger.__dict__}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
