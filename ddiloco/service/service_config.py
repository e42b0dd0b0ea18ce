"""The syncer service's settings (`ServiceConfig`): codecs, chunk size, liveness and door bounds.

Sent to learners at Register where they concern them (codecs, block size, chunk size, heartbeat
interval); the rest bounds the service's door (service/door.py) and its server's threads.
"""

import dataclasses

from ddiloco.fragments import compression
from ddiloco.transport import bulk_pace, wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, FRAMING_SLACK
from ddiloco.types import check_int_fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
  """Wire and liveness settings of the syncer service, sent to learners at Register.

  Attributes:
    uplink_codec: codec of the learners' outer-gradient pushes (docs/algorithm.md §5).
    downlink_codec: codec of fragment updates Θ_new − Θ_old (docs/algorithm.md §5); fp32 sends full values.
    block_size: values per absmax scale block for int8/int4.
    max_chunk_bytes: largest chunk payload of a Recover (over gRPC, whose default message limit
      is 4 MiB), of the in-process carrier's pushes and pulls, and of the downlink deltas' cached
      chunks (~1 MiB).
    heartbeat_interval_s: how often learners call Heartbeat.
    liveness_timeout_s: silence after which a learner is declared dead.
    control_workers: server threads that data and Rounds streams can never take: they serve
      Register, Heartbeat, Status, Leave and refusals however many streams are open.
    max_data_streams: push, pull and Recover streams open at once that have named their learner
      (each holds a thread); when they are all taken, a learner with fewer open takes the newest
      place of the learner with the most (service/stream_gate.py), so with at least one place per
      learner of the fleet, a learner with none open always gets one.
    max_data_streams_per_learner: Push and Pull streams open at once for one learner id (a learner
      pushes one fragment and pulls one at a time; the rest is room for a retry overlapping the end
      of its predecessor).
    max_unclaimed_streams: streams open at once that have not named their learner yet (a push's
      first chunk names it, a bulk connection's hello's session too): a pool of their own, never
      taken from the learners'; a new one evicts the oldest that has shown nothing of itself.
    max_rounds_streams: Rounds streams open at once: one per learner (a new subscription replaces
      the learner's previous one), so this bounds the fleet that can subscribe.
    stream_idle_s: longest wait for a push's next chunk, and longest a send may be stuck; on the
      bulk port, the grace of each chunk message before `bulk_min_rate` counts (a chunk of n bytes
      may take `stream_idle_s + n / bulk_min_rate` s, `PhaseLimits.chunk_deadline_s`).
    stream_deadline_s: longest a push or pull stream may stay open (the learners' deadline of
      theirs too: `launch/runtime.learner_client`).
    max_pending_calls: calls that may wait for a server thread (gRPC refuses any beyond).
    max_members: learner ids the service keeps a record of; a new id beyond it is refused while
      none of the known ones has left.
    member_retention_s: how long a learner that left or was declared dead stays in the record.
    bulk_port: the bulk port, which carries every push and pull (service/bulk_server.py;
      advertised at Register; 0: a free one, picked at start); shard i of a sharded syncer
      serves on `bulk_port + i`. A firewall must let learners reach it as the gRPC port.
    bulk_chunk_bytes: largest chunk payload accepted or sent on the bulk port (advertised at
      Register): every chunk costs both ends per-message work (its frame's reads, its hand-over
      to the handler), which 4 MiB chunks pay a quarter as often as 1 MiB ones
      (scripts/bench_wire.py); a push the bulk port cannot place in its output arrays (not fp32)
      holds up to three chunks of it per stream while it is read. With a lossy downlink codec
      at least `max_chunk_bytes` (its deltas' chunks are cut once, in that size, for every
      carrier).
    bulk_hello_s: on the bulk port, longest from a connection's accept to its whole hello (a TLS
      handshake included), and the grace of a push's first chunk message after it: a learner
      sends both at once, so only a client that says nothing waits it out.
    bulk_min_rate: on the bulk port, bytes per second each chunk message and each whole call must
      keep, read or sent, after its grace (`bulk_pace.PhaseLimits`): a peer that trickles is cut
      about a grace into its phase, whatever it trickles. Far below any real link's share (32
      KiB/s is 0.26 Mbit/s): it only tells a peer that stalls from a slow one.
    max_bulk_connections: connections open at once on the bulk port (each holds a thread and a
      descriptor); one more is closed at once (counted, RESOURCE_EXHAUSTED). 0: the data streams'
      places (`max_data_streams + max_unclaimed_streams`) plus `max_unclaimed_streams` for
      connections that are saying their last words (a refusal's trailer, its drain).
  """

  uplink_codec: str = "bf16"
  downlink_codec: str = "bf16"
  block_size: int = 64
  max_chunk_bytes: int = DEFAULT_CHUNK_SIZE
  heartbeat_interval_s: float = 0.25
  liveness_timeout_s: float = 30.0
  control_workers: int = 8
  max_data_streams: int = 32
  max_data_streams_per_learner: int = 4
  max_unclaimed_streams: int = 8
  max_rounds_streams: int = 64
  stream_idle_s: float = 15.0
  stream_deadline_s: float = 300.0
  max_pending_calls: int = 256
  max_members: int = 1024
  member_retention_s: float = 600.0
  bulk_port: int = 0
  bulk_chunk_bytes: int = 4 << 20
  bulk_hello_s: float = 10.0
  bulk_min_rate: int = 32 << 10
  max_bulk_connections: int = 0

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    for name in ("uplink_codec", "downlink_codec"):
      if getattr(self, name) not in compression.CODECS:
        raise ValueError(
          f"{name} must be one of {compression.CODECS}, got {getattr(self, name)!r}."
        )
    if not 1 <= self.block_size <= wire.MAX_BLOCK_SIZE:
      raise ValueError(f"block_size must be in [1, {wire.MAX_BLOCK_SIZE}], got {self.block_size}.")
    if min(self.max_chunk_bytes, self.bulk_chunk_bytes) < 1024:
      raise ValueError(
        f"max_chunk_bytes and bulk_chunk_bytes must be >= 1024, got {self.max_chunk_bytes} and "
        f"{self.bulk_chunk_bytes}."
      )
    lossy_downlink = not compression.codec_class(self.downlink_codec).exact
    if lossy_downlink and self.bulk_chunk_bytes < self.max_chunk_bytes:
      # The downlink deltas are encoded once, in chunks of max_chunk_bytes, and every pull sends
      # those chunks as they are: the bulk port's learners would refuse them.
      raise ValueError(
        f"bulk_chunk_bytes={self.bulk_chunk_bytes} is below max_chunk_bytes="
        f"{self.max_chunk_bytes}: a {self.downlink_codec} downlink sends its deltas in chunks of "
        "max_chunk_bytes over the bulk port, which its learners refuse. Make bulk_chunk_bytes "
        ">= max_chunk_bytes."
      )
    if not 0 < self.heartbeat_interval_s < self.liveness_timeout_s:
      raise ValueError("Need 0 < heartbeat_interval_s < liveness_timeout_s.")
    # Two control threads at least: a heartbeat must not wait behind a slow Register.
    if self.control_workers < 2:
      raise ValueError(f"control_workers must be >= 2, got {self.control_workers}.")
    if self.max_data_streams < 1 or self.max_rounds_streams < 1:
      raise ValueError("max_data_streams and max_rounds_streams must be >= 1.")
    if not 1 <= self.max_data_streams_per_learner <= self.max_data_streams:
      raise ValueError(
        f"max_data_streams_per_learner must be in [1, max_data_streams={self.max_data_streams}], "
        f"got {self.max_data_streams_per_learner}."
      )
    if not 1 <= self.max_unclaimed_streams <= self.max_data_streams:
      raise ValueError(
        f"max_unclaimed_streams must be in [1, max_data_streams={self.max_data_streams}], "
        f"got {self.max_unclaimed_streams}."
      )
    if not 0 < self.stream_idle_s <= self.stream_deadline_s:
      raise ValueError("Need 0 < stream_idle_s <= stream_deadline_s.")
    if self.max_pending_calls < 0:
      raise ValueError(f"max_pending_calls must be >= 0, got {self.max_pending_calls}.")
    if self.max_members < 1:
      raise ValueError(f"max_members must be >= 1, got {self.max_members}.")
    if not self.member_retention_s >= 0:  # `not >=` refuses NaN too.
      raise ValueError(f"member_retention_s must be >= 0, got {self.member_retention_s}.")
    if not 0 <= self.bulk_port <= 65535:
      raise ValueError(f"bulk_port must be in [0, 65535], got {self.bulk_port}.")
    if not self.bulk_hello_s > 0:  # `not >` refuses NaN too.
      raise ValueError(f"bulk_hello_s must be > 0, got {self.bulk_hello_s}.")
    if self.bulk_min_rate < 1:
      raise ValueError(f"bulk_min_rate must be >= 1 byte/s, got {self.bulk_min_rate}.")
    if self.max_bulk_connections < 0:
      raise ValueError(f"max_bulk_connections must be >= 0, got {self.max_bulk_connections}.")

  @property
  def server_threads(self) -> int:
    """The server's thread pool: streams within their bounds leave `control_workers` free."""
    return (
      self.control_workers
      + self.max_data_streams
      + self.max_unclaimed_streams
      + self.max_rounds_streams
    )

  @property
  def bulk_connections(self) -> int:
    """Connections open at once on the bulk port (`max_bulk_connections`, or its default)."""
    return self.max_bulk_connections or self.max_data_streams + 2 * self.max_unclaimed_streams

  def bulk_limits(self) -> bulk_pace.PhaseLimits:
    """The bulk port's phase deadlines (`bulk_pace.PacedSocket`)."""
    return bulk_pace.PhaseLimits(
      hello_s=self.bulk_hello_s,
      header_s=self.bulk_hello_s,
      grace_s=self.stream_idle_s,
      min_rate=self.bulk_min_rate,
      transfer_s=self.stream_deadline_s,
    )

  def channel_options(self) -> list[tuple[str, int]]:
    """Explicit message size limits for both ends (gRPC's default receive limit is 4 MiB)."""
    limit = self.max_chunk_bytes + FRAMING_SLACK
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
