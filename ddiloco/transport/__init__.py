"""ddiloco.transport: the wire format, chunking and the gRPC protocol (docs/architecture.md)."""

from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE, ChunkAssembler, num_chunks_for
from ddiloco.transport.errors import WireError
from ddiloco.transport.messages import chunks_to_report
from ddiloco.transport.state_messages import chunks_to_state
from ddiloco.transport.wire import (
  FORMAT_VERSION,
  MAGIC,
  make_layout,
  max_wire_bytes,
  received_values,
)

__all__ = [
  "DEFAULT_CHUNK_SIZE",
  "FORMAT_VERSION",
  "MAGIC",
  "ChunkAssembler",
  "WireError",
  "chunks_to_report",
  "chunks_to_state",
  "make_layout",
  "max_wire_bytes",
  "num_chunks_for",
  "received_values",
]
