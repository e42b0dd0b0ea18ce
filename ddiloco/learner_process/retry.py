"""How a learner process retries its calls to the syncer: which gRPC failures are transient, which
mean "register again", and the exponential backoff between tries."""

import grpc
import numpy as np

# Failures after which the call is simply retried later (the syncer is down, slow or restarting).
TRANSIENT = (
  grpc.StatusCode.UNAVAILABLE,
  grpc.StatusCode.DEADLINE_EXCEEDED,
  grpc.StatusCode.CANCELLED,
  grpc.StatusCode.RESOURCE_EXHAUSTED,
  grpc.StatusCode.UNKNOWN,
  grpc.StatusCode.INTERNAL,
)
# The syncer does not know this learner (restarted, or declared it dead), or no longer takes its
# session (another registration of the id replaced it): register again.
UNREGISTERED = (
  grpc.StatusCode.NOT_FOUND,
  grpc.StatusCode.FAILED_PRECONDITION,
  grpc.StatusCode.PERMISSION_DENIED,
)


class Backoff:
  """Exponential backoff with full jitter: delays grow from `initial_s` to `max_s`."""

  def __init__(self, initial_s: float = 0.1, max_s: float = 5.0, seed: int = 0):
    self.initial_s, self.max_s = initial_s, max_s
    self._attempt = 0
    self._rng = np.random.default_rng(seed)

  def reset(self) -> None:
    self._attempt = 0

  def next_delay(self) -> float:
    cap = min(self.max_s, self.initial_s * 2**self._attempt)
    self._attempt = min(self._attempt + 1, 30)
    return float(self._rng.uniform(0.5 * cap, cap))
