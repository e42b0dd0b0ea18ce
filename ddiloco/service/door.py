"""The syncer's door against hostile or overflowing clients: bounds, deadlines and admission.

Every call holds one thread for its whole life: a control call one of the synchronous gRPC
server's (service/service.py), a push or pull one of the bulk port's
(service/bulk_server.py), and a push handler blocks on the client's next chunk. Pieces here
keep any client, token holder or not, from starving the server or growing its memory:

- `StreamGate` admits data streams (pushes, pulls, Recovers): at most `total` at once,
  `per_learner` per learner id, and `unclaimed` that have not named their learner yet (a push
  names it in its first chunk). When the unclaimed places are full, a new push evicts the oldest
  unclaimed one still waiting for its first chunk: a client stalling before its first chunk cannot
  lock learners out, whose pushes name themselves at once. A push whose first chunk has arrived is not stalling
  (its handler may wait for the service's lock before it names its learner): it is not evicted.
- `PacedStream` reads a push's chunks (the bulk port's frames, a Recover's gRPC request iterator) in
  a helper thread, so the handler can wait for each chunk with a timeout: a stream silent for the
  idle deadline, or open past its total deadline, is ended with DEADLINE_EXCEEDED by the handler
  itself. (gRPC's synchronous request iterator has no timeout, and a call cancelled from another
  thread reaches the client as CANCELLED, not as a precise status.)
- `Watchdog` cancels streams whose *sends* are stuck (a pull or Rounds client that stopped reading):
  a send waits for the peer's window with no timeout (gRPC's flow control, a socket's buffer), and
  only a cancel frees it (the bulk port's cuts the socket).
- `parse_request` decodes unary requests without ever raising (garbage gets INVALID_ARGUMENT, counted,
  not gRPC's uncounted INTERNAL) and bounds every text field a client sends (`text_fault`).
- `is_loopback` and `port_in_use` back `serve`'s refusals to run open on a network or on a port
  another process holds.
"""

import dataclasses
import errno
import ipaddress
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from google.protobuf import descriptor, message

from ddiloco.transport.read_ahead import ReadAhead

# Longest text a client may send, by field name (characters); any other string field: `_TEXT_LIMIT`.
# Host names are at most 253 characters (RFC 1035); layout digests are hex sha256 (64); codec names
# are a few letters.
TEXT_LIMITS = {"host": 255, "layout_digest": 128, "codec": 16}
_TEXT_LIMIT = 256
# Characters of client text kept in a log line.
LOG_CHARS = 64


def clip(text: str, limit: int = LOG_CHARS) -> str:
  """`text` shortened to `limit` characters for a log line, quoted (no control characters)."""
  return repr(text if len(text) <= limit else text[:limit] + "...")


def text_fault(msg: message.Message) -> str | None:
  """Why a message's text is refused (a string field over its limit, nested messages included)."""
  for field, value in msg.ListFields():
    if field.type == descriptor.FieldDescriptor.TYPE_STRING:
      items = value if _repeated(field) else [value]
      limit = TEXT_LIMITS.get(field.name, _TEXT_LIMIT)
      for item in items:
        if len(item) > limit:
          return f"Field {field.name} has {len(item)} characters; at most {limit} are accepted."
    elif (
      field.type == descriptor.FieldDescriptor.TYPE_MESSAGE
      and not field.message_type.GetOptions().map_entry
    ):
      for item in value if _repeated(field) else [value]:
        fault = text_fault(item)
        if fault is not None:
          return fault
  return None


def _repeated(field: descriptor.FieldDescriptor) -> bool:
  return field.is_repeated


@dataclasses.dataclass(frozen=True)
class Garbled:
  """Stands for a request that could not be decoded or is out of bounds (see `parse_request`)."""

  reason: str


def parse_request(cls: type[message.Message]) -> Callable[[bytes], "message.Message | Garbled"]:
  """A gRPC request deserializer for `cls` that returns `Garbled` instead of raising.

  gRPC answers a deserializer's exception with INTERNAL before any handler runs, so nothing could
  count it; the handler turns `Garbled` into a counted INVALID_ARGUMENT.
  """

  def parse(data: bytes) -> message.Message | Garbled:
    try:
      msg = cls.FromString(data)
    except message.DecodeError as e:
      return Garbled(f"Undecodable {cls.__name__} ({len(data)} bytes): {e}")
    fault = text_fault(msg)
    return msg if fault is None else Garbled(f"{cls.__name__}: {fault}")

  return parse


