"""The bulk port's phase deadlines (`bulk_pace.PacedSocket`) against a scripted peer on a fake
clock: a trickle cannot restart them, an honest slow link passes, only waiting on the peer counts.

Limits in every test: hello 2 s, header grace 2 s, chunk grace 3 s, 100 B/s, whole call 60 s. A
chunk of n bytes may then keep its reader waiting 3 + n / 100 s; a trickler sending a byte every
2.9 s (which a 3 s idle timer, restarted on every byte, would keep forever) earns 0.01 s a byte.
"""

import pytest

from ddiloco.transport import bulk_pace, bulk_wire

LIMITS = bulk_pace.PhaseLimits(hello_s=2.0, header_s=2.0, grace_s=3.0, min_rate=100, transfer_s=60)


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


class _Peer:
  """A socket whose peer sends `script`: (seconds after the read starts, bytes) in order; a read
  whose next bytes come after its timeout advances the clock by the timeout and times out."""

  def __init__(self, clock: _Clock, script: list[tuple[float, bytes]]):
    self._clock, self._script = clock, list(script)
    self.timeout = None
    self.sent = 0
    self.window = 1 << 30  # Bytes a send may hand over before it blocks.

  def settimeout(self, timeout: float) -> None:
    self.timeout = timeout

  def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
    if not self._script:
      return 0
    delay, data = self._script[0]
    if delay > self.timeout:
      self._clock.now += self.timeout
      self._script[0] = (delay - self.timeout, data)
      raise TimeoutError("timed out")
    self._clock.now += delay
    n = min(len(data), nbytes or len(buffer))
    buffer[:n] = data[:n]
    self._script[0] = (0.0, data[n:])
    if not data[n:]:
      self._script.pop(0)
    return n

  def sendmsg(self, buffers) -> int:
    n = min(sum(len(b) for b in buffers), self.window)
    if n == 0:
      self._clock.now += self.timeout
      raise TimeoutError("timed out")
    self.window -= n
    self.sent += n
    return n

  def fileno(self) -> int:
    return -1  # No kernel queue to ask: every byte sent counts as acknowledged.


def _paced(script, clock=None) -> tuple[bulk_pace.PacedSocket, _Clock]:
  clock = clock or _Clock()
  return bulk_pace.PacedSocket(_Peer(clock, script), LIMITS, started=clock(), clock=clock), clock


def test_a_hello_trickled_a_byte_at_a_time_is_cut_at_the_hello_deadline():
  sock, clock = _paced([(0.5, b"x")] * 20)  # A byte every 0.5 s: an idle timer never fires.
  with pytest.raises(bulk_pace.PhaseTimeout) as e:
    bulk_wire.recv_exact(sock, 20)
  assert e.value.phase == "hello" and "within 2 s" in str(e.value)
  assert clock.now == pytest.approx(102.0)


def test_a_chunk_trickled_a_byte_at_a_time_is_cut_about_its_grace_into_it():
  sock, clock = _paced([(0.0, b"hello"), *[(2.9, b"x")] * 100])
  bulk_wire.recv_exact(sock, 5)
  sock.begin_transfer()
  sock.begin_chunk()
  start = clock.now
  with pytest.raises(bulk_pace.PhaseTimeout) as e:
    bulk_wire.recv_exact(sock, 1000)
  # Budget after k bytes: 3 + k/100 s; waited 2.9 k s: cut before the second byte's 2.9 s end.
  assert e.value.phase == "chunk" and "slower than 100 B/s after its 3 s grace" in str(e.value)
  assert clock.now - start == pytest.approx(3.01)


def test_a_slow_honest_link_passes_and_each_chunk_starts_a_budget_of_its_own():
  # 200 B/s (twice the minimum) for three chunks of 1000 bytes: 5 s each, past a 3 s idle grace.
  script = [(0.0, b"hi"), *[(0.5, b"y" * 100)] * 30]
  sock, clock = _paced(script)
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  for _ in range(3):
    sock.begin_chunk()
    assert bytes(bulk_wire.recv_exact(sock, 1000)) == b"y" * 1000
  assert clock.now == pytest.approx(115.0)


