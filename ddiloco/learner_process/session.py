"""A learner process's registration with the syncer: the first connect (with retries), and
registering again whenever the syncer has forgotten this learner or replaced its session."""

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ddiloco.learner.learner import Learner
from ddiloco.learner_process.link import SyncerLink
from ddiloco.learner_process.retry import TRANSIENT, UNREGISTERED, Backoff
from ddiloco.protocol import FragmentState
from ddiloco.transport.client import SyncerClient


class SyncerSession:
  """This learner's standing at the syncer, shared by the threads that call it.

  `registrations` counts registrations (a call records it as its epoch: `unregistered`);
  `need_register` is set by any thread whose call says the syncer forgot this learner, and cleared
  by the next registration (the comm thread's).

  Args:
    learner: the learner (its mesh and τ, read at each registration).
    client: the syncer client.
    link: the learner's link to the syncer (registration, pulls).
    batch_size: sequences per step (informational at Register).
    connect_timeout_s: how long the first registration may take.
    event: writes one event to this learner's metrics (`kind`, then its fields).
  """

  def __init__(
    self,
    *,
    learner: Learner,
    client: SyncerClient,
    link: SyncerLink,
    batch_size: int = 0,
    connect_timeout_s: float = 120.0,
    event: Callable[..., None],
  ):
    self._learner = learner
    self._client = client
    self._link = link
    self._batch_size = batch_size
    self._connect_timeout_s = connect_timeout_s
    self._event = event
    self.need_register = threading.Event()
    self.codec = "fp32"
    self.heartbeat_interval_s = 0.25
    self.registrations = 0
    self.recoveries = 0  # Fragments handed back to a restarted syncer that had lost them.

  def fetch_global(self) -> tuple[Any, list[FragmentState]]:
    """The network half of `connect`: registers and pulls every fragment, with retries.

    Returns:
      The RegisterResponse and the fragments the syncer holds.

    Raises:
      TimeoutError: if the syncer did not answer within `connect_timeout_s`.
      grpc.RpcError: if the syncer refused the registration (e.g. layout mismatch).
    """
    deadline = time.monotonic() + self._connect_timeout_s
    backoff = Backoff()
    while True:
      try:
        self._client.wait_ready(max(0.1, min(5.0, deadline - time.monotonic())))
        resp = self.register()
        states = [self._link.pull(p, -1) for p in range(self._link.num_fragments)]
        break
      except (grpc.RpcError, grpc.FutureTimeoutError) as e:
        code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
        if code not in TRANSIENT or time.monotonic() > deadline:
          if code in TRANSIENT:
            raise TimeoutError(
              f"Syncer at {self._client.address} unreachable for {self._connect_timeout_s} s."
            ) from e
          raise
        time.sleep(backoff.next_delay())
    return resp, [s for s in states if s is not None]

  def register(self):
    """Registers with the syncer: a new epoch there, so nothing counts as delivered until pulled.

    Until this learner has pulled fragment p again, its reports of p weigh 0 (docs/algorithm.md §3). `connect`
    registers and pulls everything; the comm thread re-registers when the syncer forgot us.

    Returns:
      The RegisterResponse (versions, cadence, codecs).
    """
    resp = self._link.register(
      num_devices=len(self._learner.steps.mesh.devices.flat),
      batch_size=self._batch_size,
      host=socket.gethostname(),
    )
    for p, version, adopted in resp.recovered:  # Versions a restarted syncer had lost.
      self.recoveries += int(adopted)
      self._event("recover", fragment=p, version=version, adopted=adopted)
    self.codec = resp.uplink_codec
    self.heartbeat_interval_s = resp.heartbeat_interval_s
    if resp.overlap != self._learner.schedule.overlap:
      raise ValueError(
        f"The syncer's overlap τ={resp.overlap} differs from this learner's "
        f"{self._learner.schedule.overlap}: check the gin configs."
      )
    self.registrations += 1
    self.need_register.clear()
    return resp

  def unregistered(self, error: grpc.RpcError, epoch: int) -> bool:
    """Whether a failed call means this learner must register again.

    A call refused PERMISSION_DENIED carried a stale session; if this learner registered since the
    call began (`epoch`: `registrations` then), the new session already fixes it, and registering
    once more would only void the session of the calls now in flight.
    """
    if error.code() == grpc.StatusCode.PERMISSION_DENIED:
      return self.registrations == epoch
    return error.code() in UNREGISTERED