class StreamGate:
  """Admission of data streams: at most `total` open at once, `per_learner` for any learner id and
  `unclaimed` (default: `total`) not yet counted against a learner.

  A stream is admitted in two steps: `enter` at its start, `claim` once its learner id is known (a
  Push names it in its first chunk; `StreamTicket.arrived` marks that chunk's arrival, after which
  the stream is no longer evicted). `StreamTicket.close` undoes both; it is idempotent, and every
  handler closes its ticket on every exit (service/streams.py), so the counts never leak: a
  stream counts against its learner from its claim until its handler ends, which may be after its
  client gave up (a client deadline, a dropped connection) while the server still reads or files.
  """

  def __init__(self, total: int, per_learner: int, unclaimed: int | None = None):
    self._total, self._per_learner = total, per_learner
    self._unclaimed_limit = total if unclaimed is None else unclaimed
    self._lock = threading.Lock()
    self._open = 0
    self._unclaimed = 0
    self._by_learner: Counter[int] = Counter()
    self._waiting: dict[int, StreamTicket] = {}  # Evictable unclaimed tickets, oldest first.

  def enter(
    self, learner_id: int | None = None, on_evict: Callable[[], None] | None = None
  ) -> "StreamTicket | None":
    """`admit`'s ticket, or None."""
    return self.admit(learner_id, on_evict)[0]

  def admit(
    self, learner_id: int | None = None, on_evict: Callable[[], None] | None = None
  ) -> "tuple[StreamTicket | None, str]":
    """(a ticket for a new stream, "") or (None, why: "total", "learner" or "unclaimed").

    None if `total` streams are open ("total"). A stream whose learner is known at once (a Pull)
    passes `learner_id`: it is claimed at entry and never counts as unclaimed; None if that learner
    has its share open too ("learner"). An unclaimed stream passes `on_evict`: when `unclaimed` are
    open, the oldest not yet `arrived` is evicted (its `on_evict` called; its place in the total is
    freed when it closes) to admit the new one; None if every one has arrived ("unclaimed").
    """
    evicted = None
    with self._lock:
      if self._open >= self._total:
        return None, "total"
      if learner_id is None:
        if self._unclaimed >= self._unclaimed_limit:
          if not self._waiting:
            return None, "unclaimed"
          evicted = self._waiting.pop(next(iter(self._waiting)))
          evicted._evicted = True
          self._unclaimed -= 1
        self._unclaimed += 1
      elif self._by_learner[learner_id] >= self._per_learner:
        return None, "learner"
      else:
        self._by_learner[learner_id] += 1
      self._open += 1
      ticket = StreamTicket(self)
      ticket._learner = learner_id
      if learner_id is None and on_evict is not None:
        ticket._on_evict = on_evict
        self._waiting[id(ticket)] = ticket
    if evicted is not None:
      evicted._on_evict()
    return ticket, ""

  def open_streams(self) -> tuple[int, dict[int, int]]:
    """(open streams, {learner id: its open streams})."""
    with self._lock:
      return self._open, dict(self._by_learner)

  def _arrive(self, ticket: "StreamTicket") -> bool:
    with self._lock:
      self._waiting.pop(id(ticket), None)
      return not ticket._evicted

  def _claim(self, ticket: "StreamTicket", learner_id: int) -> bool:
    with self._lock:
      if ticket._evicted or self._by_learner[learner_id] >= self._per_learner:
        return False
      self._by_learner[learner_id] += 1
      self._unclaimed -= 1
      self._waiting.pop(id(ticket), None)
      return True

  def _release(self, ticket: "StreamTicket", learner_id: int | None) -> None:
    with self._lock:
      self._open -= 1
      self._waiting.pop(id(ticket), None)
      if learner_id is None:
        if not ticket._evicted:  # An evicted ticket gave its unclaimed place up already.
          self._unclaimed -= 1
      else:
        self._by_learner[learner_id] -= 1
        if not self._by_learner[learner_id]:
          del self._by_learner[learner_id]


