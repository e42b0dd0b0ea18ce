"""Tests of the read-ahead helper thread (transport/read_ahead.py)."""

import queue
import threading

import pytest

from ddiloco.transport.read_ahead import ReadAhead

pytestmark = pytest.mark.timeout(30)


def _drain(ahead: ReadAhead) -> list:
  out = []
  while True:
    try:
      out.append(ahead.get(timeout=5))
    except StopIteration:
      return out


def test_items_in_order_then_the_end_on_every_later_get():
  ahead = ReadAhead(iter(range(10)), depth=2, name="t")
  assert _drain(ahead) == list(range(10))
  for _ in range(3):  # The end stays the end.
    with pytest.raises(StopIteration):
      ahead.get(timeout=1)
  ahead.join(5)


def test_what_the_source_raises_reaches_the_consumer_where_the_item_would_be():
  def source():
    yield 1
    raise ValueError("broken stream")

  ahead = ReadAhead(source(), depth=2, name="t")
  assert ahead.get(timeout=5) == 1
  with pytest.raises(ValueError, match="broken stream"):
    ahead.get(timeout=5)


def test_a_late_item_is_queue_empty():
  gate = threading.Event()

  def source():
    gate.wait(10)
    yield "late"

  ahead = ReadAhead(source(), depth=2, name="t")
  with pytest.raises(queue.Empty):
    ahead.get(timeout=0.05)
  gate.set()
  assert ahead.get(timeout=5) == "late"


def test_wake_ends_a_waiting_get_and_stop_closes_the_source():
  closed = threading.Event()
  gate = threading.Event()

  def source():
    try:
      yield 0
      gate.wait(10)
      yield 1
    finally:
      closed.set()

  ahead = ReadAhead(source(), depth=1, name="t", close_source=True)
  assert ahead.get(timeout=5) == 0
  ahead.wake()
  with pytest.raises(StopIteration):
    ahead.get(timeout=5)
  ahead.stop()
  gate.set()  # The thread reads item 1, may not hand it over, and closes the generator.
  assert closed.wait(5)
  ahead.join(5)


def test_stop_with_a_full_queue_ends_the_thread():
  ahead = ReadAhead(iter(range(1000)), depth=2, name="read-ahead-stop-test")
  assert ahead.get(timeout=5) == 0
  ahead.stop()
  ahead.join(5)
  assert "read-ahead-stop-test" not in {t.name for t in threading.enumerate()}
