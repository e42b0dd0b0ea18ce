"""Tests of ddiloco.checkpoint.journal and of the service's rule that only durable versions are served.

Fault injection: the journal's fsync (or write) raises ENOSPC at a chosen merge. That version must
never reach a learner (announcement, pull, Register, Heartbeat, Status), the service must halt
(nothing merges after), and the versions learners saw before must stay the newest served.
"""

import errno
import json
import threading
import time

import grpc
import numpy as np
import pytest

from ddiloco.checkpoint import journal as journal_lib
from ddiloco.fragments.digest import values_digest
from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import Report, SyncerConfig
from ddiloco.transport.client import SyncerClient, fragment_layouts

pytestmark = pytest.mark.timeout(60)  # Sockets and threads: a hang must fail the test.

DIGEST = "L"
FRAGMENTS = [["a/w"], ["b/w"]]
INIT = {
  "a/w": np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8),
  "b/w": np.linspace(0.0, 2.0, 30, dtype=np.float32),
}
LAYOUTS = fragment_layouts(FRAGMENTS, INIT)


def _event(p: int, v: int):
  return journal_lib.MergeEvent(p, v, 0.0, (0,), (1.0,), 1, 0.0, 0.0, 0.0, f"d{p}.{v}")


def _no_space(*_):
  raise OSError(errno.ENOSPC, "No space left on device")


# -- the journal --------------------------------------------------------------------------------


