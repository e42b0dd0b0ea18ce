"""The syncer's door against hostile or overflowing clients: bounds, deadlines and admission.

Every call holds one thread for its whole life: a control call one of the synchronous gRPC
server's (service/service.py), a push or pull one of the bulk port's
(service/bulk_server.py), and a push handler blocks on the client's next chunk. Pieces here
keep any client, token holder or not, from starving the server or growing its memory:

- Data streams (pushes, pulls, Recovers) are admitted by service/stream_gate.py's `StreamGate`:
  bounded in all, per learner and before they name their learner, fairly between learners.
- `PacedStream` reads a Recover's gRPC request iterator in a helper thread, so the handler can
  wait for each chunk with a timeout: a stream silent for the idle deadline, or open past its
  total deadline, is ended with DEADLINE_EXCEEDED by the handler itself. (gRPC's synchronous
  request iterator has no timeout, and a call cancelled from another thread reaches the client
  as CANCELLED, not as a precise status.) The bulk port's frames are read in the handler's own
  thread: its socket times every read by phase (transport/bulk_pace.py).
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


class StreamTimeout(Exception):
  """A request stream passed its idle or total deadline (`PacedStream`)."""


class PacedStream:
  """Iterates a push's request stream with an idle deadline per item and a total deadline, and
  lets another thread cut it (`interrupt`: the stream lost its place in the gate).

  With deadlines (gRPC's request iterator, which cannot time a read), a daemon thread moves items
  from `source` into a small queue (two items: gRPC's own flow control keeps bounding what the
  client may send ahead); iterating waits on the queue with a timeout and raises `StreamTimeout`
  when the next item is late. The reader thread ends when gRPC ends the call (its iterator then
  raises or stops), which the handler's return brings.

  Without (a carrier that times every read of its own, as the bulk port does:
  `bulk_pace.PacedSocket`), the handler reads `source` in its own thread, and `interrupt` calls
  `on_interrupt` to cut a read under way (the bulk port's `BulkCall.interrupt`). A helper thread
  there cost a bf16 shard ~10 % of its CPU per GB (its start, and the interpreter handed back and
  forth on every frame: `scripts/bench_ingest.py --fragment_mib=16`, the two interleaved, 1.11
  against 1.24 CPU-s/GB, the merge included).

  Call `close` when done.

  Args:
    source: the request iterator.
    idle_s: longest wait for one item; None: no bound (a carrier that times its own reads).
    total_s: longest time from construction to the last item; None: no bound (as `idle_s`).
    on_interrupt: called by `interrupt` (from its thread) to cut a read under way.
    clock: monotonic clock.
  """

  def __init__(
    self,
    source: Iterator,
    *,
    idle_s: float | None,
    total_s: float | None,
    on_interrupt: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
  ):
    self._idle_s = float("inf") if idle_s is None else idle_s
    self._clock = clock
    self._deadline = clock() + (float("inf") if total_s is None else total_s)
    self._interrupted = threading.Event()
    self._on_interrupt = on_interrupt
    self._source: Iterator | None = None
    self._ahead: ReadAhead | None = None
    if idle_s is None and total_s is None:
      self._source = iter(source)
    else:
      self._ahead = ReadAhead(source, depth=2, name="syncer-push-reader")

  def __iter__(self):
    return self

  def __next__(self):
    if self._interrupted.is_set():
      raise StreamTimeout("evicted")
    try:
      item = self._take()
    except StreamTimeout:
      raise
    except Exception:  # The end, or the source's error: after `interrupt`, a read it cut.
      if self._interrupted.is_set():
        raise StreamTimeout("evicted") from None
      raise
    if self._interrupted.is_set():
      raise StreamTimeout("evicted")
    return item

  def _take(self):
    """The next item: read here (no deadlines of its own), or from the reader within them."""
    if self._source is not None:
      return next(self._source)
    left = self._deadline - self._clock()
    if left <= 0:
      raise StreamTimeout("total")
    try:
      wait = min(self._idle_s, left)
      return self._ahead.get(timeout=None if wait == float("inf") else wait)
    except queue.Empty:
      raise StreamTimeout("idle" if self._clock() < self._deadline else "total") from None

  def close(self) -> None:
    """Stops the reader handing over items (it exits once gRPC ends the call)."""
    if self._ahead is not None:
      self._ahead.stop()

  def interrupt(self) -> None:
    """Makes the next read raise `StreamTimeout("evicted")` (from any thread)."""
    self._interrupted.set()
    if self._ahead is not None:
      self._ahead.wake()  # Wakes a waiting reader; the flag says why (checked before each item).
    if self._on_interrupt is not None:
      self._on_interrupt()  # Cuts a read under way in the handler's thread.


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
