"""Starting the syncer service: on two ports (`serve`), or in this process (`serve_in_process`).

`make_syncer` wires a `SyncerCore` (with the downlink adoption a lossy codec needs) into a
`SyncerService`. Its handlers come in two tables: `method_handlers`, the control plane's (the
gRPC service of syncer.proto), and `data_handlers`, the data plane's Push and Pull:

- `serve`: the control plane on a synchronous `grpc.server` whose thread pool has
  `control_workers + max_data_streams + max_rounds_streams` threads (a Recover is a data stream;
  service/door.py keeps `control_workers` of them free of streams), with the standard health
  service, an optional shared token (transport/auth.py) and TLS; the data plane on the bulk port
  (service/bulk_server.py), with the same token and TLS. Ports are never shared
  (`grpc.so_reuseport` off, no SO_REUSEPORT): a second syncer on a port in use fails with a
  one-line `BindError`. A non-loopback address without a shared token is refused unless
  `insecure=True` (`ddiloco-syncer --insecure`), which logs a warning.
- `serve_in_process`: both tables, the health service and the token check over the in-process
  transport (transport/in_process.py): learner workers in the same process, no socket.
"""

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.fragments import compression, shards
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.service import door
from ddiloco.service.bulk_server import BulkServer
from ddiloco.service.downlink import DownlinkAdopter
from ddiloco.service.service import SERVICE_NAME, SyncerService
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import MergeEvent, SyncerCore
from ddiloco.transport import auth, bulk_wire, in_process
from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

log = logging.getLogger(__name__)

# Call metadata a client may send (both tokens are a few dozen bytes); gRPC refuses more.
_MAX_METADATA_BYTES = 8 * 1024


class BindError(OSError):
  """The syncer could not bind its address (most often: the port is in use)."""


class InsecureServeError(ValueError):
  """Refused to serve a network address without a shared token (see `serve`)."""


@dataclasses.dataclass
class SyncerServer:
  """A running syncer: its gRPC server (control), its bulk port (data) and its service; `stop()`
  shuts them down."""

  server: grpc.Server
  service: SyncerService
  port: int
  health: health.HealthServicer
  bulk: BulkServer

  def stop(self, grace_s: float = 2.0, *, flush: bool = True) -> None:
    self.health.enter_graceful_shutdown()
    self.bulk.stop()
    self.server.stop(grace_s).wait(grace_s + 5)
    self.service.stop(flush=flush)


def make_syncer(
  *,
  fragment_keys,
  init_values: Mapping[str, np.ndarray],
  syncer_config,
  service_config: ServiceConfig,
  layout_digest: str,
  embedding_keys=(),
  schedule: FragmentSchedule | None = None,
  clock: Callable[[], float] = time.monotonic,
  on_merge: Callable[[MergeEvent], None] | None = None,
  record: Callable[[MergeEvent], None] | None = None,
  on_recovery: Callable[[int, int, str], None] | None = None,
  shard: int = 0,
  shard_addresses: Sequence[str] = (),
) -> SyncerService:
  """A SyncerCore and its SyncerService wired together (adoption for a lossy downlink codec).

  `schedule` is the run's fragment schedule (P, H, τ): the syncer's step clock opens each
  fragment's rounds by it. None: `SyncerCore`'s default (P = H = the number of fragments, τ = 2),
  for tests and benchmarks; a run passes its own (`RunConfig.the_schedule()`).

  With `shard_addresses` (every shard's host:port, S > 1) this is syncer shard `shard`: its core
  owns the fragments `shards.owned(shard, S, P)` and needs `init_values` only for them.
  """
  num_shards = max(1, len(shard_addresses))
  owned = shards.owned(shard, num_shards, len(fragment_keys))
  adopter = None
  if not compression.codec_class(service_config.downlink_codec).exact:
    adopter = DownlinkAdopter(
      service_config.downlink_codec,
      block_size=service_config.block_size,
      chunk_size=service_config.max_chunk_bytes,
    )
  core = SyncerCore(
    fragment_keys=fragment_keys,
    init_values=init_values,
    config=syncer_config,
    clock=clock,
    embedding_keys=embedding_keys,
    adopt=adopter,
    schedule=schedule,
    owned=owned,
  )
  return SyncerService(
    core,
    layout_digest=layout_digest,
    config=service_config,
    adopter=adopter,
    clock=clock,
    on_merge=on_merge,
    record=record,
    on_recovery=on_recovery,
    shard=shard,
    shard_addresses=shard_addresses,
  )


class _Handlers:
  """Stands in for a server to collect the handlers `add_SyncerServicer_to_server` registers."""

  def add_generic_rpc_handlers(self, handlers) -> None:
    del handlers

  def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
    self.service_name, self.handlers = service_name, dict(handlers)


