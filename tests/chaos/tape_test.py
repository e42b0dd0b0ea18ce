"""The event tape: round trip, line flushing, truncated lines (also after a real SIGKILL)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ddiloco.chaos.tape import TapeWriter, read_tape
from ddiloco.faults import FaultEvent


class _Clock:
  def __init__(self, t: float):
    self.t = t

  def __call__(self) -> float:
    return self.t


def test_round_trip_with_default_times_and_numpy(tmp_path):
  path = tmp_path / "tape.jsonl"
  clock = _Clock(100.0)
  with TapeWriter(path, clock=clock) as tape:
    assert tape.t0 == 100.0
    clock.t = 101.5
    tape.record("learner_up", learner=np.int64(2))  # t = 101.5 − 100 = 1.5
    tape.record(
      "merge", t=2.25, fragment=3, version=np.int32(7), contributors=(0, 2), tokens=np.int64(1024)
    )
    tape.record(
      "final_digests", t=9.0, role="syncer", digests={"3": {"version": 7, "digest": "ab"}}
    )
  assert read_tape(path) == [
    {"t": 1.5, "kind": "learner_up", "learner": 2},
    {
      "t": 2.25,
      "kind": "merge",
      "fragment": 3,
      "version": 7,
      "contributors": [0, 2],
      "tokens": 1024,
    },
    {
      "t": 9.0,
      "kind": "final_digests",
      "role": "syncer",
      "digests": {"3": {"version": 7, "digest": "ab"}},
    },
  ]


def test_record_event_keeps_params_and_planned_time(tmp_path):
  path = tmp_path / "tape.jsonl"
  event = FaultEvent(12.5, "kill_learner", 1, {"restart_delay_s": 3.0})
  with TapeWriter(path) as tape:
    rec = tape.record_event(event, t=12.75)
  assert rec == {
    "t": 12.75,
    "kind": "kill_learner",
    "scheduled_t": 12.5,
    "learner": 1,
    "restart_delay_s": 3.0,
  }
  assert read_tape(path) == [rec]


def test_record_event_keeps_the_shard_of_a_syncer_event(tmp_path):
  path = tmp_path / "tape.jsonl"
  with TapeWriter(path) as tape:
    one = tape.record_event(FaultEvent(3.0, "kill_syncer", shard=1), t=3.5)
    every = tape.record_event(FaultEvent(4.0, "net_drop"), t=4.0)
  assert one == {"t": 3.5, "kind": "kill_syncer", "scheduled_t": 3.0, "shard": 1}
  assert "shard" not in every  # Every shard.
  assert read_tape(path) == [one, every]


def test_each_record_is_on_disk_before_close(tmp_path):
  path = tmp_path / "tape.jsonl"
  tape = TapeWriter(path)
  tape.record("syncer_up", t=0.5, port=1234)
  assert read_tape(path) == [{"t": 0.5, "kind": "syncer_up", "port": 1234}]  # Still open.
  tape.close()
  with pytest.raises(ValueError, match="closed"):
    tape.record("syncer_down", t=1.0)


def test_unknown_kind_and_bad_values_refused(tmp_path):
  with TapeWriter(tmp_path / "tape.jsonl") as tape:
    with pytest.raises(ValueError, match="Unknown tape kind"):
      tape.record("mrege", t=1.0)
    with pytest.raises(TypeError):
      tape.record("eval", t=1.0, loss=object())
  assert read_tape(tmp_path / "tape.jsonl") == []


def test_truncated_last_line_is_ignored(tmp_path):
  path = tmp_path / "tape.jsonl"
  with TapeWriter(path) as tape:
    for i in range(3):
      tape.record("eval", t=float(i), loss=1.0)
  with open(path, "a") as f:
    f.write('{"t": 3.0, "kind": "ev')  # A writer killed mid-line.
  assert [r["t"] for r in read_tape(path)] == [0.0, 1.0, 2.0]


def test_complete_last_line_without_newline_is_kept(tmp_path):
  path = tmp_path / "tape.jsonl"
  path.write_text('{"t": 0.0, "kind": "run_start"}\n{"t": 1.0, "kind": "run_end"}')
  assert [r["kind"] for r in read_tape(path)] == ["run_start", "run_end"]


def test_malformed_middle_line_raises(tmp_path):
  path = tmp_path / "tape.jsonl"
  path.write_text(
    '{"t": 0.0, "kind": "run_start"}\n{"t": 1.0, "ki\n{"t": 2.0, "kind": "run_end"}\n'
  )
  with pytest.raises(ValueError, match=":2: malformed"):
    read_tape(path)
  path.write_text('{"kind": "run_start"}\n')
  with pytest.raises(ValueError, match="needs 't' and 'kind'"):
    read_tape(path)


def test_reopening_cuts_the_partial_line(tmp_path):
  path = tmp_path / "tape.jsonl"
  path.write_text('{"t": 0.0, "kind": "run_start"}\n{"t": 1.0, "kind": "le')
  with TapeWriter(path) as tape:
    tape.record("run_end", t=5.0)
  assert path.read_text() == '{"t": 0.0, "kind": "run_start"}\n{"t": 5.0, "kind": "run_end"}\n'
  path.write_text('{"t": 1.0, "kind": "le')  # Only a partial line: nothing is left of it.
  with TapeWriter(path) as tape:
    tape.record("run_end", t=6.0)
  assert read_tape(path) == [{"t": 6.0, "kind": "run_end"}]


_WRITER = """
import sys
from ddiloco.chaos.tape import TapeWriter
tape = TapeWriter(sys.argv[1])
pad = "x" * 4000  # Long lines: a kill mid-write is likely to cut one.
i = 0
while True:
  tape.record("eval", t=float(i), loss=1.0, seq=i, pad=pad)
  i += 1
"""


@pytest.mark.timeout(60)
@pytest.mark.integration
def test_sigkilled_writer_leaves_a_readable_tape(tmp_path):
  path = tmp_path / "tape.jsonl"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], cwd=root)
  try:
    deadline = time.monotonic() + 30
    while (not path.exists() or path.stat().st_size < 2_000_000) and time.monotonic() < deadline:
      time.sleep(0.02)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
  records = read_tape(path)
  assert len(records) > 100
  assert [r["seq"] for r in records] == list(range(len(records)))  # No line lost but the last.
  complete = path.read_text().count("\n")
  assert len(records) in (complete, complete + 1)  # + 1: the kill fell right before a newline.
