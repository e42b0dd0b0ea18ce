"""The data plane's framing: Push and Pull chunk messages over a plain TCP (or TLS) socket.

The syncer's data, the pushes of learners' answers and the pulls of merged versions, travel over a
port of its own, the bulk port (RegisterResponse.bulk_port); the control plane (Register,
Heartbeat, Rounds, Status, Leave, Recover) is gRPC on the main port. gRPC's Python stack moves at
most about a third of what a TCP socket does on loopback (scripts/bench_wire.py; docs/results.md,
"Wire"), so data never goes over gRPC. The stream carries serialized chunk messages (PushChunk,
FragmentChunk; transport/frames.py and messages.py), and the server feeds them to the service's
Push and Pull handlers (service/bulk_server.py, service/streams.py). Every integer is
little-endian.

One call per connection:
  hello     client -> server: MAGIC, then `HELLO` = (op, token length, session length, request
            length), then the token, the session (UTF-8) and the request (a serialized PullRequest
            for a Pull, nothing for a Push). The lengths are bounded (`MAX_TOKEN_BYTES`...) before
            anything is read.
  frames    u32 length, then that many bytes: one chunk message (Push: client -> server; Pull:
            server -> client). A length of `END` ends a Push's frames (client -> server) or
            starts the trailer (server -> client).
  trailer   server -> client, after `END`: `TRAILER` = (status code, message length, body length),
            the message (UTF-8) and the body (a serialized PushResponse for a Push; empty for a
            Pull). The status codes are gRPC's, so a client raises them as `BulkError`, a
            `grpc.RpcError` like a control call's.

The in-process carrier of the simulated cluster (transport/client.py) carries the same frames
without a socket: `messages_of` joins them back into whole chunk messages.

The server times every read and send of a call by its phase (transport/bulk_pace.py).
"""

import socket
import struct
from collections.abc import Iterable, Iterator

import grpc
import numpy as np

from ddiloco.transport import frames
from ddiloco.transport.chunks import ArrayPool
from ddiloco.transport.errors import WireError
from ddiloco.transport.placement import Placement
from ddiloco.transport.read_ahead import ReadAhead

MAGIC = b"DDB1"
OP_PUSH, OP_PULL = 1, 2
# The data calls' method names: what the token check and the refusal counts name them, and the
# in-process carrier's paths. They are not gRPC methods: data never travels over gRPC.
PUSH_METHOD, PULL_METHOD = "/ddiloco.v1.Data/Push", "/ddiloco.v1.Data/Pull"
HELLO = struct.Struct("<BHHI")
LENGTH = struct.Struct("<I")
TRAILER = struct.Struct("<III")
END = 0xFFFF_FFFF
MAX_TOKEN_BYTES = 4096
MAX_SESSION_BYTES = 256
MAX_REQUEST_BYTES = 4096
MAX_MESSAGE_BYTES = 4096
MAX_BODY_BYTES = 64 * 1024

_BUCKET = 64 << 10
# Small pieces of a stream (frame heads, the format's framing) are gathered up to this many bytes.
GATHER_BYTES = 64 << 10
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
  """gRPC's status code of an integer on the wire (UNKNOWN for one it does not have)."""
  return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class BulkError(grpc.RpcError):
  """A call over the bulk port answered with a status other than OK, as gRPC's call raises it."""

  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(f"{code.name}: {details}")
    self._code = code
    self._details = details

  def code(self) -> grpc.StatusCode:
    return self._code

  def details(self) -> str:
    return self._details


class BulkClosed(ConnectionError):
  """The peer closed the connection (or it broke) before a whole frame or trailer came."""


def tune(sock: socket.socket) -> None:
  """No Nagle delay: a hello, a trailer or a frame's tail goes out at once.

  The socket buffers are left to the kernel's autotuning, which grows them with the path's
  bandwidth-delay product up to `net.ipv4.tcp_rmem`/`tcp_wmem`'s maximum: a fixed SO_RCVBUF would
  turn it off and cap the window (4 MiB over 50 ms is 80 MiB/s), and on loopback it measured no
  better (scripts/bench_wire.py).
  """
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def hello(op: int, token: str | None, session: str, request: bytes = b"") -> bytes:
  """The hello of a call (see module docstring).

  Raises:
    ValueError: a token, session or request over its bound.
  """
  tok, ses = (token or "").encode(), session.encode()
  if len(tok) > MAX_TOKEN_BYTES or len(ses) > MAX_SESSION_BYTES or len(request) > MAX_REQUEST_BYTES:
    raise ValueError("A bulk hello's token, session or request is over its bound.")
  return MAGIC + HELLO.pack(op, len(tok), len(ses), len(request)) + tok + ses + request


