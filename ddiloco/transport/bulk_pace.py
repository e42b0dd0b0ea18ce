"""The bulk port's phase deadlines: a server's reads and sends timed so that a trickle cannot
restart them (service/bulk_server.py; framing in transport/bulk_wire.py).

An idle timer restarted on every byte lets a peer that sends a byte just before each deadline
hold a connection forever. Here each phase of a call (the hello, a push's header, each chunk
message, the whole call) has a budget that bytes earn slowly: after its grace, a phase may have
waited on the peer at most `grace + bytes moved / min_rate` seconds (`PhaseLimits`), and each
socket operation's timeout is what is left of the tightest budget, computed anew before it.
"""

import contextlib
import dataclasses
import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class PhaseLimits:
  """The deadlines of a bulk call's phases (`PacedSocket`).

  A phase that moves bytes earns time by them: after its grace, it may have waited on the peer
  for at most `grace + bytes moved / min_rate` seconds, so a peer that trickles a byte now and
  then (which an idle timer restarted on every byte would let hold the connection forever) is cut
  about `grace` seconds into the phase, and a slow but honest link (any rate above `min_rate`)
  never is.

  Attributes:
    hello_s: from the accept to the whole hello, a TLS handshake included (wall clock).
    header_s: the grace of a push's first chunk message (its header): from the hello.
    grace_s: the grace of every later chunk message, read or sent, and of the whole call.
    min_rate: bytes per second a chunk message, and the whole call, must keep after its grace.
    transfer_s: from the hello to the last byte of the answer (wall clock).
  """

  hello_s: float
  header_s: float
  grace_s: float
  min_rate: float
  transfer_s: float

  def chunk_deadline_s(self, nbytes: int) -> float:
    """The longest a chunk message of `nbytes` may keep its reader or sender waiting."""
    return self.grace_s + nbytes / self.min_rate


# Longest one wait on the peer lasts before the socket looks at `PacedSocket.interrupt` (and at
# its budget) again: a blocked read or send is cut this soon after an interrupt.
INTERRUPT_CHECK_S = 0.1


class Interrupted(ConnectionError):
  """A read or send was cut by `PacedSocket.interrupt` (another thread's: the stream lost its
  place)."""


class PhaseTimeout(TimeoutError):
  """A phase of a bulk call passed its deadline (`PacedSocket`): `phase` names it ("hello",
  "header", "chunk" or "transfer")."""

  def __init__(self, phase: str, message: str):
    super().__init__(message)
    self.phase = phase


class _Pace:
  """One phase's budget: `grace_s` plus the bytes moved since `moved0` over the minimum rate, of
  waiting since `waited0`."""

  __slots__ = ("grace_s", "moved0", "name", "waited0")

  def __init__(self, name: str, grace_s: float, moved0: int, waited0: float):
    self.name, self.grace_s, self.moved0, self.waited0 = name, grace_s, moved0, waited0


