"""A real syncer and ONE learner formed by two processes (issue 3: multi-host learners on CPU).

Each learner process has 2 fake CPU devices; `jax.distributed` joins them (gloo collectives) into one
learner whose mesh spans the 4 devices. Process 0 talks to the syncer, process 1 follows its applies.
Checks: merges happen, every apply holds the syncer's bits (on both processes), both processes end
with bit-identical parameters and identical losses, the global model learned, and no process is left
(each test kills its process groups in a `finally`).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GIN = os.path.join(ROOT, "gin_configs", "local_tiny.gin")
STEPS = 40
BINDINGS = [
  "LEARNERS = 1",
  f"STEPS = {STEPS}",
  "JobConfig.eval_every_s = 0.0",
  "JobConfig.eval_batches = 2",
  "InnerOptConfig.warmup_steps = 4",
  # 8 fragments every 8 steps: each is sent 5 times in 40 steps (fewer compiles than 24).
  "FragmentSchedule.num_fragments = 8",
  "FragmentSchedule.period = 8",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


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
    port_file = tmp_path / "port"
    syncer_log = tmp_path / "syncer.log"
    syncer = _spawn(
      "ddiloco.launch.syncer_main",
      [f"--workdir={tmp_path / 'syncer'}", f"--port_file={port_file}"],
      devices=1,
      log_path=syncer_log,
    )
    procs.append(syncer)
    deadline = time.monotonic() + 180
    while not port_file.exists():
      assert syncer.poll() is None, _tail(syncer_log)
      assert time.monotonic() < deadline, _tail(syncer_log)
      time.sleep(0.2)
    address = f"127.0.0.1:{port_file.read_text()}"
    coordinator = f"127.0.0.1:{_free_port()}"
    workdir = tmp_path / "learner_0"
    logs = [tmp_path / f"learner_0.{i}.log" for i in range(2)]
    learners = [
      _spawn(
        "ddiloco.launch.learner_main",
        [
          "--learner_id=0",
          f"--syncer_address={address}",
          f"--workdir={workdir}",
          "--num_processes=2",
          f"--process_id={i}",
          f"--coordinator_address={coordinator}",
        ],
        devices=2,
        log_path=logs[i],
      )
      for i in range(2)
    ]
    procs += learners
    for proc, log in zip(learners, logs):
      assert _wait(proc, log, 300) == 0, _tail(log)
    syncer.send_signal(signal.SIGTERM)
    assert _wait(syncer, syncer_log, 120) == 0, _tail(syncer_log)
  finally:
    for proc in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
      proc.wait(timeout=30)
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