def recv_exact(sock: socket.socket, n: int) -> memoryview:
  """Exactly `n` bytes read into a fresh buffer (a view of it).

  Raises:
    BulkClosed: the connection ended first. socket.timeout / OSError as the socket raises them.
  """
  return fill(sock, memoryview(bytearray(n)), "read")


def fill(sock: socket.socket, view: memoryview, what: str = "frame") -> memoryview:
  """Reads until `view` is full; returns it. Raises BulkClosed if the connection ends first."""
  n = len(view)
  got = 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if k == 0:
      raise BulkClosed(f"The connection ended {got} bytes into a {n}-byte {what}.")
    got += k
  return view


def frame_pool(max_frame_bytes: int, free_bytes: int = 32 << 20) -> ArrayPool:
  """A pool of frame buffers (`recv_body`) keeping up to `free_bytes` of free ones, and at least
  eight of the largest size, never more than were in use at once (`ArrayPool(within_peak=)`).

  A push's frames in flight (read ahead, decoding, its shorter last one) take four to five
  buffers: with room for four, one went back to the kernel with every push and the next was
  faulted in, zeroed, anew (2 % of a bf16 push's CPU, scripts/bench_ingest.py).
  """
  return ArrayPool(max(free_bytes, 8 * _bucket(max_frame_bytes)), within_peak=True)


