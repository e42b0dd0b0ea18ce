"""The comm and puller threads of a learner process (learner_process/listener.py), against a fake client."""

import threading
import time
import types

import pytest

from ddiloco.learner_process.inbox import Inbox
from ddiloco.learner_process.link import SyncerLink
from ddiloco.learner_process.listener import SyncerListener
from ddiloco.learner_process.session import SyncerSession
from ddiloco.protocol import FragmentState

pytestmark = pytest.mark.timeout(60)  # Threads: a hang must fail the test.


class _Client:
  """Heartbeats that report versions 3, 5 and 0 of three fragments; pulls that fail to deliver."""

  def __init__(self):
    self.pulls: list[tuple[int, int]] = []
    self.heartbeats = 0

  def heartbeat(self, learner_id, *, step=0, step_time_s=0.0):
    del learner_id, step, step_time_s
    self.heartbeats += 1
    return types.SimpleNamespace(
      registered=True, fleet_step=7, versions=[3, 5, 0], merged_steps=[1, 2, 3]
    )

  def pull(self, learner_id, p, known, **kwargs):
    del learner_id, kwargs
    self.pulls.append((p, known))  # None: nothing delivered, so heartbeats announce it again.


def test_heartbeats_announce_only_versions_newer_than_held_and_again_until_pulled():
  client = _Client()
  link = SyncerLink(client, learner_id=0, layouts=[{}, {}, {}], layout_digest="")
  link.keep(FragmentState(fragment=0, version=3, values={}, digest="a"))  # Held: never pulled.
  link.keep(FragmentState(fragment=1, version=2, values={}, digest="b"))  # Older than 5.
  session = SyncerSession(
    learner=types.SimpleNamespace(), client=client, link=link, event=lambda *a, **k: None
  )
  session.heartbeat_interval_s = 0.01
  stop = threading.Event()
  listener = SyncerListener(
    learner_id=0,
    client=client,
    link=link,
    session=session,
    inbox=Inbox(),
    stop=stop,
    event=lambda *a, **k: None,
    pace=lambda: (0, 0.0),
    on_request=lambda: None,
  )
  threads = [threading.Thread(target=f) for f in (listener.comm_loop, listener.pull_loop)]
  for t in threads:
    t.start()
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and (client.heartbeats < 5 or len(client.pulls) < 4):
    time.sleep(0.01)
  stop.set()
  listener.wake()
  for t in threads:
    t.join(timeout=10)
  assert set(client.pulls) == {(1, 2), (2, -1)}
  assert len(client.pulls) >= 4  # Announced again by later heartbeats, since never delivered.