def test_the_header_has_its_own_grace():
  sock, _ = _paced([(0.0, b"hi"), (2.5, b"h")])
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  sock.begin_chunk("header")
  with pytest.raises(bulk_pace.PhaseTimeout) as e:
    bulk_wire.recv_exact(sock, 1)
  assert e.value.phase == "header" and "first chunk" in str(e.value)


def test_small_chunks_each_within_their_grace_are_cut_by_the_whole_calls_rate():
  # A chunk of 10 bytes every 2.9 s: each within its own 3 s grace, but the call keeps 3.4 B/s.
  sock, clock = _paced([(0.0, b"hi"), *[(2.9, b"z" * 10)] * 10])
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  start = clock.now
  with pytest.raises(bulk_pace.PhaseTimeout) as e:
    for _ in range(10):
      sock.begin_chunk()
      bulk_wire.recv_exact(sock, 10)
  assert e.value.phase == "transfer"
  assert clock.now - start < 2 * 2.9 + 0.2  # Two chunks in (budget 3 + 20/100 s): cut.


def test_time_the_syncer_spends_elsewhere_is_not_the_peers():
  sock, clock = _paced([(0.0, b"hi"), (1.0, b"a"), (1.0, b"b")])
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  sock.begin_chunk()
  bulk_wire.recv_exact(sock, 1)
  clock.now += 50.0  # The handler busy (the service's lock): no read, no waiting on the peer.
  assert bytes(bulk_wire.recv_exact(sock, 1)) == b"b"


def test_the_whole_call_has_a_wall_deadline():
  sock, clock = _paced([(0.0, b"hi"), *[(0.01, b"w" * 100)] * 10])
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  clock.now += 61.0
  with pytest.raises(bulk_pace.PhaseTimeout) as e:
    bulk_wire.recv_exact(sock, 1)
  assert e.value.phase == "transfer" and "open for more than 60 s" in str(e.value)


def test_a_send_to_a_peer_that_stopped_reading_is_cut_at_its_grace():
  sock, clock = _paced([(0.0, b"hi")])
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  sock.raw.window = 0  # The peer reads nothing.
  sock.begin_chunk()
  start = clock.now
  with pytest.raises(bulk_pace.PhaseTimeout) as e:
    bulk_wire.send_parts(sock, [b"p" * 1000])
  assert e.value.phase == "chunk" and clock.now - start == pytest.approx(3.0)


def test_an_interrupt_cuts_a_blocked_read_and_every_later_one():
  """`interrupt` (from another thread) ends a read waiting on a silent peer within one check
  (`INTERRUPT_CHECK_S`), whatever its budget, and the waiting counts as the peer's."""
  sock, clock = _paced([(0.0, b"hi"), (30.0, b"late")])
  bulk_wire.recv_exact(sock, 2)
  sock.begin_transfer()
  sock.begin_chunk()
  timeouts = []
  settimeout = sock.raw.settimeout

  def interrupt_after_two(timeout):  # Another thread's interrupt, after two waits.
    timeouts.append(timeout)
    if len(timeouts) == 3:
      sock.interrupt()
    settimeout(timeout)

  sock.raw.settimeout = interrupt_after_two
  start = clock.now
  with pytest.raises(bulk_pace.Interrupted):
    bulk_wire.recv_exact(sock, 4)
  assert timeouts == [bulk_pace.INTERRUPT_CHECK_S] * 3
  assert clock.now - start == pytest.approx(3 * bulk_pace.INTERRUPT_CHECK_S)
  with pytest.raises(bulk_pace.Interrupted):
    bulk_wire.send_parts(sock, [b"trailer"])
