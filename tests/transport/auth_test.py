"""Shared token, TLS and the open health check of the syncer service (transport/auth.py)."""

import shutil

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.service.server import make_syncer, serve
from ddiloco.service.service_config import ServiceConfig
from ddiloco.syncer.core import SyncerConfig
from ddiloco.testing import runs
from ddiloco.transport import auth
from ddiloco.transport.client import SyncerClient

pytestmark = pytest.mark.timeout(60)


def _service():
  init = {"w": np.arange(8, dtype=np.float32)}
  return make_syncer(
    fragment_keys=[["w"]],
    init_values=init,
    syncer_config=SyncerConfig(),
    service_config=ServiceConfig(),
    layout_digest="L",
  )


def test_read_token_prefers_the_file_and_rejects_an_empty_one(tmp_path, monkeypatch):
  monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
  assert auth.read_token() == "from-env"
  path = tmp_path / "token"
  path.write_text("  from-file\n")
  assert auth.read_token(str(path)) == "from-file"
  path.write_text("\n")
  with pytest.raises(ValueError, match="empty"):
    auth.read_token(str(path))
  monkeypatch.delenv(auth.TOKEN_ENV)
  assert auth.read_token() is None


def test_token_metadata():
  assert auth.token_metadata(None) == ()
  assert auth.token_metadata("t") == (("authorization", "Bearer t"),)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.integration
def test_tls_with_token(tmp_path):
  """A self-signed certificate for localhost: a TLS client with the CA and the token gets in; a
  plain-TCP client does not."""
  cert, key = runs.self_signed_certificate(str(tmp_path), san="DNS:localhost")
  server = serve(_service(), address="localhost:0", token="s3cret", tls=(str(cert), str(key)))
  try:
    client = SyncerClient(f"localhost:{server.port}", token="s3cret", tls_ca_file=str(cert))
    assert list(client.status().versions) == [0]
    client.close()
    plain = SyncerClient(f"localhost:{server.port}", token="s3cret", deadline_s=3.0)
    with pytest.raises(grpc.RpcError) as e:
      plain.status()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
  finally:
    server.stop(0.5)


@pytest.mark.integration
def test_health_is_open_and_reports_serving():
  server = serve(_service(), token="s3cret")
  try:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
      stub = health_pb2_grpc.HealthStub(channel)
      for name in ("", "ddiloco.v1.Syncer"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
  finally:
    server.stop(0.5)
