"""Workdirs on an object store (ddiloco/storage.py), against an in-memory `gs://` (no network).

`ddiloco.testing.storage.fake_gcs` registers fsspec's in-memory file system for the gs/gcs
protocols, which is where `etils.epath` sends gs:// paths when TensorFlow is absent. Every test runs in an empty current
folder and checks that nothing named after the URI (a `gs:` folder) appears there.
"""

import json
import os

import pytest
from absl import app
from etils import epath

from ddiloco import storage
from ddiloco.checkpoint.learner import LearnerCheckpointConfig
from ddiloco.launch import cli, local_cluster
from ddiloco.metrics.writer import MetricsWriter, read_events, write_summary
from ddiloco.testing.storage import FakeGcs, fake_gcs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with fake_gcs():
    yield "gs://bucket/run"
  assert os.listdir(tmp_path) == []  # No local junk: no `gs:` folder, no staging left behind.


def _objects():
  return sorted(FakeGcs.store)


def test_paths_keep_their_uri(bucket):
  assert storage.is_remote(bucket) and not storage.is_remote("runs/x")
  assert storage.resolve(bucket) == bucket
  assert storage.resolve("runs/x") == os.path.abspath("runs/x")
  assert storage.join(bucket, "learner_0", "tb") == "gs://bucket/run/learner_0/tb"


def test_make_workdir_writes_the_config_to_the_bucket(bucket):
  assert cli.make_workdir(bucket, "X = 1\n", remote_ok=True) == bucket
  assert epath.Path(bucket, "config.gin").read_text() == "X = 1\n"


def test_commands_that_need_a_file_system_refuse_a_uri_before_writing(bucket):
  with pytest.raises(app.UsageError, match=r"needs a local or mounted folder.*fsyncs"):
    cli.make_workdir(bucket, "X = 1\n", why_local="the syncer fsyncs its journal")
  with pytest.raises(ValueError, match="LocalCluster needs a local or mounted folder"):
    local_cluster.LocalCluster(workdir=bucket, gin_args=[], num_learners=1)
  assert _objects() == []


def test_metrics_are_staged_and_copied_up(bucket):
  writer = MetricsWriter(bucket, sync_every_s=0.0)
  staging = writer._mirror.local
  writer.event("train", step=1, loss=2.0)
  writer.scalars({"loss": 2.0}, tokens=10, step=1)
  writer.flush()
  assert [e["step"] for e in read_events(bucket)] == [1]  # Visible while it runs.
  writer.event("train", step=2, loss=1.5)
  writer.close()
  assert not os.path.exists(staging)
  assert [e["step"] for e in read_events(bucket, "train")] == [1, 2]
  assert writer.tb_dir == f"{bucket}/tb/run_000"
  assert any(o.startswith("/bucket/run/tb/run_000/events.out.tfevents") for o in _objects())
  # A restarted program appends to the same metrics and opens the next TensorBoard run.
  again = MetricsWriter(bucket)
  again.event("train", step=3, loss=1.0)
  again.close()
  assert [e["step"] for e in read_events(bucket)] == [1, 2, 3]
  assert again.tb_dir == f"{bucket}/tb/run_001"


def test_summary_round_trips(bucket):
  path = write_summary(bucket, {"merges": 3, "loss": float("nan")})
  assert path == f"{bucket}/summary.json"
  assert json.loads(epath.Path(path).read_text()) == {"merges": 3, "loss": "nan"}


def test_learner_checkpoints_live_under_the_uri_and_find_their_peers(bucket):
  config = LearnerCheckpointConfig(directory=f"{bucket}/ckpt")
  assert config.learner_directory(1, "ignored") == f"{bucket}/ckpt/learner_1"
  assert LearnerCheckpointConfig().learner_directory(0, bucket) == f"{bucket}/checkpoints"
  for i in (0, 2):
    epath.Path(config.learner_directory(i, "")).joinpath("3", "x").write_text("")
  assert storage.glob(f"{bucket}/ckpt", "learner_*") == [
    f"{bucket}/ckpt/learner_0",
    f"{bucket}/ckpt/learner_2",
  ]


def test_a_simulated_run_writes_everything_to_the_bucket(bucket):
  import ddiloco

  summary = ddiloco.simulate(
    workdir=bucket,
    run=ddiloco.RunConfig(
      model=ddiloco.transformer_config("tiny", max_len=32),
      data=ddiloco.TextDataConfig(seq_len=32, batch_size=4),
      schedule=ddiloco.FragmentSchedule(num_fragments=2, period=2, overlap=0),
      syncer=ddiloco.SyncerConfig(min_quorum=1),
      num_learners=2,
      steps_per_learner=4,
      eval_batches=1,
    ),
  )
  assert summary["merges"] > 0
  assert json.loads(epath.Path(bucket, "summary.json").read_text())["merges"] == summary["merges"]
  assert read_events(bucket, "eval")
  assert any("/tb/run_000/" in o for o in _objects())


@pytest.mark.integration
def test_without_the_gcs_extra_a_bucket_workdir_says_what_to_install(tmp_path):
  import importlib.util
  import subprocess
  import sys

  if importlib.util.find_spec("gcsfs") is not None:
    pytest.skip("gcsfs is installed: the real store would be reached")
  code = "from ddiloco.launch import cli; cli.make_workdir('gs://b/run', 'X = 1', remote_ok=True)"
  proc = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  assert proc.returncode != 0
  assert "gs:// needs gcsfs: pip install 'ddiloco[gcs]'" in proc.stderr
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  ("content", "kept"),
  [
    (b"", b""),
    (b'{"a": 1}\n', b'{"a": 1}\n'),
    (b'{"a": 1}\n{"b"', b'{"a": 1}\n'),
    (b'{"b"', b""),  # Only a partial line: nothing is left of it.
    (b"x\n" + b"y" * (3 * 64 * 1024 + 5), b"x\n"),  # The last newline blocks before the end.
  ],
)
def test_cut_partial_line_keeps_whole_lines_only(tmp_path, content, kept):
  path = tmp_path / "log.jsonl"
  path.write_bytes(content)
  assert storage.cut_partial_line(str(path), fsync=True) == len(content) - len(kept)
  assert path.read_bytes() == kept
  assert storage.cut_partial_line(str(tmp_path / "missing")) == 0
