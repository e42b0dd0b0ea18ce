"""One learner's connection to the syncer: its registration, pulls and pushes.

`SyncerLink` is the learner's side of the protocol above the client (transport/client.py) and
the edge where its kernel's types meet the wire. It registers (handing back versions a restarted
syncer lost), pulls each announced version, decoded against a base it holds, into the versions
its learner's kernel holds (learner/held.py: their one owner, which prunes them at every apply),
and pushes an `Answer` as the outer gradient δ = Θ^(anchor) − θ against the anchor the answer
carries, in the codec the syncer negotiated (fp32 θ when it carries none). It is thread-safe and
does no waiting or retrying of its own.

A learner process drives it from its threads (learner_process/worker.py); the simulated cluster drives
it on a virtual clock (service/virtual.py). Both talk to the same service through the same
client, over the syncer's ports (gRPC and its bulk port) or the in-process transport: one code path
for the protocol.
"""

import dataclasses
import threading
from collections.abc import Callable, Mapping

import numpy as np

from ddiloco.fragments import compression
from ddiloco.learner.held import HeldVersions
from ddiloco.protocol import Answer, EncodedDelta, FragmentState, ReportResult, Uplink
from ddiloco.syncer.blockwise import OutputBuffer
from ddiloco.transport import wire
from ddiloco.transport.client import SyncerClient
from ddiloco.transport.fragment_encoder import SPLIT_VALUES, encode_in_parts


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
    client: the syncer client (over its ports, or in-process).
    learner_id: this learner's id.
    layouts: per fragment, {key: (shape, dtype)} (transport.client.fragment_layouts).
    layout_digest: the fragment layout's digest, checked by the syncer at Register.
    held: the versions the learner holds (its kernel's, `LearnerKernel.held`); None: a store of
      the link's own (a link without a learner).
    encode_workers: threads that encode one answer's δ where this host encodes it (the devices
      did not) in a lossy codec: a fragment of at least `SPLIT_VALUES` values is encoded in that
      many parts at once (`fragment_encoder.encode_in_parts`), the same bytes as one pass, into
      memory each sender thread reuses; 1, or fp32 (a subtraction, faster streamed than the
      parts' copy: scripts/bench_host_encode.py): one pass, streamed as it is sent.
  """

  def __init__(
    self,
    client: SyncerClient,
    *,
    learner_id: int,
    layouts: list[wire.Layout],
    layout_digest: str,
    held: HeldVersions | None = None,
    encode_workers: int = 1,
  ):
    if encode_workers < 1:
      raise ValueError(f"encode_workers must be >= 1, got {encode_workers}.")
    self.client = client
    self.encode_workers = encode_workers
    self._local = threading.local()  # Each sender thread's output memory for encoded parts.
    self.learner_id = learner_id
    self.layouts = layouts
    self.layout_digest = layout_digest
    self._lock = threading.Lock()
    self.held = held if held is not None else HeldVersions(len(layouts))
    self.held.guard(threading.Lock())  # The puller and the comm thread share it with training.
    self._newest = [-1] * len(layouts)  # Newest version received of each p since registering.
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
    held = self.held.newest_held()
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
        values = self.held.get(p, version)
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
      base_lookup=lambda v: self.held.values(p, v),
    )
    if state is None:
      return None
    self.keep(state)
    return state

  def keep(self, state: FragmentState) -> None:
    """Holds a received version (a base, and an anchor once applied) as delivered."""
    self.held.keep(state)
    with self._lock:
      self._newest[state.fragment] = max(self._newest[state.fragment], state.version)

  def newest(self, p: int) -> int:
    """The newest version of p received since registering (-1: none)."""
    with self._lock:
      return self._newest[p]

  def newest_all(self) -> list[int]:
    """`newest(p)` of every fragment, read at once."""
    with self._lock:
      return list(self._newest)

  def forget_deliveries(self) -> None:
    """Forgets what was received (a corrupt pull): everything is fetched in full next time."""
    with self._lock:
      self._newest = [-1] * self.num_fragments

  @property
  def uplink(self) -> tuple[str, int]:
    """(codec, block size) of pushes, as negotiated at the last registration."""
    with self._lock:
      return self.codec, self.block_size

  def push(self, answer: Answer, *, on_copied: Callable[[], None] | None = None) -> ReportResult:
    """Pushes `answer`: δ = Θ^(anchor) − θ in the negotiated codec (`Uplink.DELTA`), or fp32 θ.

    θ comes from the answer's host copy or device snapshot: a snapshot may encode δ on the devices
    (fragments/device_codec.py), sent in its own codec and block size; otherwise θ is copied to the
    host and δ is formed there, in the encoder's one pass while it is sent, or for a large
    fragment on `encode_workers` threads first. `on_copied` is called once the payload is in
    host memory (the sender's latency split).

    Raises:
      ValueError: if θ cannot be encoded (e.g. a NaN/Inf value).
      grpc.RpcError: for any failure other than a late or duplicate answer.
    """
    codec, block_size = self.uplink
    encoded = None
    if answer.uplink is Uplink.THETA:
      codec = "fp32"
    else:
      encoded = answer.theta.encode_delta(codec, answer.anchor, block_size)
    theta = answer.theta() if encoded is None else {}
    if encoded is None and answer.uplink is Uplink.DELTA and self._in_parts(codec, theta):
      # Before anything is sent: a NaN/Inf θ raises here, named by key.
      entries = encode_in_parts(
        answer.anchor,
        codec,
        block_size=block_size,
        base=theta,
        workers=self.encode_workers,
        allocate=self._output().arrays,
      )
      encoded = EncodedDelta(codec, block_size, entries)
      theta = {}
    report = answer.as_report(theta)
    if on_copied is not None:
      on_copied()
    if encoded is None:
      return self.client.push(report, codec, block_size=block_size, anchor_values=answer.anchor)
    return self.client.push(
      report,
      encoded.codec,
      block_size=encoded.block_size,
      anchor_values=answer.anchor,
      encoded=encoded.entries,
    )

  def _in_parts(self, codec: str, theta: Mapping[str, np.ndarray]) -> bool:
    """Whether this host encodes θ's δ on `encode_workers` threads (see the class docstring)."""
    return (
      self.encode_workers > 1
      and not compression.codec_class(codec).exact
      and sum(np.size(v) for v in theta.values()) >= SPLIT_VALUES
    )

  def _output(self) -> OutputBuffer:
    """This thread's memory for encoded parts: its push is sent before it encodes another."""
    buffer = getattr(self._local, "buffer", None)
    if buffer is None:
      buffer = self._local.buffer = OutputBuffer()
    return buffer

  def heartbeat(self, step: int, step_time_s: float = 0.0):
    """One heartbeat (the learner's schedule step and step time); the HeartbeatResponse."""
    return self.client.heartbeat(self.learner_id, step=step, step_time_s=step_time_s)

  def leave(self) -> bool:
    return self.client.leave(self.learner_id)
