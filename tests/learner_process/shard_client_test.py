"""A learner's client of a sharded syncer (learner_process/shard_client.py) with a stale shard map,
against fake shards: a shard refusing a fragment as another's, or answering as another shard, makes
the client ask shard 0 again and take its map; the calls then reach the right shards.

Four fragments. The fakes own fragments by the shard count of the map they advertise (p mod S).
"""

import threading

import grpc
import pytest

from ddiloco.fragments import shards
from ddiloco.learner_process.shard_client import ShardedClient
from ddiloco.syncer.types import Report
from ddiloco.transport.proto import syncer_pb2

P = 4


class _Refused(grpc.RpcError):
  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(details)
    self._code, self._details = code, details

  def code(self):
    return self._code

  def details(self):
    return self._details


class _World:
  """Fake shards by address; each is shard `index` of the map `addresses`."""

  def __init__(self, addresses: list[str]):
    self.addresses = list(addresses)
    self.shards = {a: _FakeShard(self, a, i) for i, a in enumerate(addresses)}

  def reshard(self, addresses: list[str]) -> None:
    """The syncer comes back with another map: each address serves the shard of its place."""
    self.addresses = list(addresses)
    for i, a in enumerate(addresses):
      if a in self.shards:
        self.shards[a].index = i
      else:
        self.shards[a] = _FakeShard(self, a, i)

  def connect(self, address: str) -> "_Client":
    return _Client(self.shards[address])


class _Client:
  """A learner's client of one fake shard (a new one per connect, as `SyncerClient`s are)."""

  def __init__(self, shard: "_FakeShard"):
    self._shard = shard
    self.closed = False

  def __getattr__(self, name):
    return getattr(self._shard, name)

  def close(self) -> None:
    self.closed = True


class _Stream:
  """A Rounds stream with no events, until cancelled."""

  def __init__(self):
    self._done = threading.Event()

  def __iter__(self):
    self._done.wait(30)
    return iter(())

  def cancel(self) -> None:
    self._done.set()


class _FakeShard:
  deadline_s = transfer_deadline_s = 1.0
  max_chunk_bytes = 1024
  bytes_up = bytes_down = 0

  def __init__(self, world: _World, address: str, index: int):
    self._world, self.address, self.index = world, address, index
    self.registrations = 0
    self.pushed: list[int] = []
    self._sessions: dict[int, str] = {}

  def _owns(self, p: int) -> bool:
    return shards.shard_of(p, len(self._world.addresses)) == self.index

  def register(self, learner_id: int, **kwargs) -> syncer_pb2.RegisterResponse:
    self.registrations += 1
    self._sessions[learner_id] = f"{self.address}/{self.registrations}"
    return syncer_pb2.RegisterResponse(
      shard=self.index,
      shard_addresses=self._world.addresses if len(self._world.addresses) > 1 else [],
      versions=[0] * P,
    )

  def session(self, learner_id: int) -> str:
    return self._sessions.get(learner_id, "")

  def heartbeat(self, learner_id: int, **kwargs) -> syncer_pb2.HeartbeatResponse:
    return syncer_pb2.HeartbeatResponse(registered=True, versions=[0] * P, merged_steps=[-1] * P)

  def status(self) -> syncer_pb2.StatusResponse:
    return syncer_pb2.StatusResponse(shard=self.index)

  def push(self, report: Report, codec: str, **kwargs) -> str:
    if not self._owns(report.fragment):
      raise _Refused(
        grpc.StatusCode.OUT_OF_RANGE, f"Fragment {report.fragment} {shards.NOT_OWNED}; ..."
      )
    self.pushed.append(report.fragment)
    return "accepted"

  def rounds(self, learner_id: int) -> _Stream:
    return _Stream()


def _report(p: int) -> Report:
  return Report(learner_id=0, fragment=p, values={}, tokens=1, steps=1, anchor_version=0, step=1)


def _client(world: _World) -> ShardedClient:
  client = ShardedClient(world.connect(world.addresses[0]), world.connect)
  client.register(0, layout_digest="L", num_fragments=P)
  assert client.num_shards == len(world.addresses)
  return client


def test_a_shard_refusing_a_fragment_as_anothers_makes_the_client_take_shard_0s_new_map():
  # Two shards, then three (the syncer restarted with another shard count, each shard on a fresh
  # workdir): the learner's map routes fragment 3 to shard 1 (3 mod 2), which now owns 1 only.
  world = _World(["s0", "s1"])
  client = _client(world)
  assert client.push(_report(3), "fp32") == "accepted"
  world.reshard(["s0", "s1", "s2"])
  with pytest.raises(grpc.RpcError) as e:
    client.push(_report(3), "fp32")
  assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
  assert not client.heartbeat(0).registered  # Shard 1 stale: the comm thread registers.
  client.register(0, layout_digest="L", num_fragments=P)
  assert client.num_shards == 3 and world.shards["s0"].registrations == 2
  assert [world.shards[a].registrations for a in ("s1", "s2")] == [2, 1]
  assert client.push(_report(3), "fp32") == "accepted"  # 3 mod 3: shard 0 now.
  assert world.shards["s0"].pushed == [3] and world.shards["s1"].pushed == [3]
  assert client.heartbeat(0).registered


def test_a_shard_answering_as_another_makes_the_client_take_shard_0s_new_map():
  # Shard 1 moved to another address; its old address now serves another shard of the new map.
  world = _World(["s0", "s1", "s2"])
  client = _client(world)
  rounds = client.rounds(0)
  before = client._all()
  world.reshard(["s0", "s1b", "s1"])  # s1 is shard 2 now; shard 1 serves on s1b.
  client._all()[1].stale = True  # Its heartbeat said it forgot this learner (it restarted).
  client.register(0, layout_digest="L", num_fragments=P)  # s1 answers as shard 2: no error.
  assert world.shards["s0"].registrations == 1  # Not yet: the map is marked stale.
  client.register(0, layout_digest="L", num_fragments=P)
  assert world.shards["s0"].registrations == 2
  assert [s.client.address for s in client._all()] == ["s0", "s1b", "s1"]
  assert [s.client.closed for s in before] == [False, True, True]  # New clients for 1 and 2.
  assert [world.shards[a].registrations for a in ("s1b", "s1")] == [1, 3]  # s1: once as 2.
  assert rounds.cancelled  # Its listener subscribes again, to the new map.
  rounds = client.rounds(0)
  assert client.push(_report(1), "fp32") == "accepted"
  assert world.shards["s1b"].pushed == [1]
  rounds.cancel()
