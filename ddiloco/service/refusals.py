"""The service's refusals: the gRPC status of every refused request, counted by status name.

Every request is checked before it can touch the core, and every refusal has a precise status and
is counted by status name (`Status.refused`):
    INVALID_ARGUMENT    malformed chunks or header, unknown fragment, wrong keys/shapes/dtypes, NaN/Inf,
                        counters out of their bounds (`protocol.counter_error`), an implausible
                        outer gradient, a codec other than the negotiated one (or fp32)
    RESOURCE_EXHAUSTED  a payload larger than the fragment can ever need, or a chunk above the limit
    NOT_FOUND           a learner that never registered
    FAILED_PRECONDITION a learner the syncer counts as dead (must register again), a layout digest or
                        fragment count that differs from the syncer's
    ABORTED             a late push: its round is closed
                        (decided from the header, before decoding)
    ALREADY_EXISTS      a duplicate push: this learner already answered the round
    UNAUTHENTICATED     a missing or wrong shared token (transport/auth.py)
    PERMISSION_DENIED   a missing or wrong learner session (service/members.py)
    INVALID_ARGUMENT    also: request bytes that do not decode, a text field over its bound (host
                        255 characters, layout digest 128, codec 16, any other 256; service/door.py)
    RESOURCE_EXHAUSTED  also: a Push or Pull beyond `max_data_streams_per_learner` for one
                        learner, or beyond `max_data_streams` when no learner holds two more than
                        its own; the newest stream of the learner holding the most, cut to admit
                        one of a learner with fewer (service/stream_gate.py); the oldest stream yet
                        to name its learner when `max_unclaimed_streams` are open (cut to admit a
                        new one); a bulk connection beyond `ServiceConfig.bulk_connections`
                        (closed at its accept); a Rounds stream beyond `max_rounds_streams`, a
                        new learner id beyond `max_members`
    DEADLINE_EXCEEDED   a push stream with no chunk for `stream_idle_s`, a push or pull stream open
                        past `stream_deadline_s`; on the bulk port, a phase past its deadline,
                        named in the message: "hello", "header", "chunk" (slower than
                        `bulk_min_rate` after its grace), "transfer" (bulk_pace.PhaseLimits)
    OUT_OF_RANGE        a Push, Pull or Recover of a fragment another syncer shard owns
                        (fragments/shards.py)
    CANCELLED           a Rounds stream (or an in-process pull) whose client stopped reading: a
                        send stuck for `stream_idle_s` is cut by the watchdog (the client sees
                        CANCELLED); a bulk pull's is cut by its phase deadline (counted
                        DEADLINE_EXCEEDED; the client, not reading, sees the connection reset)
"""

import collections
import threading
from collections.abc import Callable

import grpc

from ddiloco.transport import auth


class Refusal(Exception):
  """A request refused at the door: a gRPC status code and a precise message."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


# Report statuses that are refusals on the wire (the push itself was well-formed).
REPORT_STATUS_CODES = {
  "late": grpc.StatusCode.ABORTED,
  "duplicate": grpc.StatusCode.ALREADY_EXISTS,
  "rejected": grpc.StatusCode.INVALID_ARGUMENT,
}


class Refusals:
  """Makes refusals and counts them by status name (`Status.refused`).

  Args:
    lock: the service's lock (reentrant), held while counting.
  """

  def __init__(self, lock: threading.Condition):
    self._lock = lock
    self._counts: collections.Counter[str] = collections.Counter()

  def refuse(self, code: grpc.StatusCode, message: str) -> Refusal:
    """A counted refusal, for the caller to raise."""
    with self._lock:
      self._counts[code.name] += 1
    return Refusal(code, message)

  def count(self, code: grpc.StatusCode) -> None:
    """Counts a refusal made elsewhere (an interceptor's, the watchdog's cut)."""
    with self._lock:
      self._counts[code.name] += 1

  def counts(self) -> dict[str, int]:
    """{status name: refusals} since start."""
    with self._lock:
      return dict(self._counts)


def run_or_abort(context, fn: Callable, *args):
  """`fn(*args)`, or the call aborted with the status and message of the Refusal it raised."""
  try:
    return fn(*args)
  except Refusal as r:
    context.abort(r.code, r.message)


def call_session(context) -> str:
  """The learner session a call carries (`auth.SESSION_METADATA_KEY`), or ""."""
  for key, value in context.invocation_metadata() or ():
    if key == auth.SESSION_METADATA_KEY and isinstance(value, str):
      return value
  return ""