def method_handlers(service: SyncerService) -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
  """The control plane's service name and method handlers: `add_SyncerServicer_to_server`'s,
  except that Recover takes each chunk's serialized bytes (read by hand, `frames.parse_chunk`).

  Every unary request is decoded by `door.parse_request`, which never raises: bytes that do not
  decode, or text over its bound, reach the method as `door.Garbled` and are refused with a counted
  INVALID_ARGUMENT (a raising deserializer would make gRPC answer an uncounted INTERNAL).

  The gRPC server (`serve`) and the in-process transport (`serve_in_process`) run these same
  handlers.
  """
  collected = _Handlers()
  syncer_pb2_grpc.add_SyncerServicer_to_server(service, collected)
  handlers = collected.handlers
  recover = handlers["Recover"]
  handlers["Recover"] = grpc.stream_unary_rpc_method_handler(
    recover.stream_unary, request_deserializer=None, response_serializer=recover.response_serializer
  )
  methods = syncer_pb2.DESCRIPTOR.services_by_name["Syncer"].methods_by_name
  for name, handler in list(handlers.items()):
    if handler.request_streaming:
      continue
    parse = door.parse_request(getattr(syncer_pb2, methods[name].input_type.name))
    if handler.response_streaming:
      handlers[name] = grpc.unary_stream_rpc_method_handler(
        _refusing_garbled_stream(service, handler.unary_stream),
        request_deserializer=parse,
        response_serializer=handler.response_serializer,
      )
    else:
      handlers[name] = grpc.unary_unary_rpc_method_handler(
        _refusing_garbled(service, handler.unary_unary),
        request_deserializer=parse,
        response_serializer=handler.response_serializer,
      )
  return collected.service_name, handlers


def data_handlers(service: SyncerService) -> dict[str, grpc.RpcMethodHandler]:
  """The data plane's handlers, by method path (`bulk_wire.PUSH_METHOD`, `PULL_METHOD`): what the
  bulk port (`BulkServer`) and the in-process carrier run.

  Push takes, and Pull sends, each chunk's serialized bytes: the Push handler reads them with
  `frames.parse_chunk`, the payload a view into the received bytes (protobuf's parser would copy
  every payload byte twice, scripts/bench_wire.py), and Pull sends its stream as framed pieces
  (`state_messages.state_pieces`), each byte copied once, by the kernel. A PullRequest is decoded
  by `door.parse_request`, as a control call's request is.
  """
  return {
    bulk_wire.PUSH_METHOD: grpc.stream_unary_rpc_method_handler(
      service.Push,
      request_deserializer=None,
      response_serializer=syncer_pb2.PushResponse.SerializeToString,
    ),
    bulk_wire.PULL_METHOD: grpc.unary_stream_rpc_method_handler(
      _refusing_garbled_stream(service, service.Pull),
      request_deserializer=door.parse_request(syncer_pb2.PullRequest),
      response_serializer=None,
    ),
  }


def _add_servicer(service: SyncerService, server: grpc.Server) -> None:
  name, handlers = method_handlers(service)
  server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(name, handlers)])
  server.add_registered_method_handlers(name, handlers)


def _refusing_garbled(service: SyncerService, behavior):
  """A unary method that refuses a `door.Garbled` request before `behavior` sees it."""

  def method(request, context):
    if isinstance(request, door.Garbled):
      r = service.refuse_garbled(request)
      context.abort(r.code, r.message)
    return behavior(request, context)

  return method


def _refusing_garbled_stream(service: SyncerService, behavior):
  """`_refusing_garbled` for a server-streaming method."""

  def method(request, context):
    if isinstance(request, door.Garbled):
      r = service.refuse_garbled(request)
      context.abort(r.code, r.message)
    yield from behavior(request, context)

  return method


