"""One learner's connection to the syncer: its registration, the versions it holds, pulls and pushes.

`SyncerLink` is the learner's side of the protocol above the client (transport/client.py): it
registers (handing back versions a restarted syncer lost), keeps each fragment's received versions
(the bases of downlink deltas and the anchors of outer gradients, docs/algorithm.md §5) with their
digests, pulls, and pushes a report as the outer gradient against the anchor it holds, in the
codec the syncer negotiated. It is thread-safe and does no waiting or retrying of its own.

A learner process drives it from its threads (distributed/worker.py); the simulated cluster drives
it on a virtual clock (distributed/virtual.py). Both talk to the same service through the same
client, over gRPC or the in-process transport: one code path for the protocol.
"""

import dataclasses
import threading
from collections.abc import Mapping

import numpy as np

from ddiloco.fragments.device_int4 import EncodedDelta
from ddiloco.protocol import FragmentState, Report, ReportResult
from ddiloco.transport import wire
from ddiloco.transport.client import SyncerClient


@dataclasses.dataclass(frozen=True)
class Registration:
  """What a registration told the learner (RegisterResponse, and what was handed back)."""

  versions: tuple[int, ...]
  fleet_step: int
  uplink_codec: str
  block_size: int
  overlap: int
  heartbeat_interval_s: float
  recovered: tuple[tuple[int, int, bool], ...] = ()  # (fragment, version, adopted) handed back.