class PacedSocket:
  """A server's end of a bulk connection whose every read and send is timed by its phase.

  Each operation's timeout is what is left of the tightest of: the wall deadline (the hello's,
  then the whole call's) and the budgets of the current chunk message and of the whole call
  (`PhaseLimits`); it is computed anew before each operation, so bytes that trickle in cannot
  restart it. Only time spent waiting on the peer counts against a budget (the syncer's own
  pauses, its handler busy, are not the peer's), and a send counts the bytes the peer has
  acknowledged (the kernel's unacknowledged queue, `TIOCOUTQ`, is left out): a pull's client that
  stops reading is cut `grace_s` after its socket buffer filled, not after the buffer's worth of
  budget. A phase past its deadline raises `PhaseTimeout`.

  It stands in for the socket in `bulk_wire`'s `fill`, `recv_exact`, `FrameReader` and
  `send_parts`; anything else is the socket's.

  Args:
    sock: the connection (TLS already wrapped, its handshake done).
    limits: the phase deadlines.
    started: when the connection was accepted (the hello's deadline counts from it).
    clock: monotonic clock.
  """

  def __init__(
    self,
    sock: socket.socket,
    limits: PhaseLimits,
    *,
    started: float,
    clock: Callable[[], float] = time.monotonic,
  ):
    self.raw = sock
    self._limits = limits
    self._clock = clock
    self._wall_phase, self._wall = "hello", started + limits.hello_s
    self._tls = hasattr(sock, "cipher")  # Its kernel queue holds records, not our bytes.
    self._waited = 0.0
    self._received = 0
    self._sent = 0
    self._chunk: _Pace | None = None
    self._transfer: _Pace | None = None
    self._interrupted = threading.Event()

  def __getattr__(self, name):
    return getattr(self.raw, name)

  def begin_transfer(self) -> None:
    """The hello is in: the call's own deadlines start."""
    self._wall_phase, self._wall = "transfer", self._clock() + self._limits.transfer_s
    self._transfer = _Pace("transfer", self._limits.grace_s, self._moved(), self._waited)

  def begin_chunk(self, phase: str = "chunk") -> None:
    """A chunk message starts ("header": a push's first, with `header_s` of grace)."""
    grace = self._limits.header_s if phase == "header" else self._limits.grace_s
    self._chunk = _Pace(phase, grace, self._moved(), self._waited)

  # -- the socket's operations, timed -------------------------------------------------------------

  def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
    n = self._timed(self.raw.recv_into, buffer, nbytes, flags)
    self._received += n
    return n

  def sendmsg(self, buffers) -> int:
    n = self._timed(self.raw.sendmsg, buffers)
    self._sent += n
    return n

  def send(self, data, flags: int = 0) -> int:
    n = self._timed(self.raw.send, data, flags)
    self._sent += n
    return n

  def sendall(self, data) -> None:
    view = memoryview(data).cast("B")
    while view:
      view = view[self.send(view) :]

  def interrupt(self) -> None:
    """Cuts the read or send under way, and every later one, with `Interrupted` (from any
    thread), within `INTERRUPT_CHECK_S`; the socket stays open (a trailer can still be sent on
    `raw`, and what the peer still sends drained)."""
    self._interrupted.set()

  def _timed(self, operation, *args) -> int:
    # One wait lasts at most INTERRUPT_CHECK_S: then the interrupt and the budget are looked at
    # again. A timed-out operation has moved nothing (the socket module waits for readiness
    # first), so it is simply tried again. A wait given the whole budget left that times out
    # spent it: cut then, not by the clock's arithmetic (a sum that may never reach zero).
    while True:
      if self._interrupted.is_set():
        raise Interrupted("The call was interrupted (its stream lost its place).")
      left = self._left()
      self.raw.settimeout(min(left, INTERRUPT_CHECK_S))
      start = self._clock()
      try:
        return operation(*args)
      except TimeoutError:
        if left <= INTERRUPT_CHECK_S and not self._interrupted.is_set():
          self._waited += self._clock() - start
          start = self._clock()  # Counted once.
          raise self._expired(self._tightest()[1]) from None
      finally:
        self._waited += self._clock() - start

  # -- the budgets --------------------------------------------------------------------------------

  def _moved(self) -> int:
    """Bytes received, plus bytes sent that the peer has acknowledged."""
    if not self._sent:
      return self._received
    unacknowledged = 0
    if not self._tls:
      # Not a TCP socket (a test's): every byte sent counts.
      with contextlib.suppress(OSError):
        (unacknowledged,) = struct.unpack(
          "i", fcntl.ioctl(self.raw.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        )
    return self._received + self._sent - max(0, unacknowledged)

  def _tightest(self) -> tuple[float, str]:
    """(seconds left, the phase whose deadline is nearest)."""
    left, phase = self._wall - self._clock(), self._wall_phase
    moved = None
    for pace in (self._chunk, self._transfer):
      if pace is None:
        continue
      if moved is None:
        moved = self._moved()
      budget = pace.grace_s + (moved - pace.moved0) / self._limits.min_rate
      pace_left = budget - (self._waited - pace.waited0)
      if pace_left < left:
        left, phase = pace_left, pace.name
    return left, phase

  def _left(self) -> float:
    left, phase = self._tightest()
    if left <= 0:
      raise self._expired(phase)
    return left

  def _expired(self, phase: str) -> PhaseTimeout:
    lim = self._limits
    if phase == "hello":
      return PhaseTimeout(phase, f"No whole bulk hello within {lim.hello_s:g} s of the connection.")
    if phase == "transfer" and self._clock() >= self._wall:
      return PhaseTimeout(phase, f"The call was open for more than {lim.transfer_s:g} s.")
    pace = self._chunk if phase != "transfer" else self._transfer
    what = {"header": "The push's first chunk", "chunk": "A chunk message"}.get(phase, "The call")
    moved = self._moved() - pace.moved0
    return PhaseTimeout(
      phase,
      f"{what} moved slower than {lim.min_rate:g} B/s after its {pace.grace_s:g} s grace: "
      f"{moved} bytes in {self._waited - pace.waited0:.1f} s waiting on the peer.",
    )
