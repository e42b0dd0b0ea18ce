"""The comm and puller threads of a learner process (learner_process/listener.py), against a fake client."""

import threading
import time
import types

import grpc
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


def _listener(client, link) -> tuple[SyncerListener, threading.Event]:
  """A listener on `client` and `link` with no learner behind it; its stop event."""
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
  return listener, stop


def test_heartbeats_announce_only_versions_newer_than_held_and_again_until_pulled():
  client = _Client()
  link = SyncerLink(client, learner_id=0, layouts=[{}, {}, {}], layout_digest="")
  link.keep(FragmentState(fragment=0, version=3, values={}, digest="a"))  # Held: never pulled.
  link.keep(FragmentState(fragment=1, version=2, values={}, digest="b"))  # Older than 5.
  listener, stop = _listener(client, link)
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


class _Unavailable(grpc.RpcError):
  def code(self):
    return grpc.StatusCode.UNAVAILABLE

  def details(self):
    return "shard down"


@pytest.mark.parametrize("trouble", ["down", "slow"])
def test_a_down_or_slow_shard_never_holds_up_the_others_versions(trouble):
  """Two shards, a puller each. Shard 1 down: its pulls fail and back off; or slow: each of its
  pulls takes a second. Either way shard 0's versions, announced every 50 ms, are pulled at once.
  With one puller, a failed pull put it to sleep and dropped the other announcements with it,
  and a slow one made them wait, holding shard 0's versions back for up to seconds."""
  pulled, attempts = [], {0: 0, 1: 0}

  class _Sharded:
    def pull(self, learner_id, p, known, **kwargs):
      del learner_id, known, kwargs
      attempts[p] += 1
      if p % 2 and trouble == "down":
        raise _Unavailable()
      if p % 2:
        time.sleep(1.0)
        return
      pulled.append(time.monotonic())  # Nothing delivered: the next version is pulled too.

  client = _Sharded()
  link = SyncerLink(client, learner_id=0, layouts=[{}, {}], layout_digest="")
  listener, stop = _listener(client, link)
  pullers = [
    threading.Thread(target=listener.pull_loop, kwargs={"shard": s, "shards": 2}) for s in (0, 1)
  ]
  for t in pullers:
    t.start()
  latency = []
  try:
    for version in range(1, 61):  # 3 s of versions of both shards' fragments.
      announced = time.monotonic()
      before = len(pulled)
      listener._announce(1, version)  # Shard 1's first: its failure comes before shard 0's pull.
      listener._announce(0, version)
      while len(pulled) == before and time.monotonic() < announced + 5:
        time.sleep(0.002)
      latency.append(time.monotonic() - announced)
      time.sleep(0.05)
  finally:
    stop.set()
    listener.wake()
    for t in pullers:
      t.join(timeout=10)
  assert max(latency) < 0.4, sorted(latency)[-5:]
  assert 3 <= attempts[1] <= 30, attempts  # Retried, or slow: not once per 50 ms.