class SyncerLink:
  """The syncer as one learner sees it (see module docstring).

  Args:
    client: the syncer client (gRPC or in-process).
    learner_id: this learner's id.
    layouts: per fragment, {key: (shape, dtype)} (transport.client.fragment_layouts).
    layout_digest: the fragment layout's digest, checked by the syncer at Register.
  """

  def __init__(
    self,
    client: SyncerClient,
    *,
    learner_id: int,
    layouts: list[wire.Layout],
    layout_digest: str,
  ):
    self.client = client
    self.learner_id = learner_id
    self.layouts = layouts
    self.layout_digest = layout_digest
    self._lock = threading.Lock()
    num = len(layouts)
    self._held: list[dict[int, Mapping[str, np.ndarray]]] = [{} for _ in range(num)]
    self._newest = [-1] * num  # Newest version received of each fragment since registering.
    self._digests: dict[tuple[int, int], str] = {}  # (p, v) -> digest of what was received.
    self.codec = "fp32"
    self.block_size = 64
    self.registrations = 0

  @property
  def num_fragments(self) -> int:
    return len(self.layouts)

  @property
  def bytes_received(self) -> int:
    """Bytes pulled so far on this link's client."""
    return self.client.bytes_down

  def register(self, *, num_devices: int = 0, batch_size: int = 0, host: str = "") -> Registration:
    """Registers: a new epoch at the syncer, so nothing counts as delivered until pulled again.

    Until this learner has pulled fragment p again, its reports of p weigh 0 (docs/algorithm.md §3).
    A restarted syncer that lost a version this learner holds asks for it back; it is handed back
    here (`SyncerClient.recover`).

    Raises:
      grpc.RpcError: if a call fails or the syncer refuses (e.g. a layout mismatch).
    """
    with self._lock:
      held = {
        p: (v, self._digests[(p, v)])
        for p, versions in enumerate(self._held)
        if versions and (p, v := max(versions)) in self._digests
      }
    resp = self.client.register(
      self.learner_id,
      layout_digest=self.layout_digest,
      num_fragments=self.num_fragments,
      num_devices=num_devices,
      batch_size=batch_size,
      host=host,
      held=held,
    )
    recovered = []
    for p in resp.recover:  # A restarted syncer lost these versions: hand them back.
      if p in held:
        version = held[p][0]
        with self._lock:
          values = self._held[p].get(version)
        if values is not None:
          answer = self.client.recover(self.learner_id, p, version, values)
          recovered.append((int(p), version, bool(answer.adopted)))
    with self._lock:
      self.codec, self.block_size = resp.uplink_codec, resp.block_size
      self._newest = [-1] * self.num_fragments  # Re-fetch everything: deliveries were forgotten.
      self.registrations += 1
    return Registration(
      versions=tuple(int(v) for v in resp.versions),
      fleet_step=int(resp.fleet_step),
      uplink_codec=resp.uplink_codec,
      block_size=int(resp.block_size),
      overlap=int(resp.overlap),
      heartbeat_interval_s=float(resp.heartbeat_interval_s),
      recovered=tuple(recovered),
    )

  def pull(self, p: int, known: int | None = None) -> FragmentState | None:
    """The newest version of p (a delta against `known`, default the newest held); None if
    `known` is the newest. Keeps it as a base and anchor.

    Raises:
      grpc.RpcError: on a failed call; WireError on a malformed or mismatching stream.
    """
    if known is None:
      known = self.newest(p)
    lay = self.layouts[p]
    state = self.client.pull(
      self.learner_id,
      p,
      known,
      layout_keys=list(lay),
      shapes={k: s for k, (s, _) in lay.items()},
      dtypes={k: d for k, (_, d) in lay.items()},
      base_lookup=lambda v: self.held_values(p, v),
    )
    if state is None:
      return None
    self.keep(state)
    return state

  def keep(self, state: FragmentState) -> None:
    """Holds a received version (as a base and anchor) with its digest."""
    with self._lock:
      self._held[state.fragment][state.version] = state.values
      self._newest[state.fragment] = max(self._newest[state.fragment], state.version)
      self._digests[(state.fragment, state.version)] = state.digest

  def record_digest(self, p: int, version: int, digest: str) -> None:
    """Records the digest of a version received another way (a multi-process learner's share)."""
    with self._lock:
      self._digests[(p, version)] = digest

  def held_values(self, p: int, version: int) -> Mapping[str, np.ndarray]:
    """The values of version `version` of p as received. Raises KeyError if not held."""
    with self._lock:
      return self._held[p][version]

  def anchor_values(self, p: int, version: int) -> Mapping[str, np.ndarray] | None:
    """Θ_p at `version` as held (the anchor of an outer gradient), or None."""
    if version < 0:
      return None
    with self._lock:
      return self._held[p].get(version)

  def newest(self, p: int) -> int:
    """The newest version of p received since registering (-1: none)."""
    with self._lock:
      return self._newest[p]

  def newest_all(self) -> list[int]:
    """`newest(p)` of every fragment, read at once."""
    with self._lock:
      return list(self._newest)

  def digest(self, p: int, version: int) -> str | None:
    with self._lock:
      return self._digests.get((p, version))

  def forget_before(self, p: int, version: int) -> None:
    """Drops the held versions of p older than `version` (never a base or anchor again)."""
    with self._lock:
      for v in [v for v in self._held[p] if v < version]:
        del self._held[p][v]

  def forget_deliveries(self) -> None:
    """Forgets what was received (a corrupt pull): everything is fetched in full next time."""
    with self._lock:
      self._newest = [-1] * self.num_fragments

  @property
  def uplink(self) -> tuple[str, int]:
    """(codec, block size) of pushes, as negotiated at the last registration."""
    with self._lock:
      return self.codec, self.block_size

  def push(
    self,
    report: Report,
    anchor_values: Mapping[str, np.ndarray] | None,
    *,
    encoded: EncodedDelta | None = None,
  ) -> ReportResult:
    """Pushes `report` as the outer gradient against `anchor_values` (Θ^(anchor) as held when the
    report was made: `anchor_values`), in the negotiated codec; fp32 values without one.

    `encoded`: that outer gradient already encoded (a learner's devices, fragments/device_int4.py),
    sent in its own codec and block size; report.values are then not read.

    Raises:
      grpc.RpcError: for any failure other than a late or duplicate answer.
    """
    codec, block_size = self.uplink
    if anchor_values is None:
      codec, encoded = "fp32", None
    if encoded is None:
      return self.client.push(report, codec, block_size=block_size, anchor_values=anchor_values)
    return self.client.push(
      report,
      encoded.codec,
      block_size=encoded.block_size,
      anchor_values=anchor_values,
      encoded=encoded.entries,
    )

  def heartbeat(self, step: int, step_time_s: float = 0.0):
    """One heartbeat (the learner's schedule step and step time); the HeartbeatResponse."""
    return self.client.heartbeat(self.learner_id, step=step, step_time_s=step_time_s)

  def leave(self) -> bool:
    return self.client.leave(self.learner_id)