def _bucket(n: int) -> int:
  """Frame buffers come in multiples of 64 KiB: frames of nearly one size share buffers."""
  return -(-n // _BUCKET) * _BUCKET


def recv_body(
  sock: socket.socket, n: int, pool: ArrayPool, head: bytes | memoryview = b""
) -> memoryview:
  """A frame's `n` bytes, read straight into recycled memory (one copy: the kernel's); `head`:
  its first bytes, read already.

  The reader keeps views of early chunks (transport/chunks.py), so a buffer is reused only once
  every view of it has died (`ArrayPool`); fresh pages would cost the kernel's zeroing on every
  frame.
  """
  view = memoryview(pool.empty(_bucket(n), np.uint8))[:n]
  view[: len(head)] = head
  fill(sock, view[len(head) :])
  return view


class FrameReader:
  """Reads the chunk messages of one stream's frames, each into the array it belongs in when the
  stream's `placement` has one (transport/placement.py), else into recycled memory.

  Without a placement, a frame is its bytes (`recv_body`). With one, its first bytes are read
  alone: a message of an index and data only (`frames.plain_head`) whose data the placement
  claims is read straight into that memory and comes as a `ChunkFrame`; any other is read whole
  and parsed here (a `ChunkFrame` too), or handed on as its bytes if it does not parse (the
  handler refuses it) and placement stops.
  """

  def __init__(
    self,
    sock: socket.socket,
    pool: ArrayPool,
    placement: Placement | None,
    header_type: type,
  ):
    self._sock, self._pool, self._placement, self._header = sock, pool, placement, header_type

  def read(self, n: int) -> memoryview | frames.ChunkFrame:
    """The next frame's message, of `n` bytes (its length read and bounded by the caller)."""
    placement = self._placement
    if placement is None:
      return recv_body(self._sock, n, self._pool)
    head = recv_exact(self._sock, min(n, frames.PLAIN_HEAD_BYTES))
    plain = frames.plain_head(head, n)
    if plain is not None:
      index, at = plain
      into = placement.claim(index, n - at)
      if into is not None:
        into[: len(head) - at] = head[at:]
        fill(self._sock, into[len(head) - at :])
        return frames.ChunkFrame(None, index, into, n)
      return frames.ChunkFrame(None, index, recv_body(self._sock, n, self._pool, head)[at:], n)
    body = recv_body(self._sock, n, self._pool, head)
    try:
      frame = frames.parse_chunk(body, self._header)
    except WireError:
      placement.stop()
      return body
    placement.skip(frame.index, len(frame.data))
    return frame


def frame_head(message_head: bytes, data_len: int) -> bytes:
  """The bytes in front of a chunk message's data on the bulk stream: its frame length, then the
  message's fields before its data (`messages.push_pieces`' `frame`)."""
  return LENGTH.pack(len(message_head) + data_len) + message_head


def message_frames(messages: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
  """Whole chunk messages as the pieces of their frames (`BulkClient.push`)."""
  for message in messages:
    yield LENGTH.pack(len(message))
    yield message


def messages_of(pieces: Iterable[bytes | memoryview]) -> Iterator[bytearray]:
  """The chunk messages of a stream of frames given as pieces (`frame_head` and the message's
  data after it, or `message_frames`), each joined into a buffer of its own (one copy per byte),
  for a carrier of whole messages: the in-process carrier, a Recover over gRPC. A frame's first
  piece holds its whole length. A piece's memory may be reused once the next is asked for: each
  is copied at once.

  Raises:
    WireError: if the pieces end inside a frame.
  """
  buf, at = None, 0
  for piece in pieces:
    data = memoryview(piece).cast("B")
    while data or (buf is not None and at == len(buf)):
      if buf is None:
        (n,) = LENGTH.unpack(data[: LENGTH.size])
        buf, at, data = bytearray(n), 0, data[LENGTH.size :]
      m = min(len(data), len(buf) - at)
      buf[at : at + m] = data[:m]
      at, data = at + m, data[m:]
      if at == len(buf):
        yield buf
        buf = None
  if buf is not None:
    raise WireError(f"The stream ended {at} bytes into a {len(buf)}-byte frame.")


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
  """Sends `parts` in order: one gathered `sendmsg` per try on a plain socket (no join, no copy
  in user space); `sendall` of each on a TLS socket, which has no `sendmsg`."""
  if not hasattr(sock, "sendmsg") or hasattr(sock, "cipher"):
    for part in parts:
      sock.sendall(part)
    return
  views = [memoryview(p).cast("B") for p in parts]
  while views:
    sent = sock.sendmsg(views)
    while views and sent >= len(views[0]):
      sent -= len(views[0])
      views.pop(0)
    if views and sent:
      views[0] = views[0][sent:]


def send_pieces(sock: socket.socket, pieces: Iterable[bytes | memoryview]) -> list:
  """Sends `pieces` in order: small `bytes` gathered, any other piece sent (with what was
  gathered) before the next is asked for, as its memory may be reused; returns what is left
  gathered, for the caller to send with what follows."""
  pending, gathered = [], 0
  for piece in pieces:
    pending.append(piece)
    gathered += len(piece)
    if isinstance(piece, bytes) and gathered < GATHER_BYTES:
      continue
    send_parts(sock, pending)
    pending, gathered = [], 0
  return pending


def trailer(code: grpc.StatusCode, message: str, body: bytes = b"") -> bytes:
  """`END` and the trailer of a call's status (see module docstring); long messages are cut."""
  text = message.encode()[:MAX_MESSAGE_BYTES]
  return LENGTH.pack(END) + TRAILER.pack(code.value[0], len(text), len(body)) + text + body


def read_trailer(sock: socket.socket) -> tuple[grpc.StatusCode, str, bytes]:
  """(status, message, body) of a trailer whose `END` was just read.

  Raises:
    BulkClosed: on a cut-off trailer; ValueError on one over its bounds.
  """
  code, n_text, n_body = TRAILER.unpack(recv_exact(sock, TRAILER.size))
  if n_text > MAX_MESSAGE_BYTES or n_body > MAX_BODY_BYTES:
    raise ValueError(f"A bulk trailer of {n_text} + {n_body} bytes is over its bounds.")
  text = bytes(recv_exact(sock, n_text)).decode(errors="replace")
  return status_code(code), text, bytes(recv_exact(sock, n_body))


class Prefetch:
  """Iterates `source` in a helper thread, up to `depth` items ahead: a Pull's frames are read
  while the previous ones are decoded (the reads release the GIL; a Push is sent from the
  encoder's runs in the caller's thread, as each run's memory is reused). An exception of `source`
  is raised where the item would have been.
  `close` stops and joins the helper; call it when done (it is idempotent).
  """

  def __init__(self, source: Iterable, *, depth: int = 2, name: str = "bulk-prefetch"):
    self._ahead = ReadAhead(source, depth=depth, name=name, close_source=True)

  def __iter__(self):
    return self

  def __next__(self):
    return self._ahead.get()

  def close(self, timeout_s: float = 5.0) -> None:
    self._ahead.stop()
    self._ahead.join(timeout_s)
