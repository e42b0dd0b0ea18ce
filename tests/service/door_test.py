"""The door's pieces on their own: paced reads, the send watchdog, request parsing."""

import socket
import threading

import pytest

from ddiloco.service import door
from ddiloco.transport.proto import syncer_pb2

pytestmark = pytest.mark.timeout(30)


def test_paced_stream_interrupt_raises_evicted():
  release = threading.Event()

  def source():
    release.wait(10)
    yield 1

  stream = door.PacedStream(source(), idle_s=10.0, total_s=10.0)
  threading.Timer(0.1, stream.interrupt).start()
  with pytest.raises(door.StreamTimeout, match="evicted"):
    next(stream)
  stream.close()
  release.set()


def test_paced_stream_hands_over_items_and_the_end():
  stream = door.PacedStream(iter([1, 2, 3]), idle_s=5.0, total_s=5.0)
  assert list(stream) == [1, 2, 3]
  with pytest.raises(StopIteration):
    next(stream)
  stream.close()


def test_paced_stream_times_out_an_idle_source_and_releases_its_reader():
  release = threading.Event()

  def source():
    yield "first"
    release.wait(10)  # A client that sends one chunk and then nothing.
    yield "late"

  before = set(threading.enumerate())
  stream = door.PacedStream(source(), idle_s=0.2, total_s=30.0)
  (reader,) = set(threading.enumerate()) - before
  assert next(stream) == "first"
  with pytest.raises(door.StreamTimeout, match="idle"):
    next(stream)
  stream.close()
  release.set()
  reader.join(5)
  assert not reader.is_alive()  # Closed: it drops the late item and ends.


def test_paced_stream_total_deadline_is_checked_before_waiting():
  ticks = iter([0.0, 100.0, 100.0])  # Constructed at 0; the next read finds the deadline passed.
  stream = door.PacedStream(iter([1, 2]), idle_s=5.0, total_s=10.0, clock=lambda: next(ticks))
  with pytest.raises(door.StreamTimeout, match="total"):
    next(stream)
  stream.close()


def test_paced_stream_passes_the_sources_error_on():
  def source():
    yield 1
    raise RuntimeError("call ended")

  stream = door.PacedStream(source(), idle_s=5.0, total_s=5.0)
  assert next(stream) == 1
  with pytest.raises(RuntimeError, match="call ended"):
    next(stream)
  stream.close()


def test_paced_stream_without_deadlines_reads_in_the_callers_thread():
  """A carrier that times its own reads (the bulk port): no helper thread; the items, the end
  and the source's errors as they come."""
  readers = []

  def source():
    readers.append(threading.current_thread())
    yield 1
    yield 2
    raise RuntimeError("call ended")

  before = set(threading.enumerate())
  stream = door.PacedStream(source(), idle_s=None, total_s=None)
  assert set(threading.enumerate()) == before
  assert [next(stream), next(stream)] == [1, 2]
  with pytest.raises(RuntimeError, match="call ended"):
    next(stream)
  assert readers == [threading.current_thread()]
  stream.close()
  assert list(door.PacedStream(iter([3]), idle_s=None, total_s=None)) == [3]


def test_paced_stream_without_deadlines_interrupt_cuts_the_read_under_way():
  """`interrupt` (another thread's) calls the carrier's `on_interrupt`, which cuts the blocked
  read; whatever the read then raises, or the end it sees, is the eviction."""
  for cut_by in (RuntimeError("read cut"), None):
    cut = threading.Event()

    def source(cut=cut, cut_by=cut_by):
      yield "first"
      cut.wait(10)  # A read blocked on a stalled client until the carrier cuts it.
      if cut_by is not None:
        raise cut_by

    stream = door.PacedStream(source(), idle_s=None, total_s=None, on_interrupt=cut.set)
    assert next(stream) == "first"
    threading.Timer(0.1, stream.interrupt).start()
    with pytest.raises(door.StreamTimeout, match="evicted"):
      next(stream)
    assert cut.is_set()
    with pytest.raises(door.StreamTimeout, match="evicted"):  # And every later read.
      next(stream)


class _FakeContext:
  def __init__(self):
    self.cancelled = threading.Event()

  def cancel(self):
    self.cancelled.set()


def test_watchdog_cuts_a_stuck_send_but_not_a_quiet_stream():
  cut: list[str] = []
  watchdog = door.Watchdog(0.2, cut.append)
  watchdog.start()
  try:
    stuck, quiet = _FakeContext(), _FakeContext()
    sending = watchdog.watched(stuck, iter(["chunk", "never sent"]))
    assert next(sending) == "chunk"  # gRPC never asks for the next: the send is stuck.
    gate = threading.Event()

    def waiting():
      gate.wait(10)  # A Rounds stream with nothing to send: not stuck.
      yield "event"

    idle = watchdog.watched(quiet, waiting())
    reader = threading.Thread(target=lambda: next(idle))
    reader.start()
    assert stuck.cancelled.wait(5)
    assert cut == ["idle"] and not quiet.cancelled.is_set()
    gate.set()
    reader.join(5)
    sending.close()
    idle.close()
  finally:
    watchdog.stop()


def test_parse_request_never_raises_and_bounds_text():
  parse = door.parse_request(syncer_pb2.RegisterRequest)
  good = syncer_pb2.RegisterRequest(learner_id=3, host="h" * 255, layout_digest="d" * 64)
  assert parse(good.SerializeToString()) == good
  assert isinstance(parse(b"\x12\x02\xff\xfe"), door.Garbled)  # Bad UTF-8 in a string field.
  assert isinstance(parse(b"\x0a\xff"), door.Garbled)  # A length past the end.
  long_host = parse(syncer_pb2.RegisterRequest(host="h" * 256).SerializeToString())
  assert long_host == door.Garbled(
    "RegisterRequest: Field host has 256 characters; at most 255 are accepted."
  )
  # Nested messages are walked too: a push header's codec.
  chunk = syncer_pb2.PushChunk(header=syncer_pb2.PushHeader(codec="x" * 17))
  assert door.text_fault(chunk) == "Field codec has 17 characters; at most 16 are accepted."


def test_clip_bounds_client_text_in_logs():
  assert door.clip("host") == "'host'"
  clipped = door.clip("x" * 10_000 + "\n")
  assert len(clipped) == door.LOG_CHARS + 5 and "\n" not in clipped


@pytest.mark.parametrize(
  ("address", "loopback"),
  [
    ("127.0.0.1:0", True),
    ("127.3.2.1:50051", True),
    ("localhost:50051", True),
    ("[::1]:50051", True),
    ("unix:/tmp/syncer.sock", True),
    ("0.0.0.0:50051", False),
    ("[::]:50051", False),
    (":50051", False),
    ("10.0.0.5:50051", False),
    ("syncer.example.com:50051", False),
  ],
)
def test_is_loopback(address, loopback):
  assert door.is_loopback(address) == loopback


def test_split_address():
  assert door.split_address("[::1]:80") == ("::1", 80)
  assert door.split_address("host:0") == ("host", 0)
  assert door.split_address("host") == ("host", None)


@pytest.mark.integration
def test_port_in_use_sees_a_listener_even_one_that_shares_its_port():
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    assert door.port_in_use(f"127.0.0.1:{port}")
  assert not door.port_in_use(f"127.0.0.1:{port}")
  assert not door.port_in_use("127.0.0.1:0")
