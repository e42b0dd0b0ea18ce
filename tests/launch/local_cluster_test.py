"""LocalCluster's multi-process learners without JAX: command lines, and the unit-kill logic.

The unit tests use `sleep`/`sh` children (each in its own session, as the launcher starts them), so
the kills are real and fast. tests/integration/multiprocess_learner_test.py runs real learners.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from ddiloco.launch import elastic, local_cluster, processes

pytestmark = pytest.mark.timeout(60)


def _cluster(tmp_path, processes=2, devices=2):
  cluster = local_cluster.LocalCluster(
    workdir=str(tmp_path),
    gin_args=["--gin_file=/cfg/run.gin"],
    num_learners=2,
    devices_per_learner=devices,
    python="/usr/bin/python3",
    extra_learner_args=["--gin_bindings=RunConfig.steps_per_learner = 7"],
    processes_per_learner=processes,
  )
  cluster.port = 4321  # As if the syncer served.
  return cluster


def _sleeper(code: str = "sleep 60") -> subprocess.Popen:
  # `exec`: no grandchild, whose zombie this container's init may never reap (killpg(pid, 0) would
  # still find it).
  return subprocess.Popen(
    ["sh", "-c", f"exec {code}" if code.startswith("sleep") else code], start_new_session=True
  )


def _unit(procs, tmp_path, **kwargs):
  logs = [str(tmp_path / f"p{i}.log") for i in range(len(procs))]
  return processes.ProcessUnit(procs, log_paths=logs, **kwargs)


def _gone(proc: subprocess.Popen) -> bool:
  try:
    os.killpg(proc.pid, 0)
  except ProcessLookupError:
    return True
  return False


# -- command lines ---------------------------------------------------------------------------------


def test_one_process_learner_keeps_its_command_line(tmp_path):
  (launch,) = _cluster(tmp_path, processes=1).learner_launches(3, extra_args=["--x=1"])
  folder = os.path.join(str(tmp_path), "learner_3")
  assert launch.argv == [
    "-m",
    "ddiloco.launch.learner_main",
    f"--workdir={folder}",
    "--learner_id=3",
    "--syncer_address=127.0.0.1:4321",
    "--gin_file=/cfg/run.gin",
    "--gin_bindings=RunConfig.steps_per_learner = 7",
    "--x=1",
  ]
  assert launch.log_path == os.path.join(folder, "log.txt")
  assert "--xla_force_host_platform_device_count=2" in launch.env["XLA_FLAGS"].split()


@pytest.mark.integration
def test_two_process_learner_launches_two_slice_members(tmp_path):
  cluster = _cluster(tmp_path, processes=2, devices=3)
  launches = cluster.learner_launches(1, extra_args=["--x=1"], address="127.0.0.1:999")
  folder = os.path.join(str(tmp_path), "learner_1")
  assert [launch.log_path for launch in launches] == [
    os.path.join(folder, "log.txt"),
    os.path.join(folder, "process_1", "log.txt"),  # Where learner_main writes process 1's files.
  ]
  coordinators = set()
  for i, launch in enumerate(launches):
    argv = launch.argv
    # The same learner: same workdir (learner_main adds process_<i>), id, syncer and flags ...
    assert argv[:5] == [
      "-m",
      "ddiloco.launch.learner_main",
      f"--workdir={folder}",
      "--learner_id=1",
      "--syncer_address=127.0.0.1:999",
    ]
    assert "--num_processes=2" in argv and f"--process_id={i}" in argv
    # ... and the per-learner flags last, so their gin bindings win.
    assert argv[-3:] == [
      "--gin_file=/cfg/run.gin",
      "--gin_bindings=RunConfig.steps_per_learner = 7",
      "--x=1",
    ]
    coordinators |= {a for a in argv if a.startswith("--coordinator_address=127.0.0.1:")}
    # Each process has its own devices_per_learner fake CPU devices (a 6-device mesh in all).
    assert "--xla_force_host_platform_device_count=3" in launch.env["XLA_FLAGS"].split()
    assert launch.env["DDILOCO_TOKEN"] == cluster.token
  assert len(coordinators) == 1  # Both join process 0's coordinator.
  again = cluster.learner_launches(1)
  assert {a for a in again[0].argv if a.startswith("--coordinator")} != coordinators  # New port.


def test_batch_must_split_over_every_process_device(tmp_path):
  cluster = _cluster(tmp_path, processes=2, devices=2)
  with pytest.raises(ValueError, match=r"does not split over 4 devices \(2 processes x 2\)"):
    cluster.add_learner(batch_size=6)  # 6 splits over one process's 2 devices, not over 4.
  assert cluster.learners == {}


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_processes_per_learner_is_validated(tmp_path, bad):
  with pytest.raises(ValueError, match="processes_per_learner must be an integer >= 1"):
    _cluster(tmp_path, processes=bad)


# -- the unit --------------------------------------------------------------------------------------


@pytest.mark.integration
def test_killed_process_takes_the_whole_unit_down(tmp_path):
  procs = [_sleeper(), _sleeper(), _sleeper()]
  unit = _unit(procs, tmp_path)
  try:
    assert unit.poll() is None and unit.returncode is None
    os.killpg(procs[1].pid, signal.SIGKILL)  # One host of the slice crashes.
    assert unit.wait(timeout=20) == -signal.SIGKILL
    assert unit.first_exit == 1 and unit.killed_rest
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3
    assert all(_gone(p) for p in procs)
  finally:
    for p in procs:
      p.kill()
      p.wait()


@pytest.mark.integration
def test_failed_process_code_is_the_units(tmp_path):
  procs = [_sleeper(), _sleeper("exit 3")]
  unit = _unit(procs, tmp_path)
  try:
    assert unit.wait(timeout=20) == 3  # The cause, not the SIGKILL of process 0 that followed.
    assert procs[0].returncode == -signal.SIGKILL
  finally:
    for p in procs:
      p.kill()
      p.wait()


@pytest.mark.integration
def test_clean_exit_waits_for_the_others_then_kills_stragglers(tmp_path):
  procs = [_sleeper("exit 0"), _sleeper("sleep 0.5")]
  unit = _unit(procs, tmp_path, exit_grace_s=20.0)
  assert unit.wait(timeout=20) == 0  # Process 1 finished within the grace: a clean exit.
  assert not unit.killed_rest
  procs = [_sleeper("exit 0"), _sleeper()]
  unit = _unit(procs, tmp_path, exit_grace_s=0.3)
  try:
    procs[0].wait()
    t = time.monotonic()
    assert unit.poll() is None  # Within the grace: process 1 may still be writing its summary.
    assert unit.wait(timeout=20) == -signal.SIGKILL  # Past it: hung, killed, not a clean exit.
    assert time.monotonic() - t >= 0.25 and unit.killed_rest
  finally:
    for p in procs:
      p.kill()
      p.wait()


@pytest.mark.integration
def test_cluster_signals_kill_and_reap_every_process_of_a_learner(tmp_path):
  cluster = _cluster(tmp_path)
  procs = [_sleeper(), _sleeper()]
  child = processes.Child("learner_0", _unit(procs, tmp_path), "log", "metrics")
  cluster.learners[0] = child
  try:
    cluster.signal(child, signal.SIGSTOP)  # Chaos pauses the learner: every process.
    deadline = time.monotonic() + 10
    while not all(_state(p.pid) == "T" for p in procs):
      assert time.monotonic() < deadline
      time.sleep(0.02)
    assert cluster.kill(child) == -signal.SIGKILL  # Chaos kills it: every process, even stopped.
    assert all(_gone(p) for p in procs)
  finally:
    for p in procs:
      p.kill()
      p.wait()


def _state(pid: int) -> str:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.integration
def test_check_fleet_reports_a_dead_process_as_the_learners_failure(tmp_path):
  cluster = _cluster(tmp_path)
  procs = [_sleeper(), _sleeper()]
  log0, log1 = tmp_path / "p0.log", tmp_path / "p1.log"
  log0.write_text("leader waiting\n")
  log1.write_text("follower: Segmentation fault\n")
  unit = processes.ProcessUnit(procs, log_paths=[str(log0), str(log1)])
  cluster.learners[0] = processes.Child("learner_0", unit, str(log0), "metrics")
  cluster.fleet.members[0] = elastic.FleetMember(
    learner_id=0, devices=2, batch_size=None, steps=None, elastic=False, started=0.0
  )
  try:
    assert cluster.check_fleet() is False  # Both run.
    os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].wait()
    with pytest.raises(RuntimeError, match="learner 0 exited with -9") as e:
      cluster.check_fleet()
    assert "Segmentation fault" in str(e.value)  # The log of the process that died first.
    assert procs[0].returncode == -signal.SIGKILL  # Killed by the unit, not left waiting.
  finally:
    for p in procs:
      p.kill()
      p.wait()


# -- real starts of fake learners, and the chaos driver's kill and restart -------------------------


def _fake_python(tmp_path) -> str:
  """An 'interpreter' that ignores the learner's command line and sleeps: a learner that runs."""
  path = tmp_path / "fake_python"
  path.write_text("#!/bin/sh\nexec sleep 60\n")
  path.chmod(0o755)
  return str(path)


