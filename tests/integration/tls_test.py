"""A run whose syncer serves TLS (`ddiloco-local --tls_cert_file ... --tls_key_file ...`): the
learners and the launcher trust the CA and train; a plaintext client is turned away."""

import shutil

import grpc
import pytest

from ddiloco.launch import local_cluster
from ddiloco.testing import runs
from ddiloco.transport.client import SyncerClient

GIN = runs.config_path("local_tiny.gin")
FAST = runs.quick(steps=32)

pytestmark = [
  pytest.mark.integration,
  pytest.mark.timeout(300),
  pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def test_a_tls_run_trains_and_refuses_plaintext(tmp_path):
  cert, key = runs.self_signed_certificate(str(tmp_path), san="IP:127.0.0.1")
  cluster = local_cluster.LocalCluster(
    workdir=str(tmp_path / "run"),
    gin_args=runs.gin_args(GIN, FAST),
    num_learners=2,
    tls=(cert, key, cert),
  )
  refused = []

  def probe(line):
    if cluster.port is not None and not refused:
      plain = SyncerClient(f"127.0.0.1:{cluster.port}", token=cluster.token, deadline_s=3.0)
      try:
        plain.status()
        refused.append(None)
      except grpc.RpcError as e:
        refused.append(e.code())
      finally:
        plain.close()

  try:
    summary = cluster.run(runs.parse_job(GIN, FAST), timeout_s=240, progress=probe)
  finally:
    cluster.stop_all()
  runs.assert_all_gone(cluster)
  assert refused == [grpc.StatusCode.UNAVAILABLE]
  assert summary["ok"] is True and summary["merges"] > 0 and summary["digests_agree"] is True


def test_tls_files_must_exist(tmp_path):
  with pytest.raises(ValueError, match="missing"):
    local_cluster.LocalCluster(
      workdir=str(tmp_path), gin_args=[], num_learners=1, tls=("a.pem", "b.pem", "a.pem")
    )
