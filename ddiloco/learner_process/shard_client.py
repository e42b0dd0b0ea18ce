"""A learner's client of a sharded syncer: one `SyncerClient` per shard, behind the one client's calls.

The learner is given one address (shard 0's). Register there answers with every shard's address
(`RegisterResponse.shard_addresses`; empty for an unsharded syncer, and then this client is a
pass-through to the one client). `ShardedClient` then registers with every shard and routes each
fragment's Push, Pull and Recover to its owner (fragment p to shard p mod S, fragments/shards.py);
Heartbeat and Leave go to every shard, and the Rounds streams of all shards are merged into one.
`SyncerLink`, the session and the listener threads above it see one syncer.

Each shard fails alone (docs/resilience.md, "A sharded syncer"):
- A shard that forgets this learner (it restarted, or declared it dead) is marked stale: the next
  registration (the comm thread's, asked for by a heartbeat that answers `registered=False`)
  registers with the stale shards only, so the other shards keep their sessions and deliveries. A
  restarted shard that lost merges asks for them back in its answer (`recover`), and `SyncerLink`
  hands them back through `recover`, routed to it: no merge is lost.
- A shard that is down does not hold up the others: its heartbeat failure is ignored while another
  shard answers, registering with it is retried with a backoff (never blocking the heartbeats of
  the others), and its Rounds stream is renewed by its own thread. Pushes and pulls to it fail and
  are retried by their callers as for an unsharded syncer.
- A stale shard map (a shard restarted on another address, or the shards' addresses changed):
  a shard that refuses a fragment as another's (OUT_OF_RANGE, `shards.NOT_OWNED`) or answers
  Register as another shard marks the map stale; the next registration asks shard 0 again, and
  its answer's `shard_addresses` replace the map: the shards whose address changed get new
  clients (and registrations), and the Rounds streams are subscribed anew. The call refused is
  not retried (a push's answer is dropped, a pull comes again with the next announcement).
"""

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from ddiloco.fragments import shards
from ddiloco.learner_process.retry import UNREGISTERED, Backoff
from ddiloco.protocol import RoundRequest
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.proto import syncer_pb2

log = logging.getLogger(__name__)


class _Shard:
  """One shard's client and this learner's standing there."""

  def __init__(self, index: int, client: SyncerClient):
    self.index = index
    self.client = client
    self.stale = True  # Not registered (yet, or the shard forgot this learner).
    self.retry_at = 0.0  # When registering a stale shard may be tried again.
    self.backoff = Backoff(initial_s=0.2, max_s=5.0, seed=index)
    self.versions: dict[int, int] = {}  # Its fragments' versions, as last told.
    self.merged_steps: dict[int, int] = {}
    self.fleet_step = 0
    self.answer: Any = None  # Its newest RegisterResponse.


