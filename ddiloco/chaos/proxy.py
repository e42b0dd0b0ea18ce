"""`LoopbackProxy`: a TCP proxy between learners and the syncer with runtime-controllable faults.

The chaos driver puts one in front of each of the syncer's ports (gRPC, and the bulk port that
carries pushes and pulls; chaos/proxy_set.py) and points the learners at them (127.0.0.1:<port>)
instead of the syncer, then injects network faults while they train (docs/algorithm.md §6: learners
keep training through an outage and reconnect with backoff):
  set_latency(d)        every forwarded read is delayed by d seconds, both directions, order kept
                        (a chunk's due time is fixed when it is read; a later, smaller latency never
                        overtakes it).
  drop()                every current connection is reset (RST): in-flight calls fail UNAVAILABLE,
                        gRPC channels reconnect through the proxy on their next call, and a push or
                        pull (one connection each) is retried.
  partition(s, mode)    "hold": nothing is forwarded and new connections are not connected upstream
                        until heal(), like a cable pulled out (TCP keeps the bytes; calls run into
                        their deadlines); "reset": current connections are reset and new ones reset
                        on accept until heal(), like a dead route. With a duration it heals itself.
  set_upstream(addr)    new connections go to a new syncer address (a syncer restarted on a new
                        port); current ones are reset by default. A syncer restarted on the same
                        port needs nothing: connections to the dead one end when it dies, and new
                        ones connect (or, while it is down, are reset and counted).

`proxy_process.ProxyProcess` runs the same proxy in a child process of its own session.

Why asyncio in one background thread rather than threads per connection: every socket and every
piece of fault state is owned by the loop (setters hop onto it and wait), so a drop or a partition
acts on all connections at once without races; latency is a due time per chunk rather than a sleeping
thread; stop() cancels everything and joins one thread. Bulk data moves as whole reads (asyncio reads
up to 256 KiB per recv, we take up to `read_bytes` at once), one bytes object per read and no per-byte
Python work, so gRPC's MiB-sized HTTP/2 streams pass at several hundred MB/s on loopback.
"""

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

PARTITION_MODES = ("hold", "reset")
_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on with timeout 0: close() sends RST.


@dataclasses.dataclass(frozen=True)
class ProxyStats:
  """Counters since start.

  Attributes:
    bytes_up: bytes forwarded from clients (learners) to the upstream (syncer).
    bytes_down: bytes forwarded from the upstream to clients.
    connections: client connections accepted.
    active: client connections open now.
    resets: connections reset by a drop, a partition, a retarget or stop().
    upstream_failures: connections whose upstream could not be reached (they were reset too).
  """

  bytes_up: int
  bytes_down: int
  connections: int
  active: int
  resets: int
  upstream_failures: int


def parse_address(address: str | int) -> tuple[str, int]:
  """'host:port' or a port on 127.0.0.1 as (host, port).

  Raises:
    ValueError: for a malformed address or a port outside 1..65535.
  """
  if isinstance(address, int):
    host, port = "127.0.0.1", address
  else:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
      raise ValueError(f"Expected 'host:port', got {address!r}.")
    port = int(port_text)
  if not 0 < port < 65536:
    raise ValueError(f"Port must be in 1..65535, got {port}.")
  return host, port


def _reset(writer: asyncio.StreamWriter | None) -> None:
  """Closes a connection abruptly with RST, as a network drop looks to both ends."""
  if writer is None or writer.transport.is_closing():
    return
  sock = writer.get_extra_info("socket")
  if sock is not None:
    with contextlib.suppress(OSError):
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
  writer.transport.abort()


@dataclasses.dataclass(eq=False)
class _Conn:
  client: asyncio.StreamWriter
  task: asyncio.Task
  upstream: asyncio.StreamWriter | None = None

  def reset(self) -> None:
    _reset(self.client)
    _reset(self.upstream)


class FaultProxy:
  """What both proxies share: the context manager, the address and the fault arguments' checks."""

  port: int

  def start(self) -> int:
    raise NotImplementedError

  def stop(self) -> None:
    raise NotImplementedError

  def __enter__(self):
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  @property
  def address(self) -> str:
    """'127.0.0.1:<port>', what the learners dial."""
    return f"127.0.0.1:{self.port}"

  @staticmethod
  def _check_latency(seconds: float) -> None:
    if not seconds >= 0:
      raise ValueError(f"Latency must be >= 0, got {seconds}.")

  @staticmethod
  def _check_partition(duration_s: float | None, mode: str) -> None:
    if mode not in PARTITION_MODES:
      raise ValueError(f"mode must be one of {PARTITION_MODES}, got {mode!r}.")
    if duration_s is not None and not duration_s > 0:
      raise ValueError(f"duration_s must be > 0, got {duration_s}.")