@pytest.mark.integration
def test_chaos_kills_and_restarts_every_process_of_a_learner(tmp_path):
  from ddiloco.chaos.driver import ChaosRun
  from ddiloco.chaos.tape import TapeWriter
  from ddiloco.faults import FaultEvent
  from ddiloco.faults.schedule import ChaosConfig

  cluster = _cluster(tmp_path, processes=2)
  cluster.backend.python = _fake_python(tmp_path)
  run = ChaosRun(None, ChaosConfig(), cluster)  # The job is not read by execute.
  run.proxies = type("Proxies", (), {"address": "127.0.0.1:9"})()
  tape = run._tape = TapeWriter(tmp_path / "tape.jsonl")
  first = []
  try:
    child = cluster.start_learner(0)
    first = list(child.proc.procs)
    assert len(first) == 2 and child.proc.poll() is None
    assert os.path.exists(tmp_path / "learner_0" / "process_1" / "log.txt")
    run.execute(FaultEvent(t=1.0, kind="kill_learner", learner=0))
    assert [p.returncode for p in first] == [-signal.SIGKILL] * 2
    assert all(_gone(p) for p in first)
    run.execute(FaultEvent(t=2.0, kind="start_learner", learner=0))
    again = cluster.learners[0].proc
    assert isinstance(again, processes.ProcessUnit) and len(again.procs) == 2
    assert again.poll() is None and not set(again.procs) & set(first)
  finally:
    tape.close()
    cluster.stop_all(grace_s=5)
  assert all(_gone(p) for p in cluster.learners[0].proc.procs)


