"""`BulkRoute`: the bulk port after a failure is tried again after a doubling backoff."""

import pytest

from ddiloco.transport.bulk_route import BulkRoute


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


def _route(clock, **kwargs) -> BulkRoute:
  return BulkRoute("127.0.0.1", token="t", tls=None, clock=clock, **kwargs)


def test_no_port_advertised_means_grpc():
  route = _route(_Clock())
  assert route.current() is None and route.port is None
  route.advertise(0, 1 << 20)
  assert route.current() is None and route.port is None


def test_a_failure_backs_off_doubling_up_to_the_cap_and_a_register_starts_anew():
  clock = _Clock()
  route = _route(clock, retry_s=10.0, max_retry_s=25.0)
  route.advertise(4000, 1 << 20)
  client = route.current()
  assert client is not None and client.port == route.port == 4000
  assert client.chunk_bytes == 1 << 20
  for delay in (10.0, 20.0, 25.0, 25.0):  # Doubled after each failure, up to the cap.
    route.down(ConnectionError("reset"))
    route.down(ConnectionError("a second call of the same outage"))  # Counted once.
    assert route.port is None
    clock.now += delay - 0.01
    assert route.current() is None
    clock.now += 0.01
    assert route.current() is client and route.port == 4000  # Tried again, the same client.
  route.advertise(4001, 1 << 20)  # A Register: the new port at once, the backoff reset.
  assert route.current().port == 4001
  route.down(ConnectionError("reset"))
  clock.now += 10.0
  assert route.current().port == 4001


@pytest.mark.parametrize(("retry_s", "max_retry_s"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_bad_backoffs_are_refused(retry_s, max_retry_s):
  with pytest.raises(ValueError, match="retry_s"):
    _route(_Clock(), retry_s=retry_s, max_retry_s=max_retry_s)