class LoopbackProxy(FaultProxy):
  """A fault-injecting TCP proxy on 127.0.0.1 (see the module docstring).

  Every public method is thread-safe and, but for `stats`, waits until the change is in effect.
  Never call them from the proxy's own event loop.

  Args:
    upstream: the syncer's 'host:port' (or a port on 127.0.0.1).
    listen_port: port to listen on (0: a free one, see `port` after `start`).
    read_bytes: largest read forwarded as one chunk.
    max_queued_chunks: chunks held per direction and connection (under latency or a held partition)
      before reading from the sender stops (TCP back-pressure).
    connect_timeout_s: timeout of a connection to the upstream.
    control_timeout_s: how long a control call waits for the loop.
  """

  def __init__(
    self,
    upstream: str | int,
    *,
    listen_port: int = 0,
    read_bytes: int = 1 << 20,
    max_queued_chunks: int = 64,
    connect_timeout_s: float = 5.0,
    control_timeout_s: float = 10.0,
  ):
    if read_bytes < 1 or max_queued_chunks < 1 or connect_timeout_s <= 0 or control_timeout_s <= 0:
      raise ValueError("read_bytes, max_queued_chunks and the timeouts must be > 0.")
    self._upstream = parse_address(upstream)
    self._listen_port = listen_port
    self._read_bytes = read_bytes
    self._max_queued = max_queued_chunks
    self._connect_timeout_s = connect_timeout_s
    self._control_timeout_s = control_timeout_s
    self._latency_s = 0.0
    self._partition_mode: str | None = None
    self._heal_timer: asyncio.TimerHandle | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._server: asyncio.Server | None = None
    self._open: asyncio.Event | None = None  # Set unless a "hold" partition is on.
    self._conns: set[_Conn] = set()
    self._stats_lock = threading.Lock()
    self._counts = dict.fromkeys(
      ("bytes_up", "bytes_down", "connections", "resets", "upstream_failures"), 0
    )
    self.port = 0

  # -- lifecycle ------------------------------------------------------------------------------

  def start(self) -> int:
    """Starts listening on 127.0.0.1; returns the port.

    Raises:
      RuntimeError: if already started.
      OSError: if the port cannot be bound.
    """
    if self._thread is not None:
      raise RuntimeError("The proxy is already started.")
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy", daemon=True)
    self._thread.start()
    try:
      self.port = self._call(self._listen)
    except BaseException:
      self._shutdown_loop()
      raise
    return self.port

  def stop(self) -> None:
    """Closes the listener and every connection (reset) and joins the loop thread."""
    if self._thread is None:
      return
    try:
      self._call(self._close_all)
    finally:
      self._shutdown_loop()

  def _shutdown_loop(self) -> None:
    assert self._loop is not None and self._thread is not None
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(self._control_timeout_s)
    if self._thread.is_alive():
      raise RuntimeError(f"The proxy thread did not stop within {self._control_timeout_s} s.")
    self._loop.close()
    self._thread = None

  # -- faults ---------------------------------------------------------------------------------

  def set_latency(self, seconds: float) -> None:
    """Adds `seconds` of one-way delay to every read forwarded from now on, both directions."""
    self._check_latency(seconds)

    async def apply():
      self._latency_s = float(seconds)

    self._call(apply)

  def drop(self) -> int:
    """Resets every current connection; returns how many."""
    return self._call(self._reset_all)

  def partition(self, duration_s: float | None = None, *, mode: str = "hold") -> None:
    """Cuts the network (see the module docstring) until heal() or for `duration_s` seconds."""
    self._check_partition(duration_s, mode)

    async def apply():
      self._heal_now()  # A new partition replaces the current one.
      self._partition_mode = mode
      if mode == "hold":
        self._open.clear()
      else:
        await self._reset_all()
      if duration_s is not None:
        self._heal_timer = self._loop.call_later(duration_s, self._heal_now)

    self._call(apply)

  def heal(self) -> None:
    """Ends a partition (no-op if none)."""

    async def apply():
      self._heal_now()

    self._call(apply)

  def set_upstream(self, upstream: str | int, *, reset: bool = True) -> None:
    """Sends new connections to `upstream`; resets the current ones if `reset`."""
    address = parse_address(upstream)

    async def apply():
      self._upstream = address
      if reset:
        await self._reset_all()

    self._call(apply)

  # -- state ----------------------------------------------------------------------------------

  def stats(self) -> ProxyStats:
    """A snapshot of the counters."""
    with self._stats_lock:
      return ProxyStats(active=len(self._conns), **self._counts)

  @property
  def latency_s(self) -> float:
    return self._latency_s

  @property
  def partitioned(self) -> bool:
    return self._partition_mode is not None

  @property
  def upstream(self) -> str:
    return "{}:{}".format(*self._upstream)

  # -- on the loop ----------------------------------------------------------------------------

  def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
    if self._loop is None or self._thread is None:
      raise RuntimeError("The proxy is not started.")
    future = asyncio.run_coroutine_threadsafe(fn(), self._loop)
    return future.result(self._control_timeout_s)

  def _count(self, key: str, n: int = 1) -> None:
    with self._stats_lock:
      self._counts[key] += n

  async def _listen(self) -> int:
    self._open = asyncio.Event()
    self._open.set()
    self._server = await asyncio.start_server(
      self._handle, "127.0.0.1", self._listen_port, limit=2 * self._read_bytes
    )
    return self._server.sockets[0].getsockname()[1]

  def _heal_now(self) -> None:
    if self._heal_timer is not None:
      self._heal_timer.cancel()
      self._heal_timer = None
    self._partition_mode = None
    self._open.set()

  async def _reset_all(self) -> int:
    conns = list(self._conns)
    for conn in conns:
      conn.reset()
      conn.task.cancel()
    self._count("resets", len(conns))
    # Wait for the handlers to finish so that the caller sees the connections gone.
    await asyncio.gather(*(c.task for c in conns), return_exceptions=True)
    return len(conns)

  async def _close_all(self) -> None:
    self._heal_now()
    if self._server is not None:
      self._server.close()
    await self._reset_all()
    if self._server is not None:
      await self._server.wait_closed()
    await asyncio.sleep(0)  # Let the aborted transports run their connection_lost callbacks.

  async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    conn = _Conn(client=writer, task=asyncio.current_task())
    with self._stats_lock:  # `active` in stats() counts the set under the same lock.
      self._conns.add(conn)
      self._counts["connections"] += 1
    try:
      if self._partition_mode == "reset":
        conn.reset()
        self._count("resets")
        return
      await self._open.wait()  # A held partition: the upstream is unreachable until heal.
      host, port = self._upstream
      try:
        up_reader, conn.upstream = await asyncio.wait_for(
          asyncio.open_connection(host, port, limit=2 * self._read_bytes),
          self._connect_timeout_s,
        )
      except (OSError, TimeoutError) as e:
        log.info("proxy: upstream %s:%d unreachable (%s); resetting the client", host, port, e)
        self._count("upstream_failures")
        conn.reset()
        return
      try:
        async with asyncio.TaskGroup() as tg:
          tg.create_task(self._pipe(reader, conn.upstream, "bytes_up"))
          tg.create_task(self._pipe(up_reader, writer, "bytes_down"))
      except* OSError:  # A peer reset (ConnectionError is an OSError): the other end sees one too.
        conn.reset()
    except asyncio.CancelledError:
      # `_reset_all` cancelled this handler (a reset fault, or the proxy stopping) after resetting
      # the connection: that is its intended end. Ending quietly keeps asyncio from logging the
      # cancelled handler as an error with a traceback.
      pass
    finally:
      with self._stats_lock:
        self._conns.discard(conn)
      for w in (conn.client, conn.upstream):
        if w is not None and not w.transport.is_closing():
          w.close()

  async def _pipe(
    self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str
  ) -> None:
    """Forwards one direction: reads are queued with a due time and written in order when due."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(self._max_queued)
    loop = asyncio.get_running_loop()

    async def feed() -> None:
      while True:
        data = await reader.read(self._read_bytes)
        await queue.put((loop.time() + self._latency_s, data))
        if not data:
          return

    async def forward() -> None:
      while True:
        due, data = await queue.get()
        if (wait := due - loop.time()) > 0:
          await asyncio.sleep(wait)
        await self._open.wait()
        if not data:  # EOF: half-close, as TCP would pass the FIN on.
          if writer.can_write_eof() and not writer.transport.is_closing():
            writer.write_eof()
          return
        # Counted before the write: a write may hand the bytes to the peer at once, and a reader
        # of the stats who has seen them arrive must see them counted.
        self._count(key, len(data))
        writer.write(data)
        await writer.drain()

    async with asyncio.TaskGroup() as tg:
      tg.create_task(feed())
      tg.create_task(forward())
