"""A real syncer and ONE learner formed by two processes (multi-host learners on CPU).

Each learner process has 2 fake CPU devices; `jax.distributed` joins them (gloo collectives) into one
learner whose mesh spans the 4 devices. Process 0 talks to the syncer, process 1 follows its applies.
Checks: merges happen, every apply holds the syncer's bits (on both processes), both processes end
with bit-identical parameters and identical losses, the global model learned, and no process is left
(each test kills its process groups in a `finally`). The second test SIGKILLs one process of a
checkpointing learner and restarts both: they resume from the same checkpoint. The third runs
ddiloco-local with 2 learners of 2 processes each.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ddiloco.testing import runs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GIN = runs.config_path("local_tiny.gin")
STEPS = 40
BINDINGS = [
  "LEARNERS = 1",
  f"STEPS = {STEPS}",
  "RunConfig.eval_every_s = 0.0",
  "RunConfig.eval_batches = 2",
  "InnerOptConfig.warmup_steps = 4",
  # 8 fragments every 8 steps: each is sent 5 times in 40 steps (fewer compiles than 24).
  "FragmentSchedule.num_fragments = 8",
  "FragmentSchedule.period = 8",
]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(module, args, *, devices, log_path):
  env = dict(os.environ)
  env.update(
    DDILOCO_TOKEN="multiprocess-test",
    JAX_PLATFORMS="cpu",
    PYTHONUNBUFFERED="1",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
  )
  # A restarted learner compiles nothing again (as under ddiloco-local).
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(log_path.parent / "jax_cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  gin = [f"--gin_file={GIN}", f"--gin_search_paths={os.path.join(ROOT, 'gin_configs')}"]
  gin += [f"--gin_bindings={b}" for b in BINDINGS]
  with open(log_path, "w") as log:
    return subprocess.Popen(
      [sys.executable, "-m", module, *args, *gin],
      stdout=log,
      stderr=subprocess.STDOUT,
      env=env,
      cwd=ROOT,
      start_new_session=True,  # Its own process group: killpg reaches its children too.
    )


def _tail(path, lines=40):
  with open(path) as f:
    return "".join(f.readlines()[-lines:])


def _wait(proc, log_path, timeout_s):
  try:
    return proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{proc.args[2]} did not finish in {timeout_s} s:\n{_tail(log_path)}")


def _read(path):
  with open(path) as f:
    return json.load(f)


def test_two_processes_form_one_learner(tmp_path):
  procs = []
  try:
    syncer, syncer_log, address = _start_syncer(tmp_path, procs)
    workdir = tmp_path / "learner_0"
    learners, logs = _start_learner(tmp_path, address, workdir, 0)
    procs += learners
    for proc, log in zip(learners, logs):
      assert _wait(proc, log, 300) == 0, _tail(log)
    syncer.send_signal(signal.SIGTERM)
    assert _wait(syncer, syncer_log, 120) == 0, _tail(syncer_log)
  finally:
    _reap(procs)
  for proc in procs:  # Nothing left in any process group (grandchildren included).
    with pytest.raises(ProcessLookupError):
      os.killpg(proc.pid, 0)

  lead = _read(workdir / "summary.json")
  follow = _read(workdir / "process_1" / "summary.json")
  syncer_summary = _read(tmp_path / "syncer" / "summary.json")
  assert (lead["process_index"], follow["process_index"]) == (0, 1)
  assert lead["num_processes"] == follow["num_processes"] == 2
  assert lead["steps"] == follow["steps"] == STEPS
  # The learner's batch is the job's (8 sequences of 64 tokens), not one process's rows.
  assert lead["tokens"] == follow["tokens"] == STEPS * 8 * 64
  # One learner of 4 devices took part in the merges, and the merges reached it.
  assert syncer_summary["merges"] > 0
  assert lead["applies"], "no merged fragment was applied"
  # Both processes applied the same versions at the same steps, and hold the syncer's bits.
  assert follow["applies"] == lead["applies"]
  assert lead["digest_mismatches"] == follow["digest_mismatches"] == 0
  published = syncer_summary["digests"]
  for p, version, digest in lead["applies"]:
    assert published[f"{p}:{version}"] == digest
  # Bit-identical replicas: identical parameters and identical losses at every logged step.
  assert lead["params_digest"] and lead["params_digest"] == follow["params_digest"]
  assert [loss[::2] for loss in lead["losses"]] == [loss[::2] for loss in follow["losses"]]
  # Only process 0 talked to the syncer.
  assert lead["bytes_up"] > 0 and lead["bytes_down"] > 0
  assert follow["bytes_up"] == follow["bytes_down"] == 0
  assert sum(lead["push_status"].values()) > 0
  # It learned: the learner's loss and the global model's held-out loss fell.
  assert lead["losses"][-1][2] < lead["losses"][0][2]
  assert syncer_summary["final_eval_loss"] < syncer_summary["initial_eval_loss"]


def _reap(procs) -> None:
  """Kills (process group included) and waits for every process still running."""
  for proc in procs:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _start_syncer(tmp_path, procs):
  port_file = tmp_path / "port"
  log = tmp_path / "syncer.log"
  syncer = _spawn(
    "ddiloco.launch.syncer_main",
    [f"--workdir={tmp_path / 'syncer'}", f"--port_file={port_file}"],
    devices=1,
    log_path=log,
  )
  procs.append(syncer)
  deadline = time.monotonic() + 180
  while not port_file.exists():
    assert syncer.poll() is None, _tail(log)
    assert time.monotonic() < deadline, _tail(log)
    time.sleep(0.2)
  return syncer, log, f"127.0.0.1:{port_file.read_text()}"


def _start_learner(tmp_path, address, workdir, run, extra=()):
  coordinator = f"127.0.0.1:{_free_port()}"  # A fresh port per start: the old one may linger.
  logs = [tmp_path / f"learner_0.run{run}.{i}.log" for i in range(2)]
  common = [
    "--learner_id=0",
    f"--syncer_address={address}",
    f"--workdir={workdir}",
    "--num_processes=2",
    f"--coordinator_address={coordinator}",
    *extra,
  ]
  procs = [
    _spawn("ddiloco.launch.learner_main", [*common, f"--process_id={i}"], devices=2, log_path=log)
    for i, log in enumerate(logs)
  ]
  return procs, logs


def _committed_steps(folder):
  if not folder.is_dir():
    return []
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


SAVE_EVERY = 8


def test_killed_process_restarts_the_learner_from_its_checkpoint(tmp_path):
  procs = []
  workdir = tmp_path / "learner_0"
  ckpt = ["--gin_bindings=LearnerCheckpointConfig.save_every_steps = 8"]
  try:
    syncer, syncer_log, address = _start_syncer(tmp_path, procs)
    first, logs = _start_learner(tmp_path, address, workdir, 0, ckpt)
    procs += first
    deadline = time.monotonic() + 240
    while not _committed_steps(workdir / "checkpoints"):  # Steps 8, 16, ... of 40.
      assert all(p.poll() is None for p in first), _tail(logs[0]) + _tail(logs[1])
      assert time.monotonic() < deadline, _tail(logs[0])
      time.sleep(0.1)
    os.killpg(first[1].pid, signal.SIGKILL)  # A crash of one host of the slice.
    first[1].wait(timeout=30)
    # Process 0 would wait in its next collective for the dead peer: the launcher kills the unit.
    if first[0].poll() is None:
      os.killpg(first[0].pid, signal.SIGKILL)
    first[0].wait(timeout=30)
    saved = _committed_steps(workdir / "checkpoints")
    assert saved and saved[-1] < STEPS and saved[-1] % SAVE_EVERY == 0
    second, logs = _start_learner(tmp_path, address, workdir, 1, ckpt)
    procs += second
    for proc, log in zip(second, logs):
      assert _wait(proc, log, 300) == 0, _tail(log)
    syncer.send_signal(signal.SIGTERM)
    assert _wait(syncer, syncer_log, 120) == 0, _tail(syncer_log)
  finally:
    _reap(procs)
  for proc in procs:
    with pytest.raises(ProcessLookupError):
      os.killpg(proc.pid, 0)

  lead = _read(workdir / "summary.json")
  follow = _read(workdir / "process_1" / "summary.json")
  syncer_summary = _read(tmp_path / "syncer" / "summary.json")
  # Both processes restored the newest step committed before the kill (a commit needs every
  # process), from the one checkpoint folder of the learner.
  resumed = lead["resumed_step"]
  assert resumed == saved[-1]
  assert lead["restored_from"] == follow["restored_from"] == f"own:{resumed}"
  assert follow["resumed_step"] == resumed
  assert lead["steps"] == follow["steps"] == STEPS
  # Tokens count from the checkpoint's (the whole run's batches, once each).
  assert lead["tokens"] == follow["tokens"] == STEPS * 8 * 64
  # The restarted run saved again at the same steps on both processes, ending with the last.
  assert lead["checkpoint_steps"] == follow["checkpoint_steps"]
  assert lead["checkpoint_steps"][-1] == STEPS
  assert _committed_steps(workdir / "checkpoints")[-1] == STEPS
  assert not (workdir / "process_1" / "checkpoints").exists()  # One folder for the learner.
  # Bit-identical replicas after the restart, holding the syncer's bits.
  assert lead["params_digest"] and lead["params_digest"] == follow["params_digest"]
  assert [loss[::2] for loss in lead["losses"]] == [loss[::2] for loss in follow["losses"]]
  assert lead["losses"][0][0] > resumed  # The restarted run logged only steps after the restore.
  assert lead["applies"] and follow["applies"] == lead["applies"]
  assert lead["digest_mismatches"] == follow["digest_mismatches"] == 0
  published = syncer_summary["digests"]
  for p, version, digest in lead["applies"]:
    assert published[f"{p}:{version}"] == digest
  # Each process's data position is in the checkpoint, and each process resumed from its own: the
  # last checkpoint's positions are STEPS batches in, not STEPS - resumed (a restart at index 0).
  with open(workdir / "checkpoints" / str(STEPS) / "learner" / "metadata") as f:
    state = json.load(f)
  assert state["step"] == STEPS and state["num_processes"] == 2
  assert [d["next_index"] for d in state["data_per_process"]] == [STEPS, STEPS]
  assert state["data"] == state["data_per_process"][0]


LOCAL_STEPS = 24


def test_ddiloco_local_runs_two_learners_of_two_processes(tmp_path):
  workdir = tmp_path / "run"
  bindings = [
    "LEARNERS = 2",
    f"STEPS = {LOCAL_STEPS}",
    *BINDINGS[2:],
  ]
  cmd = [
    sys.executable,
    "-m",
    "ddiloco.launch.local",
    f"--gin_file={GIN}",
    f"--gin_search_paths={os.path.join(ROOT, 'gin_configs')}",
    *[f"--gin_bindings={b}" for b in bindings],
    f"--workdir={workdir}",
    "--gin.JobConfig.processes_per_learner=2",
    "--progress_every_s=5",
    "--timeout_s=240",
  ]
  log_path = tmp_path / "local.log"
  with open(log_path, "w") as log:
    launcher = subprocess.Popen(
      cmd,
      stdout=log,
      stderr=subprocess.STDOUT,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"},
      cwd=ROOT,
      start_new_session=True,
    )
  try:
    assert _wait(launcher, log_path, 300) == 0, _tail(log_path)
  finally:
    if launcher.poll() is None:
      launcher.send_signal(signal.SIGINT)  # The launcher stops its children.
      try:
        launcher.wait(timeout=60)
      except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    leftovers = runs.processes_mentioning(str(workdir))
    for pid in leftovers:
      os.kill(pid, signal.SIGKILL)
  assert leftovers == [], "processes left behind"

  summary = _read(workdir / "summary.json")
  # summary.json counts learners (each one unit of two processes), not processes.
  assert set(summary["learners"]) == {"0", "1"}
  assert summary["merges"] > 0
  assert summary["digests_agree"] is True and summary["digest_checks"] > 0
  assert summary["tokens_trained"] == 2 * LOCAL_STEPS * 8 * 64
  syncer = _read(workdir / "syncer" / "summary.json")
  for i in (0, 1):
    lead = _read(workdir / f"learner_{i}" / "summary.json")
    follow = _read(workdir / f"learner_{i}" / "process_1" / "summary.json")
    assert lead["num_processes"] == follow["num_processes"] == 2
    assert lead["steps"] == follow["steps"] == LOCAL_STEPS
    assert summary["learners"][str(i)]["steps"] == LOCAL_STEPS
    assert lead["applies"] and follow["applies"] == lead["applies"]
    for p, version, digest in lead["applies"]:
      assert syncer["digests"][f"{p}:{version}"] == digest
    assert lead["params_digest"] == follow["params_digest"]
    assert follow["bytes_up"] == 0  # Only process 0 of each learner talks to the syncer.
  # The progress lines name learners L0 and L1, never a process.
  lines = [ln for ln in _tail(log_path, 10_000).splitlines() if ln.startswith("t=")]
  assert lines and all("L2" not in ln for ln in lines)