def test_append_syncs_each_line_and_records_the_digest(tmp_path, monkeypatch):
  synced = []
  real_fsync = journal_lib.os.fsync
  monkeypatch.setattr(journal_lib.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
  journal = journal_lib.MergeJournal(str(tmp_path / "j.jsonl"))
  synced.clear()  # Opening syncs the folder.
  journal.append(_event(0, 1))
  journal.append(_event(1, 1))
  journal.append(_event(0, 2))
  journal.close()
  assert len(synced) == 3  # One fsync per line, each before append returned.
  assert journal_lib.read_journal_records(journal.path) == {
    0: {1: "d0.1", 2: "d0.2"},
    1: {1: "d1.1"},
  }
  assert journal_lib.read_journal(journal.path) == {0: 2, 1: 1}


def test_a_short_write_raises_and_its_torn_line_is_cut_at_the_next_open(tmp_path, monkeypatch):
  path = str(tmp_path / "j.jsonl")
  journal = journal_lib.MergeJournal(path)
  journal.append(_event(0, 1))
  real_write = journal_lib.os.write
  monkeypatch.setattr(journal_lib.os, "write", lambda fd, data: real_write(fd, data[:10]))
  with pytest.raises(OSError, match="wrote 10 of"):
    journal.append(_event(0, 2))
  monkeypatch.undo()
  journal.close()
  with open(path, "rb") as f:
    assert not f.read().endswith(b"\n")
  again = journal_lib.MergeJournal(path)  # Cuts the torn line: the next line starts clean.
  again.append(_event(0, 3))
  again.close()
  with open(path) as f:
    lines = f.read().splitlines()
  assert [json.loads(line)["version"] for line in lines] == [1, 3]


# -- the service: served == durable ---------------------------------------------------------------


def _push_answer(svc, p: int, step: int, shift: float) -> int:
  """Opens round (p, step) and files learner 0's answer to it; returns the round's base version."""
  with svc.lock:
    request = svc.core.open_round(p, step)
    assert request is not None
    values = {
      k: v + np.float32(shift) for k, v in svc.core.values_at(p, request.base_version).items()
    }
    report = Report(
      learner_id=0,
      fragment=p,
      values=values,
      tokens=64,
      steps=4,
      anchor_version=request.base_version,
      step=step + 1,
      round_step=step,
    )
    assert svc.core.report(report).status == "accepted"
    svc.lock.notify_all()
  return request.base_version


def _wait(predicate, what: str, timeout_s: float = 20.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


def _pull(client, p: int, known: int):
  layout = LAYOUTS[p]
  return client.pull(
    0,
    p,
    known,
    layout_keys=list(layout),
    shapes={k: s for k, (s, _) in layout.items()},
    dtypes={k: d for k, (_, d) in layout.items()},
  )


def _read_into(stream, events: list) -> None:
  try:
    events.extend(stream)
  except grpc.RpcError as e:  # Only a clean end of the stream leaves `events` whole.
    events.append(e.code())


@pytest.mark.parametrize("hook", ["record", "on_merge"])
@pytest.mark.parametrize("failing", ["fsync", "write"])
@pytest.mark.integration
def test_a_merge_the_journal_cannot_record_is_never_served(
  tmp_path, monkeypatch, caplog, failing, hook
):
  """Either hook runs before the version is served; an OSError from either halts the service."""
  journal = journal_lib.MergeJournal(str(tmp_path / journal_lib.JOURNAL_NAME))
  svc = make_syncer(
    fragment_keys=FRAGMENTS,
    init_values=INIT,
    syncer_config=SyncerConfig(min_quorum=1, use_grace=False),
    service_config=ServiceConfig(
      uplink_codec="fp32", downlink_codec="int8", liveness_timeout_s=600.0
    ),
    layout_digest=DIGEST,
    **{hook: journal.append},
  )
  srv = serve(svc)
  client = SyncerClient(f"127.0.0.1:{srv.port}", deadline_s=10.0)
  announced: list = []
  reader = None
  try:
    client.wait_ready(10)
    client.register(0, layout_digest=DIGEST, num_fragments=2)
    for p in (0, 1):
      assert _pull(client, p, -1).version == 0
    stream = client.rounds(0)
    reader = threading.Thread(target=_read_into, args=(stream, announced), daemon=True)
    reader.start()
    # A durable merge of fragment 1 is served as usual.
    _push_answer(svc, 1, 1, 0.25)
    _wait(lambda: svc.served_versions() == [0, 1], "version 1 of fragment 1 to be served")
    published = svc.published_digests()
    assert journal_lib.read_journal(journal.path) == {1: 1}
    # The disk is full: fragment 0's merge cannot be journaled.
    monkeypatch.setattr(journal_lib.os, failing, _no_space)
    _push_answer(svc, 0, 3, 0.5)
    _wait(lambda: svc.halted() is not None, "the service to halt")
    monkeypatch.undo()
    assert "No space left on device" in svc.halted()
    assert "syncer halted" in caplog.text
    # The core merged (version 1 of fragment 0 exists in memory) but nothing serves it.
    with svc.lock:
      assert svc.core.version(0) == 1
    assert svc.served_versions() == [0, 1]
    assert svc.published_digests() == published  # No (0, 1).
    assert [(e.fragment, e.version) for e in svc.merge_log()] == [(1, 1)]
    assert list(client.heartbeat(0).versions) == [0, 1]
    assert list(client.status().versions) == [0, 1]
    assert list(client.register(0, layout_digest=DIGEST, num_fragments=2).versions) == [0, 1]
    state = _pull(client, 0, -1)
    assert (state.version, state.digest) == (0, values_digest({"a/w": INIT["a/w"]}))
    assert _pull(client, 0, 0) is None  # Version 0 is the newest served.
    # Halted: a round with its quorum does not merge, not even at a flushing stop.
    _push_answer(svc, 1, 4, 0.125)
  finally:
    svc.stop(flush=True)  # Closes the Rounds stream after its queued events: `announced` is whole.
    if reader is not None:
      reader.join(timeout=10)
    srv.stop(grace_s=0.5)
    client.close()
    journal.close()
  assert not reader.is_alive()
  with svc.lock:
    assert svc.core.version(1) == 1
  assert (0, 1) not in announced  # The learner was never told.
  assert announced[-1] == (1, 1)  # Its last announcement; the stream ended cleanly.
  records = journal_lib.read_journal_records(journal.path)
  assert records.get(1) == {1: published[(1, 1)]}
  if failing == "write":
    assert 0 not in records  # An fsync failure may leave the line: a restart then skips past it.