def _slow_syncer_python(tmp_path, ready_after_s: float) -> str:
  """An 'interpreter' whose syncer serves (writes its port file) only after `ready_after_s`, as a
  real one restoring a checkpoint and compiling does; learners just sleep."""
  path = tmp_path / "fake_python"
  path.write_text(
    "#!/bin/sh\n"
    'for a in "$@"; do case $a in --port_file=*) f=${a#--port_file=};; esac; done\n'
    f'if [ -n "$f" ]; then sleep {ready_after_s}; echo 4321 > "$f"; fi\n'
    "exec sleep 60\n"
  )
  path.chmod(0o755)
  return str(path)


@pytest.mark.integration
def test_chaos_schedule_goes_on_while_the_syncer_restarts(tmp_path):
  """A syncer restart is not waited for: the next fault fires on time, and syncer_up is recorded
  once the new syncer serves."""
  from ddiloco.chaos.driver import ChaosRun
  from ddiloco.chaos.tape import TapeWriter, read_tape
  from ddiloco.faults import FaultEvent
  from ddiloco.faults.schedule import ChaosConfig

  cluster = _cluster(tmp_path, processes=1)
  cluster.backend.python = _slow_syncer_python(tmp_path, ready_after_s=3.0)
  run = ChaosRun(None, ChaosConfig(), cluster)
  run.proxies = type("Proxies", (), {"address": "127.0.0.1:9"})()
  tape = run._tape = TapeWriter(tmp_path / "tape.jsonl")
  try:
    cluster.spawn_syncer(port=4321)  # The syncer that the schedule kills.
    cluster.start_learner(0)
    now = tape.now()
    run.execute(FaultEvent(t=now, kind="kill_syncer"))
    run.execute(FaultEvent(t=now, kind="start_syncer"))
    run.execute(FaultEvent(t=now, kind="kill_learner", learner=0))
    assert tape.now() - now < 1.0  # Nothing waited for the syncer.
    run._observe(tape)
    assert run._starting == {0}
    deadline = time.monotonic() + 30
    while run._starting and time.monotonic() < deadline:
      run._observe(tape)
      time.sleep(0.05)
    assert not run._starting and not run._down
  finally:
    tape.close()
    cluster.stop_all(grace_s=5)
  records = read_tape(str(tmp_path / "tape.jsonl"))
  kinds = [r["kind"] for r in records]
  assert kinds == [
    "kill_syncer",
    "syncer_down",
    "start_syncer",
    "kill_learner",
    "learner_down",
    "syncer_up",
  ]
  assert all(r["late_s"] < 1.0 for r in records if "scheduled_t" in r)
  up = records[-1]["t"] - records[2]["t"]
  assert up >= 2.5  # The syncer took its 3 s; the kill of learner 0 did not wait for it.