class ShardedClient:
  """The syncer's shards as one client (see module docstring).

  Args:
    client: the client of shard 0 (the address the learner was given).
    connect: makes the client of another shard from its address (the same token and TLS).
  """

  def __init__(self, client: SyncerClient, connect: Callable[[str], SyncerClient]):
    self._connect = connect
    self._lock = threading.Lock()
    self._shards = [_Shard(0, client)]
    self._map_stale = False  # A shard said the map is wrong: shard 0 is asked again.
    self._rounds: list[MergedRounds] = []  # Subscribed anew when the map changes.
    self.address = client.address
    self.deadline_s = client.deadline_s
    self.transfer_deadline_s = client.transfer_deadline_s
    self.max_chunk_bytes = client.max_chunk_bytes

  # -- the shards --------------------------------------------------------------------------------

  @property
  def num_shards(self) -> int:
    with self._lock:
      return len(self._shards)

  def _all(self) -> list[_Shard]:
    with self._lock:
      return list(self._shards)

  def _owner(self, fragment: int) -> _Shard:
    shards_ = self._all()
    return shards_[shards.shard_of(fragment, len(shards_))]

  def _routed(self, shard: _Shard, learner_id: int, call: Callable[[], Any]) -> Any:
    """Runs a call to one shard; a refusal that says it forgot this learner marks it stale,
    unless this learner registered there again while the call ran (its session changed)."""
    session = shard.client.session(learner_id)
    try:
      return call()
    except grpc.RpcError as e:
      if e.code() in UNREGISTERED and shard.client.session(learner_id) == session:
        shard.stale = True
      elif e.code() == grpc.StatusCode.OUT_OF_RANGE and shards.NOT_OWNED in (e.details() or ""):
        log.warning(
          "learner %d: shard %d refused a fragment as another's: the shard map is stale",
          learner_id,
          shard.index,
        )
        self._map_stale = shard.stale = True  # Its heartbeat asks for a registration.
      raise

  @property
  def bytes_up(self) -> int:
    return sum(s.client.bytes_up for s in self._all())

  @property
  def bytes_down(self) -> int:
    return sum(s.client.bytes_down for s in self._all())

  def close(self) -> None:
    for s in self._all():
      s.client.close()

  def wait_ready(self, timeout_s: float) -> None:
    self._all()[0].client.wait_ready(timeout_s)

  def session(self, learner_id: int) -> str:
    return self._all()[0].client.session(learner_id)

  def learner_metadata(self, learner_id: int) -> tuple[tuple[str, str], ...]:
    return self._all()[0].client.learner_metadata(learner_id)

  def status(self) -> syncer_pb2.StatusResponse:
    return self._all()[0].client.status()

  # -- registration --------------------------------------------------------------------------------

  def register(self, learner_id: int, **kwargs) -> syncer_pb2.RegisterResponse:
    """Registers with every stale shard (every shard the first time), then answers as one syncer.

    Shard 0's answer names the shards; a shard that is down is retried later (with a backoff)
    while the others' registrations stand, and its fragments keep the versions last heard.

    Raises:
      grpc.RpcError: if shard 0 refuses or cannot be reached the first time, or a shard refuses
        for a reason other than being unreachable (e.g. a layout mismatch).
    """
    shards_ = self._all()
    if not any(s.stale for s in shards_):
      for s in shards_:  # Asked to register with none stale: a full re-registration.
        s.stale = True
    first = shards_[0]
    if self._map_stale:
      first.stale = True
    if first.stale:
      self._register_one(first, learner_id, kwargs, lenient=len(shards_) > 1)
      if first.answer is not None and not first.stale:
        self._map_stale = False
        self._set_map(list(first.answer.shard_addresses))
    for s in self._all()[1:]:
      if s.stale and time.monotonic() >= s.retry_at:
        self._register_one(s, learner_id, kwargs, lenient=True)
    return self._merged_answer()

  def _register_one(self, shard: _Shard, learner_id: int, kwargs: dict, *, lenient: bool) -> None:
    try:
      resp = shard.client.register(learner_id, **kwargs)
    except grpc.RpcError as e:
      if not lenient or e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        raise
      if e.code() == grpc.StatusCode.FAILED_PRECONDITION and shard.answer is None:
        raise  # A first registration refused (e.g. another layout): not a shard being down.
      shard.retry_at = time.monotonic() + shard.backoff.next_delay()
      log.warning("learner %d: syncer shard %d: %s", learner_id, shard.index, e.code().name)
      return
    if resp.shard != shard.index:
      message = f"The syncer at {shard.client.address} is shard {resp.shard}, not {shard.index}."
      if shard.index == 0:
        raise ValueError(message)  # The learner was given another shard's address.
      log.warning(
        "learner %d: %s The shard map is stale: shard 0 is asked again.", learner_id, message
      )
      self._map_stale = True
      shard.retry_at = time.monotonic() + shard.backoff.next_delay()
      return
    shard.answer, shard.stale = resp, False
    shard.backoff.reset()
    num = max(1, len(resp.shard_addresses))
    shard.versions = {p: int(v) for p, v in enumerate(resp.versions) if p % num == shard.index}
    shard.fleet_step = int(resp.fleet_step)

  def _set_map(self, addresses: list[str]) -> None:
    """Makes shard 0's list of every shard's address the map (shard 0's own entry aside: the
    learner keeps the address it was given, a proxy's perhaps). A shard whose address changed
    gets a new client; with another shard count every shard registers again, and the Rounds
    streams are subscribed anew."""
    with self._lock:
      old = self._shards
      if [s.client.address for s in old[1:]] == addresses[1:]:
        return
      shards_ = [old[0]]
      for i, address in enumerate(addresses[1:], start=1):
        kept = i < len(old) and old[i].client.address == address
        shards_.append(old[i] if kept else _Shard(i, self._connect(address)))
      if len(shards_) != len(old):
        for s in shards_[1:]:
          s.stale = True
      gone = [s for s in old if s not in shards_]
      self._shards = shards_
      rounds, self._rounds = self._rounds, []
    if len(old) > 1:
      log.warning("the syncer's shard map changed: %s", addresses)
    for s in gone:
      s.client.close()
    for merged in rounds:
      merged.cancel()  # Its listener subscribes again, to the new map.

  def _merged_answer(self) -> syncer_pb2.RegisterResponse:
    shards_ = self._all()
    resp = syncer_pb2.RegisterResponse()
    resp.CopyFrom(shards_[0].answer)
    if len(shards_) == 1:
      return resp
    num = len(resp.versions)
    del resp.versions[:]
    resp.versions.extend(self._version_list(shards_, num))
    resp.fleet_step = max(s.fleet_step for s in shards_)
    del resp.recover[:]
    # Only a shard registered just now asks for versions: each asks for its own fragments.
    resp.recover.extend(
      sorted({int(p) for s in shards_ if s.answer is not None for p in s.answer.recover})
    )
    for s in shards_[1:]:
      if s.answer is not None:
        del s.answer.recover[:]  # Handed back once (`SyncerLink.register`).
    del shards_[0].answer.recover[:]
    return resp

  @staticmethod
  def _version_list(shards_: list[_Shard], num: int) -> list[int]:
    owned = {p: s for s in shards_ for p in s.versions}
    return [owned[p].versions[p] if p in owned else 0 for p in range(num)]

  # -- per-fragment calls ------------------------------------------------------------------------

  def push(self, report, codec: str, **kwargs):
    s = self._owner(report.fragment)
    return self._routed(s, report.learner_id, lambda: s.client.push(report, codec, **kwargs))

  def recover(self, learner_id: int, fragment: int, version: int, values: Mapping) -> Any:
    s = self._owner(fragment)
    return self._routed(
      s, learner_id, lambda: s.client.recover(learner_id, fragment, version, values)
    )

  def pull(self, learner_id: int, fragment: int, known_version: int, **kwargs):
    s = self._owner(fragment)
    return self._routed(
      s, learner_id, lambda: s.client.pull(learner_id, fragment, known_version, **kwargs)
    )

  # -- calls to every shard ----------------------------------------------------------------------

  def heartbeat(self, learner_id: int, *, step: int = 0, step_time_s: float = 0.0):
    """Heartbeats every registered shard; `registered` is False when a stale shard is due for
    registering again. Raises the error only when no shard answered."""
    shards_ = self._all()
    if len(shards_) == 1:
      return shards_[0].client.heartbeat(learner_id, step=step, step_time_s=step_time_s)
    errors, answered = [], 0
    for s in shards_:
      if s.stale:
        continue
      try:
        hb = self._routed(
          s,
          learner_id,
          lambda s=s: s.client.heartbeat(learner_id, step=step, step_time_s=step_time_s),
        )
      except grpc.RpcError as e:
        errors.append(e)
        continue
      answered += 1
      if not hb.registered:
        s.stale = True
        continue
      num = len(shards_)
      s.versions = {p: int(v) for p, v in enumerate(hb.versions) if p % num == s.index}
      s.merged_steps = {p: int(v) for p, v in enumerate(hb.merged_steps) if p % num == s.index}
      s.fleet_step = int(hb.fleet_step)
    if not answered and errors:
      raise errors[0]
    now = time.monotonic()
    num = len(shards_[0].answer.versions)
    steps = {p: st for s in shards_ for p, st in s.merged_steps.items()}
    return syncer_pb2.HeartbeatResponse(
      registered=not any(s.stale and self._reachable(s, now) for s in shards_),
      versions=self._version_list(shards_, num),
      fleet_step=max(s.fleet_step for s in shards_),
      merged_steps=[steps.get(p, -1) for p in range(num)],
    )

  @staticmethod
  def _reachable(shard: _Shard, now: float) -> bool:
    """Whether a stale shard is due for registering again and answers (a Status call): a shard
    that is down is not registered with over and over (each registration re-pulls everything)."""
    if now < shard.retry_at:
      return False
    try:
      shard.client.status()
    except grpc.RpcError:
      shard.retry_at = now + shard.backoff.next_delay()
      return False
    return True

  def leave(self, learner_id: int) -> bool:
    """Leaves every shard that can be reached; whether any knew this learner."""
    known, errors = False, []
    for s in self._all():
      try:
        known = s.client.leave(learner_id) or known
      except grpc.RpcError as e:
        errors.append(e)
    if errors and len(errors) == self.num_shards:
      raise errors[0]
    return known

  def rounds(self, learner_id: int):
    """The Rounds streams of every shard as one (each shard announces only its own fragments)."""
    shards_ = self._all()
    if len(shards_) == 1:
      return shards_[0].client.rounds(learner_id)
    merged = MergedRounds(shards_, learner_id, len(shards_))
    with self._lock:
      self._rounds = [r for r in self._rounds if not r.cancelled] + [merged]
    return merged


