"""Shared-token authentication and TLS credentials for the syncer service (docs/architecture.md).

Every call except the standard health service must carry the metadata `authorization: Bearer <token>`.
The token comes from a file (`--auth_token_file`) or the `DDILOCO_TOKEN` environment variable; a
missing or wrong token is refused with UNAUTHENTICATED before any servicer code runs. TLS is optional
(`--tls_cert_file`/`--tls_key_file` on the server, `--tls_ca_file` on learners); without it the token
travels in clear text, which is why the server binds to loopback unless told otherwise.
"""

import hmac
import os
from collections.abc import Callable

import grpc

TOKEN_ENV = "DDILOCO_TOKEN"
AUTH_METADATA_KEY = "authorization"
# A learner's session credential, issued by Register (RegisterResponse.session) and sent on every
# later call for that learner id: the shared token admits a caller, the session binds it to one id.
SESSION_METADATA_KEY = "ddiloco-session"
# Health checks stay open so that load balancers and launchers can probe without the secret.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def read_token(token_file: str | None = None, *, env: str = TOKEN_ENV) -> str | None:
  """The shared token: the file's stripped contents if given, else the environment variable.

  Returns None when neither is set (authentication off).

  Raises:
    ValueError: if the file is empty.
  """
  if token_file:
    with open(token_file) as f:
      token = f.read().strip()
    if not token:
      raise ValueError(f"Token file {token_file} is empty.")
    return token
  return os.environ.get(env) or None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
  """Call metadata carrying the token (empty without one)."""
  return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


def session_metadata(session: str | None) -> tuple[tuple[str, str], ...]:
  """Call metadata carrying a learner's session (empty without one)."""
  return ((SESSION_METADATA_KEY, session),) if session else ()


def _aborting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
  """A handler of the same streaming kind as `handler` that fails every call with `code`."""

  def abort(request_or_iterator, context):
    context.abort(code, message)

  if handler.request_streaming and handler.response_streaming:
    make = grpc.stream_stream_rpc_method_handler
  elif handler.request_streaming:
    make = grpc.stream_unary_rpc_method_handler
  elif handler.response_streaming:
    make = grpc.unary_stream_rpc_method_handler
  else:
    make = grpc.unary_unary_rpc_method_handler
  return make(
    abort,
    request_deserializer=handler.request_deserializer,
    response_serializer=handler.response_serializer,
  )


class TokenInterceptor(grpc.ServerInterceptor):
  """Refuses calls without the right bearer token (constant-time comparison).

  Args:
    token: the shared secret.
    on_refuse: called with (status code, method) for every refused call (metrics).
  """

  def __init__(self, token: str, on_refuse: Callable[[grpc.StatusCode, str], None] | None = None):
    if not token:
      raise ValueError("TokenInterceptor needs a non-empty token.")
    self._expected = f"Bearer {token}".encode()
    self._on_refuse = on_refuse

  def intercept_service(self, continuation, handler_call_details):
    method = handler_call_details.method
    handler = continuation(handler_call_details)
    if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
      return handler
    values = [
      v for k, v in handler_call_details.invocation_metadata or () if k == AUTH_METADATA_KEY
    ]
    if not values:
      message = f"Missing '{AUTH_METADATA_KEY}' metadata: this syncer requires a shared token."
    elif hmac.compare_digest(str(values[0]).encode(), self._expected):
      return handler
    else:
      message = "Wrong shared token."
    if self._on_refuse is not None:
      self._on_refuse(grpc.StatusCode.UNAUTHENTICATED, method)
    return _aborting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
  """TLS credentials from a PEM certificate chain and private key."""
  with open(key_file, "rb") as f:
    key = f.read()
  with open(cert_file, "rb") as f:
    cert = f.read()
  return grpc.ssl_server_credentials([(key, cert)])


def channel_credentials(ca_file: str | None) -> grpc.ChannelCredentials:
  """TLS credentials trusting `ca_file` (PEM), or the system roots when None."""
  if ca_file is None:
    return grpc.ssl_channel_credentials()
  with open(ca_file, "rb") as f:
    return grpc.ssl_channel_credentials(root_certificates=f.read())
