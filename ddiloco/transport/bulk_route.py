"""`BulkRoute`: whether a client's pushes and pulls go over the syncer's bulk port, and when to try
it again after it failed.

The syncer advertises its bulk port at Register (distributed/bulk_server.py). A call whose
connection cannot be made or breaks goes over gRPC instead (a push is idempotent at the syncer, a
pull only reads), and so do the calls after it for a while: the port is tried again after a
backoff (`retry_s`, doubled after every failure up to `max_retry_s`), so one network hiccup does
not keep a learner on gRPC's slower path for the rest of its run. A Register starts anew.
"""

import logging
import ssl
import threading
import time
from collections.abc import Callable

from ddiloco.transport import bulk_client
from ddiloco.transport.chunks import FRAMING_SLACK

log = logging.getLogger(__name__)


class BulkRoute:
  """The bulk port a client uses now, if any (see module docstring).

  Args:
    host: the syncer's host (the port is advertised at Register).
    token: the run's shared token.
    tls: the TLS context of the bulk connections, or None (plain TCP).
    retry_s: how long after a failure the port is tried again (then twice that, and so on).
    max_retry_s: the longest wait between tries.
    clock: monotonic seconds.
  """

  def __init__(
    self,
    host: str,
    *,
    token: str | None,
    tls: ssl.SSLContext | None,
    retry_s: float = 10.0,
    max_retry_s: float = 300.0,
    clock: Callable[[], float] = time.monotonic,
  ):
    if not 0 < retry_s <= max_retry_s:
      raise ValueError(f"Need 0 < retry_s <= max_retry_s, got {retry_s} and {max_retry_s}.")
    self._host, self._token, self._tls = host, token, tls
    self._retry_s, self._max_retry_s, self._clock = retry_s, max_retry_s, clock
    self._lock = threading.Lock()
    self._client: bulk_client.BulkClient | None = None  # The advertised port's; None: no port.
    self._up = False
    self._retry_at = 0.0
    self._delay = retry_s

  def advertise(self, port: int, chunk_bytes: int) -> None:
    """What a Register said: the bulk port (0: none) and its chunk bound. Starts anew."""
    with self._lock:
      self._client = self._make(port, chunk_bytes) if port else None
      self._up, self._delay = self._client is not None, self._retry_s

  def current(self) -> bulk_client.BulkClient | None:
    """The bulk port's client to call now; None: call over gRPC. After a failure, the client
    again once the backoff has passed (the call then tries the port again)."""
    with self._lock:
      if self._client is not None and not self._up and self._clock() >= self._retry_at:
        self._up = True
      return self._client if self._up else None

  @property
  def port(self) -> int | None:
    """The bulk port calls go over now (without trying a failed one again); None: gRPC."""
    with self._lock:
      return self._client.port if self._up and self._client is not None else None

  def down(self, error: Exception) -> None:
    """A call over the bulk port failed to connect or broke: gRPC until the backoff passes."""
    with self._lock:
      if not self._up:
        return
      self._up = False
      delay = self._delay
      self._retry_at = self._clock() + delay
      self._delay = min(2 * delay, self._max_retry_s)
    log.warning(
      "bulk port unavailable (%s): pushing and pulling over gRPC, trying it again in %.0f s",
      error,
      delay,
    )

  def _make(self, port: int, chunk_bytes: int) -> bulk_client.BulkClient:
    return bulk_client.BulkClient(
      self._host,
      port,
      token=self._token,
      tls=self._tls,
      max_frame_bytes=chunk_bytes + FRAMING_SLACK,
      chunk_bytes=chunk_bytes,
    )
