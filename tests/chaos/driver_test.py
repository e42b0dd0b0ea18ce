"""Tests for chaos/driver.py: its progress line, and its syncer events on a sharded syncer of fake
processes (the driver itself runs in tests/integration)."""

import signal
import time
import types

import pytest

from ddiloco.chaos import driver as chaos
from ddiloco.chaos.tape import TapeWriter, read_tape
from ddiloco.faults import FaultEvent
from ddiloco.faults.schedule import ChaosConfig
from ddiloco.launch import local_cluster, processes


def test_status_line_says_what_the_syncer_and_each_learner_do():
  line = chaos.status_line(12.34, syncer="down", num_learners=4, down={1}, done={3})
  assert line == "t=  12.3s syncer down | learners up [0, 2] down [1] done [3]"
  line = chaos.status_line(0.0, syncer="starting", num_learners=2, down=set(), done={})
  assert "syncer starting" in line and "up [0, 1] down [] done []" in line


# -- a sharded syncer under the chaos driver (fake processes) -------------------------------------


def _fake_python(tmp_path) -> str:
  """An 'interpreter' that logs its command line; a syncer shard serves at once (writes its port
  file), then every process sleeps."""
  path = tmp_path / "fake_python"
  path.write_text(
    "#!/bin/sh\n"
    'echo "$@"\n'
    'for a in "$@"; do case $a in --port_file=*) f=${a#--port_file=};; --port=*) p=${a#--port=};;'
    " esac; done\n"
    'if [ -n "$f" ]; then echo "$p" > "$f"; fi\n'
    "exec sleep 60\n"
  )
  path.chmod(0o755)
  return str(path)


@pytest.mark.timeout(60)
@pytest.mark.integration
def test_a_syncer_event_kills_and_restarts_its_shard_alone(tmp_path):
  cluster = local_cluster.LocalCluster(
    workdir=str(tmp_path), gin_args=[], num_learners=1, python=_fake_python(tmp_path)
  )
  job = types.SimpleNamespace(syncer_shards=2)  # All that `execute` and `_observe` read of it.
  run = chaos.ChaosRun(job, ChaosConfig(), cluster)
  tape = run._tape = TapeWriter(tmp_path / "tape.jsonl")
  try:
    ports = processes.free_ports(4)
    cluster.shard_ports = ports[:2]
    # The proxies, as `run` sets them: the control proxies' addresses, the data proxies' ports.
    cluster.shard_addresses = ["127.0.0.1:9", "127.0.0.1:10"]
    cluster.bulk_ports = [(ports[2], 11), (ports[3], 12)]
    cluster.start_syncers(2, timeout_s=20)
    first = [cluster.syncer_child(s).proc for s in (0, 1)]
    log = (tmp_path / "syncer_1" / "log.txt").read_text()
    # Every shard advertises the proxies, and listens on its own ports.
    assert "--shard_addresses=127.0.0.1:9,127.0.0.1:10" in log
    assert f"--port={cluster.shard_ports[1]}" in log
    bulk = f"--bulk_port={ports[3]} --advertise_bulk_port=12"
    assert bulk in log
    assert run.execute(FaultEvent(tape.now(), "kill_syncer", shard=1))
    assert first[0].poll() is None and first[1].poll() == -signal.SIGKILL
    assert not run.execute(FaultEvent(tape.now(), "kill_syncer", shard=1))  # Down already.
    run._observe(tape)  # Shard 1's exit is ours, not a failure.
    assert run.execute(FaultEvent(tape.now(), "start_syncer", shard=1))
    assert run._starting == {1}
    deadline = time.monotonic() + 20
    while run._starting and time.monotonic() < deadline:
      run._observe(tape)
      time.sleep(0.05)
    assert not run._starting and not run._down
    # Restarted on the same ports: the proxies' upstreams stay.
    assert (tmp_path / "syncer_1" / "log.txt").read_text().count(bulk) == 2
    again = cluster.syncer_child(1).proc
    assert again is not first[1] and cluster.syncer_child(0).proc is first[0]
    with pytest.raises(ValueError, match="has 2 shard"):
      run.execute(FaultEvent(tape.now(), "kill_syncer", shard=2))
    assert run.execute(FaultEvent(tape.now(), "kill_syncer"))  # Every shard.
    assert all(cluster.syncer_child(s).proc.poll() is not None for s in (0, 1))
  finally:
    tape.close()
    cluster.stop_all(grace_s=5)
  records = [(r["kind"], r.get("shard")) for r in read_tape(tmp_path / "tape.jsonl")]
  assert records == [
    ("kill_syncer", 1),
    ("syncer_down", 1),
    ("start_syncer", 1),
    ("syncer_up", 1),
    ("kill_syncer", None),
    ("syncer_down", 0),
    ("syncer_down", 1),
  ]


def test_a_schedule_naming_a_shard_the_syncer_lacks_is_refused(tmp_path):
  cluster = local_cluster.LocalCluster(workdir=str(tmp_path), gin_args=[], num_learners=1)
  config = ChaosConfig(syncer_kill_times_s=(5.0,), syncer_kill_shards=(2,))
  with pytest.raises(ValueError, match="the syncer has 2"):
    chaos.ChaosRun(types.SimpleNamespace(syncer_shards=2), config, cluster)
