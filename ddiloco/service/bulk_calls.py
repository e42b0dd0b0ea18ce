"""One call on the syncer's bulk port, as the data plane's handlers see it (service/bulk_server.py).

The handlers (`server.data_handlers`: streams.py's Push and Pull) were written against gRPC's
servicer context and request iterator. A bulk connection gives them:
- `BulkCall`, the context: the call's metadata (token, session), `abort`, callbacks, and what the
  bulk port adds: its ticket (`stream_gate.StreamTicket`, admitted at the accept), its chunk bound,
  the placement of a push's chunks (transport/placement.py), the framing of a pull's pieces, and
  `paced` (every read and send is timed by its phase: `bulk_pace.PacedSocket`);
- `PushFrames`, the request iterator: a push's chunk messages, each length bounded before a byte
  of it is allocated, each frame timed as a chunk message (the first as the header), refusals
  counted and raised as the handlers' `Refusal`s are;
- `PullFraming`, the framing of a pull's pieces, which knows whether a frame is under way.
"""

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import grpc

from ddiloco.service import door
from ddiloco.service.refusals import Refusal
from ddiloco.service.stream_gate import StreamTicket
from ddiloco.transport import bulk_pace, bulk_wire
from ddiloco.transport.chunks import ArrayPool
from ddiloco.transport.placement import Placement
from ddiloco.transport.proto import syncer_pb2

DRAIN_S = 2.0  # Longest a refused push's unread bytes are drained (so the trailer is not reset).


class Aborted(Exception):
  """A handler aborted its call (`BulkCall.abort`): the status and message the client gets."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code, self.message = code, message


class Quiet(Exception):
  """A read failed after the call was over: nobody listens, nothing is counted."""


class BulkCall:
  """What the Push and Pull handlers use of gRPC's servicer context, for one bulk connection."""

  paced = True  # The connection times every read and send itself (`bulk_pace.PacedSocket`).

  def __init__(
    self,
    sock: bulk_pace.PacedSocket,
    metadata: tuple[tuple[str, str], ...],
    max_chunk_bytes: int,
    ticket: StreamTicket,
  ):
    self._sock = sock
    self._metadata = metadata
    self.max_chunk_bytes = max_chunk_bytes  # The handlers' chunk bound on this port.
    self.ticket = ticket  # The connection's place, admitted at its accept.
    self._callbacks: list = []
    self.closing = threading.Event()  # Set once the call is over: reads then stop quietly.
    # A push's chunks are received where the handler's reader offers (transport/placement.py).
    self.placement: Placement | None = None
    # A pull's stream is sent as pieces framed by this (`state_messages.state_pieces`).
    self.frame_head = None

  def invocation_metadata(self):
    return self._metadata

  def add_callback(self, callback) -> bool:
    self._callbacks.append(callback)
    return True

  def abort(self, code: grpc.StatusCode, details: str):
    raise Aborted(code, details)

  def cancel(self) -> None:
    """Cuts the call: the socket is shut, a blocked read or send raises."""
    self.close()

  def interrupt(self) -> None:
    """Cuts the handler's read under way (`bulk_pace.Interrupted`), from another thread, and
    leaves the socket open: the handler's refusal still reaches the client as its trailer."""
    self._sock.interrupt()

  def close(self) -> None:
    self.closing.set()
    with contextlib.suppress(OSError):
      self._sock.shutdown(socket.SHUT_RDWR)

  def run_callbacks(self) -> None:
    for callback in self._callbacks:
      callback()


class PullFraming:
  """Frames a Pull's pieces (`bulk_wire.frame_head`), each frame timed as a chunk message, and
  knows whether a frame is under way: a failure mid-frame must cut the connection, as a trailer
  would be read as the frame's bytes."""

  def __init__(self, sock: bulk_pace.PacedSocket):
    self._sock = sock
    self._yielded = 0  # Bytes of the pieces handed to the sender.
    self._frame_end = 0  # Where the last frame begun ends.

  def head(self, message_head: bytes, data_len: int) -> bytes:
    head = bulk_wire.frame_head(message_head, data_len)
    self._frame_end = self._yielded + len(head) + data_len
    self._sock.begin_chunk()  # Its head goes out with its first data.
    return head

  def counted(self, pieces):
    for piece in pieces:
      self._yielded += len(piece)
      yield piece

  def mid_frame(self) -> bool:
    return self._yielded != self._frame_end and self._yielded > 0


class PushFrames:
  """A Push's frames as the handler's request iterator (see module docstring).

  The handler reads it in its own thread (`PacedStream` without deadlines of its own); a read
  cut by `BulkCall.interrupt` (the stream lost its place) ends it as evicted; once the call is
  over (`call.closing`) a read that fails ends it quietly: the call's status is already decided.

  Args:
    sock: the connection.
    call: its call.
    max_frame: the largest frame accepted.
    pool: recycled frame buffers.
    refuse: makes (and counts) a refusal from a status code and a message.
    on_expired: called with the phase of a deadline passed (`bulk_pace.PhaseTimeout`).
  """

  def __init__(
    self,
    sock: bulk_pace.PacedSocket,
    call: BulkCall,
    *,
    max_frame: int,
    pool: ArrayPool,
    refuse: Callable[[grpc.StatusCode, str], Refusal],
    on_expired: Callable[[str], None],
  ):
    self._sock, self._call, self._max = sock, call, max_frame
    self._refuse, self._on_expired = refuse, on_expired
    self._reader = bulk_wire.FrameReader(sock, pool, call.placement, syncer_pb2.PushHeader)
    self.ended = False  # The end mark was read: nothing of the client's is left unread.

  def __iter__(self):
    phase = "header"
    try:
      while True:
        self._sock.begin_chunk(phase)
        phase = "chunk"
        (n,) = bulk_wire.LENGTH.unpack(bulk_wire.recv_exact(self._sock, bulk_wire.LENGTH.size))
        if n == bulk_wire.END:
          self.ended = True
          return
        if n > self._max:
          raise self._refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Push frame of {n} bytes: chunk messages are at most {self._max} bytes.",
          )
        yield self._reader.read(n)
    except bulk_pace.PhaseTimeout as e:
      if not self._call.closing.is_set():
        self._on_expired(e.phase)
      raise self._refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"{e} ({e.phase})") from None
    except (bulk_wire.BulkClosed, OSError) as e:  # (BulkClosed and bulk_pace.Interrupted are)
      if self._call.ticket.evicted:  # Its reads were cut to give its place to another stream:
        raise door.StreamTimeout("evicted") from None  # refused as such, nothing else counted.
      if isinstance(e, bulk_wire.BulkClosed):
        raise self._refusal(
          grpc.StatusCode.INVALID_ARGUMENT, f"Push stream truncated: {e}"
        ) from None
      if not self._call.closing.is_set():
        raise

  def _refusal(self, code: grpc.StatusCode, message: str) -> Exception:
    if self._call.closing.is_set():
      return Quiet()
    return self._refuse(code, message)

  def drain(self) -> None:
    """Reads what the client still sends of a refused push until it closes, for at most
    `DRAIN_S`: closing with unread bytes would make the kernel reset the connection, and the
    client could lose the trailer before reading it. The client stops sending once it sees it."""
    if self.ended:
      return
    raw = self._sock.raw
    deadline = time.monotonic() + DRAIN_S
    buf = bytearray(1 << 16)
    with contextlib.suppress(OSError, ValueError):
      while time.monotonic() < deadline:
        raw.settimeout(max(0.01, deadline - time.monotonic()))
        if raw.recv_into(buf) == 0:
          return