class StreamTicket:
  """One admitted stream (`StreamGate.enter`)."""

  def __init__(self, gate: StreamGate):
    self._gate = gate
    self._learner: int | None = None
    self._lock = threading.Lock()
    self._closed = False
    self._evicted = False
    self._on_evict: Callable[[], None] = lambda: None

  @property
  def evicted(self) -> bool:
    """Whether the stream was evicted to admit a newer one (it can no longer be claimed)."""
    return self._evicted

  def arrived(self) -> bool:
    """The stream's first chunk has arrived: it is no longer evicted for a newer stream. False if
    it was evicted already."""
    return self._gate._arrive(self)

  def claim(self, learner_id: int) -> bool:
    """Counts the stream against `learner_id`; False if that learner has its share open (or the
    stream was evicted meanwhile)."""
    if self._learner is not None:
      raise RuntimeError("A stream is claimed once.")
    if not self._gate._claim(self, learner_id):
      return False
    self._learner = learner_id
    return True

  def close(self) -> None:
    """Frees the stream's place (idempotent: called by the handler and at the call's end)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._gate._release(self, self._learner)


class StreamTimeout(Exception):
  """A request stream passed its idle or total deadline (`PacedStream`)."""


class PacedStream:
  """Iterates a gRPC request iterator with an idle deadline per item and a total deadline.

  A daemon thread moves items from `source` into a small queue (two items: gRPC's own flow control
  keeps bounding what the client may send ahead); iterating waits on the queue with a timeout and
  raises `StreamTimeout` when the next item is late. Call `close` when done: the reader thread ends
  when gRPC ends the call (its iterator then raises or stops), which the handler's return brings.

  Args:
    source: the request iterator.
    idle_s: longest wait for one item.
    total_s: longest time from construction to the last item.
    clock: monotonic clock.
  """

  def __init__(
    self,
    source: Iterator,
    *,
    idle_s: float,
    total_s: float,
    clock: Callable[[], float] = time.monotonic,
  ):
    self._idle_s = idle_s
    self._clock = clock
    self._deadline = clock() + total_s
    self._interrupted = threading.Event()
    self._ahead = ReadAhead(source, depth=2, name="syncer-push-reader")

  def __iter__(self):
    return self

  def __next__(self):
    if self._interrupted.is_set():
      raise StreamTimeout("evicted")
    now = self._clock()
    left = self._deadline - now
    if left <= 0:
      raise StreamTimeout("total")
    try:
      item = self._ahead.get(timeout=min(self._idle_s, left))
    except queue.Empty:
      raise StreamTimeout("idle" if self._clock() < self._deadline else "total") from None
    except StopIteration:
      if self._interrupted.is_set():
        raise StreamTimeout("evicted") from None
      raise
    if self._interrupted.is_set():
      raise StreamTimeout("evicted")
    return item

  def close(self) -> None:
    """Stops the reader handing over items (it exits once gRPC ends the call)."""
    self._ahead.stop()

  def interrupt(self) -> None:
    """Makes the next read raise `StreamTimeout("evicted")` (from any thread)."""
    self._interrupted.set()
    self._ahead.wake()  # Wakes a waiting reader; the flag says why (checked before each item too).


class Watchdog:
  """Cancels server-streaming calls whose sends are stuck, or that outlived their total deadline.

  gRPC's synchronous server blocks a handler in each send until the client's flow-control window
  takes the message: a client that stops reading holds the thread forever, and only a cancel frees
  it. Handlers send through `watched`, which marks each send busy until gRPC asks for the next
  message; a send busy for `idle_s` (or a call past its total deadline) is cut. A call waiting for
  something to send (a quiet Rounds stream) is not stuck. A cancelled call reaches the client as
  CANCELLED; `on_expire(reason)` is called first (the service counts it).

  Args:
    idle_s: longest time one send may take.
    on_expire: called with "idle" or "total" for each call cut.
    clock: monotonic clock.
  """

  def __init__(
    self,
    idle_s: float,
    on_expire: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
  ):
    self._idle_s = idle_s
    self._on_expire = on_expire
    self._clock = clock
    self._lock = threading.Lock()
    self._entries: dict[int, list] = {}  # id -> [context, busy since or None, deadline]
    self._ids = 0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    if self._thread is None:
      self._stop.clear()
      self._thread = threading.Thread(target=self._loop, name="syncer-watchdog", daemon=True)
      self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None

  def watched(self, context, messages: Iterable, *, total_s: float | None = None) -> Iterator:
    """Yields `messages`, watching each send (and the whole call if `total_s` is given)."""
    deadline = self._clock() + total_s if total_s is not None else float("inf")
    with self._lock:
      self._ids += 1
      key = self._ids
      entry = self._entries[key] = [context, None, deadline]
    try:
      for item in messages:
        entry[1] = self._clock()
        yield item  # Resumed once gRPC has sent it.
        entry[1] = None
    finally:
      with self._lock:
        self._entries.pop(key, None)

  def _loop(self) -> None:
    period = min(0.25, self._idle_s / 4)
    while not self._stop.wait(period):
      now = self._clock()
      expired = []
      with self._lock:
        for key, (context, busy, deadline) in list(self._entries.items()):
          if now > deadline or (busy is not None and now - busy > self._idle_s):
            expired.append((context, "total" if now > deadline else "idle"))
            del self._entries[key]
      for context, reason in expired:
        self._on_expire(reason)
        context.cancel()


def split_address(address: str) -> tuple[str, int | None]:
  """(host, port) of "host:port" or "[v6]:port"; port None if absent or not a number."""
  if address.startswith("["):
    host, _, rest = address[1:].partition("]")
    port = rest[1:] if rest.startswith(":") else ""
  else:
    host, sep, port = address.rpartition(":")
    if not sep:
      host, port = address, ""
  return host, int(port) if port.isdigit() else None


def is_loopback(address: str) -> bool:
  """Whether a server address only listens on this host (loopback, or a unix socket)."""
  if address.startswith(("unix:", "unix-abstract:")):
    return True
  host, _ = split_address(address)
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False  # A name or an empty host (every interface).


def port_in_use(address: str) -> bool:
  """Whether another socket listens on `address`'s (non-zero) port: a plain bind test.

  Binds with SO_REUSEADDR as gRPC does (connections of a previous run in TIME_WAIT do not count)
  but without SO_REUSEPORT, so a listener that allows port sharing is found too.
  """
  host, port = split_address(address)
  if not port or address.startswith(("unix:", "unix-abstract:")):
    return False
  try:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
  except socket.gaierror:
    return False  # gRPC reports the unresolvable address itself.
  family, kind, proto, _, sockaddr = infos[0]
  with socket.socket(family, kind, proto) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(sockaddr)
    except OSError as e:
      return e.errno == errno.EADDRINUSE
  return False