# -- progress lines ----------------------------------------------------------------------------


class _FakeProc:
  def __init__(self, rc=None):
    self.rc, self.pid = rc, 1

  def poll(self):
    return self.rc


class _FakeStatus:
  versions, merges, quorum_histogram, alive = [3, 4], 7, [0, 4, 3], [0, 1]


class _FakeClient:
  def status(self):
    return _FakeStatus()


def _child(tmp_path, name, rc, *events):
  path = tmp_path / f"{name}.jsonl"
  path.write_text("".join(json.dumps({"kind": "train", **e}) + "\n" for e in events))
  return processes.Child(name, _FakeProc(rc), str(tmp_path / "log"), str(path))


def _progress_cluster(tmp_path, *children):
  from ddiloco.data.text import TextDataConfig
  from ddiloco.launch.job import JobConfig
  from ddiloco.models import configs
  from ddiloco.run_config import RunConfig

  cluster = _cluster(tmp_path, processes=1)
  cluster.fleet.job = JobConfig(
    run=RunConfig(
      model=configs.transformer_config("tiny", max_len=64),
      data=TextDataConfig(seq_len=64, batch_size=8),
      num_learners=len(children),
      steps_per_learner=100,
    )
  )
  cluster.learners.update(enumerate(children))  # The dict the fleet shares: filled, not rebound.
  return cluster


def test_progress_line_shows_rates_and_eta_once_every_learner_has_a_step_time(tmp_path):
  cluster = _progress_cluster(
    tmp_path,
    _child(tmp_path, "a", None, {"step": 40, "loss": 2.5, "step_time_s": 0.5}),
    _child(tmp_path, "b", None, {"step": 80, "loss": 2.25, "step_time_s": 0.25}),
  )
  line = cluster.progress_line(_FakeClient(), time.time())
  # 2 + 4 steps/s, x 512 tokens; learner 0 has the most left: 60 steps x 0.5 s.
  assert "| 6 steps/s 3.07k tok/s eta 30s |" in line
  assert line.endswith("L0:up step 40 loss 2.500 L1:up step 80 loss 2.250")
  assert "merges    7 quorum 1.43 alive [0, 1]" in line


def test_progress_line_before_the_first_loss_and_after_a_crash(tmp_path):
  cluster = _progress_cluster(
    tmp_path,
    _child(tmp_path, "a", None),  # No train event yet.
    _child(tmp_path, "b", None, {"step": 8, "loss": 3.0, "step_time_s": 0.0}),  # Compiling.
    _child(tmp_path, "c", 1, {"step": 8, "loss": 3.5, "step_time_s": 0.2}),
  )
  line = cluster.progress_line(_FakeClient(), time.time())
  assert "nan" not in line
  assert "| - steps/s - tok/s eta - |" in line
  assert line.endswith("L0:up starting L1:up step 8 loss 3.000 L2:down step 8 loss 3.500")