class MergedRounds:
  """The `Rounds` streams of several shards as one iterable, each renewed by its own thread.

  It never ends on its own (a shard's stream that fails or reaches its deadline is subscribed
  again after a backoff); `cancel()` ends it.
  """

  def __init__(self, shards_: list[_Shard], learner_id: int, num_shards: int):
    self._queue: queue.Queue = queue.Queue()
    self._cancelled = threading.Event()
    self._lock = threading.Lock()
    self._streams: dict[int, Any] = {}
    self._threads = [
      threading.Thread(
        target=self._pump,
        args=(shard, learner_id, num_shards),
        name=f"rounds-shard-{shard.index}",
        daemon=True,
      )
      for shard in shards_
    ]
    for t in self._threads:
      t.start()

  def _pump(self, shard: _Shard, learner_id: int, num_shards: int) -> None:
    backoff = Backoff(initial_s=0.1, max_s=2.0, seed=1000 + shard.index)
    while not self._cancelled.is_set():
      if shard.stale:  # The comm thread registers first; a stream before that is refused.
        self._cancelled.wait(0.05)
        continue
      session = shard.client.session(learner_id)
      try:
        stream = shard.client.rounds(learner_id)
        with self._lock:
          self._streams[shard.index] = stream
        if self._cancelled.is_set():
          stream.cancel()
          return
        for event in stream:
          if self._cancelled.is_set():
            return
          if (
            isinstance(event, RoundRequest) or shards.shard_of(event[0], num_shards) == shard.index
          ):
            self._queue.put(event)
          backoff.reset()
      except grpc.RpcError as e:
        if e.code() in UNREGISTERED and shard.client.session(learner_id) == session:
          shard.stale = True  # The comm thread's next heartbeat registers with it again.
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
          self._cancelled.wait(backoff.next_delay())

  def __iter__(self):
    while not self._cancelled.is_set():
      try:
        yield self._queue.get(timeout=0.25)
      except queue.Empty:
        continue

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def cancel(self) -> None:
    self._cancelled.set()
    with self._lock:
      streams = list(self._streams.values())
    for stream in streams:
      stream.cancel()
    for t in self._threads:
      if t is not threading.current_thread():
        t.join(timeout=5.0)