def serve(
  service: SyncerService,
  *,
  address: str = "127.0.0.1:0",
  token: str | None = None,
  tls: tuple[str, str] | None = None,
  insecure: bool = False,
  bulk_port: int | None = None,
  advertise_bulk_port: int = 0,
) -> SyncerServer:
  """Starts `service`'s gRPC server (control, and the standard health service), its bulk port
  (data) and its merge thread.

  Args:
    service: the servicer.
    address: host:port of the gRPC server; port 0 picks a free one. Loopback unless told
      otherwise. The bulk port is bound on the same host.
    token: shared token required on every call but health checks (None: no authentication).
    tls: (cert_file, key_file) for TLS on both ports, or None for plain TCP.
    insecure: serve a non-loopback address without a token (logged as a warning); without it
      that is refused, since any host that reaches the port could push into the global model.
    bulk_port: the bulk port to bind (0: a free one); None: `ServiceConfig.bulk_port`, plus the
      shard's index for a shard of a sharded syncer (0 stays 0).
    advertise_bulk_port: the bulk port learners are told at Register (a proxy's in front of it:
      the chaos harness); 0: the bound one.

  Returns:
    The running server, with the bound ports.

  Raises:
    InsecureServeError: a non-loopback address without a token or `insecure`.
    BindError: if an address cannot be bound (its port is in use: never shared).
    ValueError: a unix socket address (the data plane needs a TCP host).
  """
  if address.startswith(("unix:", "unix-abstract:")):
    raise ValueError(f"Cannot serve the syncer on {address}: its bulk port needs a TCP host.")
  if not token and not door.is_loopback(address):
    if not insecure:
      raise InsecureServeError(
        f"Refusing to serve {address} without a shared token: any host that reaches it could "
        "register and push. Give a token (--auth_token_file or DDILOCO_TOKEN), bind to "
        "loopback, or pass insecure=True (--insecure)."
      )
    log.warning(
      "serving %s WITHOUT authentication (insecure): anyone who reaches it can push.", address
    )
  host, port = door.split_address(address)
  if door.port_in_use(address):  # Checked first: gRPC's own failure is a vague multi-line log.
    raise BindError(f"port {port} is in use: cannot serve the syncer on {address}.")
  interceptors = [auth.TokenInterceptor(token, service.count_refusal)] if token else []
  cfg = service.config
  server = grpc.server(
    futures.ThreadPoolExecutor(max_workers=cfg.server_threads, thread_name_prefix="syncer-rpc"),
    interceptors=interceptors,
    options=[
      *cfg.channel_options(),
      # Never share the port: two syncers on one port would split the fleet between two models.
      ("grpc.so_reuseport", 0),
      ("grpc.max_metadata_size", _MAX_METADATA_BYTES),
    ],
    maximum_concurrent_rpcs=cfg.server_threads + cfg.max_pending_calls,
  )
  _add_servicer(service, server)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  try:
    if tls is None:
      bound = server.add_insecure_port(address)
    else:
      bound = server.add_secure_port(address, auth.server_credentials(*tls))
  except RuntimeError as e:  # Newer gRPC raises where older returned 0.
    raise BindError(f"Could not bind the syncer to {address} (port in use?): {e}") from None
  if bound == 0:
    raise BindError(f"Could not bind the syncer to {address} (port in use?).")
  if bulk_port is None:  # A fixed port is shard 0's; shard i takes the i-th after it.
    bulk_port = cfg.bulk_port and cfg.bulk_port + service.shard
  try:
    bulk = BulkServer(
      service, data_handlers(service), host=host or "0.0.0.0", port=bulk_port, token=token, tls=tls
    )
  except OSError as e:
    server.stop(None)
    raise BindError(
      f"Could not bind the syncer's bulk port {host}:{bulk_port} (in use?): {e}"
    ) from None
  service.advertise_bulk(advertise_bulk_port or bulk.port)
  service.count_door(bulk.door_counters)
  log.info("pushes and pulls served on bulk port %d", bulk.port)
  service.start()
  server.start()
  for name in ("", SERVICE_NAME):
    health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
  return SyncerServer(server=server, service=service, port=bound, health=health_servicer, bulk=bulk)


@dataclasses.dataclass
class InProcessSyncer:
  """A syncer service reachable without a socket: `SyncerClient(channel=syncer.channel())`."""

  server: in_process.InProcessServer
  service: SyncerService

  def channel(self) -> in_process.InProcessChannel:
    """A new channel to the service, one per client."""
    return self.server.channel()

  def stop(self, *, flush: bool = True) -> None:
    self.server.stop()
    self.service.stop(flush=flush)


def serve_in_process(
  service: SyncerService, *, token: str | None = None, start: bool = True
) -> InProcessSyncer:
  """Starts `service`'s merge thread and serves it over the in-process transport.

  The calls run the same handlers (`method_handlers`, `data_handlers` and the standard health
  service) and, with a token, the same authentication interceptor as `serve`: the same bytes,
  checks and status codes, without a port.

  Args:
    service: the servicer.
    token: shared token required on every call (None: no authentication).
    start: start the merge thread; False leaves the caller to `service.advance()` it (a service
      on a virtual clock: service/virtual.py).
  """
  name, handlers = method_handlers(service)
  paths = {f"/{name}/{method}": h for method, h in handlers.items()} | data_handlers(service)
  health_servicer = health.HealthServicer()
  collected = _Handlers()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, collected)
  paths |= {f"/{collected.service_name}/{m}": h for m, h in collected.handlers.items()}
  interceptors = [auth.TokenInterceptor(token, service.count_refusal)] if token else []
  server = in_process.InProcessServer(paths, interceptors=interceptors)
  if start:
    service.start()
  for health_name in ("", SERVICE_NAME):
    health_servicer.set(health_name, health_pb2.HealthCheckResponse.SERVING)
  return InProcessSyncer(server=server, service=service)
