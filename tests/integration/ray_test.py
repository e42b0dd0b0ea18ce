"""`ddiloco-ray`'s backend (launch/ray_cluster.py) on a Ray instance started on this machine.

One run of a syncer and two learners as Ray actors. Mid-run one learner's *program* is SIGKILLed
(its actor sees it die and exits) and the other learner's *actor* is SIGKILLed (its program dies
with it): Ray restarts each alone, each restores its own checkpoint and finishes, the syncer and
the other learner never stop, every learner ends with the syncer's bits, and nothing is left
running afterwards, neither our programs nor Ray's own processes. Meanwhile a third learner is
added to the running job as a new actor and removed again (`ddiloco-fleet add` / `remove`): it
leaves gracefully and is not restarted.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from ddiloco.launch import ray_actors, ray_cluster  # noqa: E402
from ddiloco.launch.ray_config import RayConfig  # noqa: E402
from ddiloco.testing import runs  # noqa: E402

GIN = runs.config_path("ray_tiny.gin")
FAST = runs.quick(steps=64, more=["LearnerCheckpointConfig.save_every_steps = 8"])

# One Ray instance at a time (this module runs on one worker, pyproject.toml): the Ctrl-C test
# counts the machine's Ray daemons.
pytestmark = pytest.mark.timeout(420)


@pytest.mark.integration
def test_ray_restarts_a_failed_learner_alone_and_leaves_nothing(tmp_path):
  job = runs.parse_job(GIN, FAST)
  args = runs.gin_args(GIN, FAST)
  cluster = ray_cluster.make_cluster(
    workdir=str(tmp_path), gin_args=args, num_learners=2, ray_config=RayConfig(local_num_cpus=4)
  )
  cluster.backend.connect()
  session = ray._private.worker._global_node.get_session_dir_path()
  killed: dict[str, int] = {}
  lines = []

  def chaos(line):
    lines.append(line)
    l0, l1, l2 = (cluster.learners.get(i) for i in range(3))
    if l0 is not None and l2 is None and l0.last.get("step", 0) >= 8:
      cluster.add_learner(steps=400)  # Scavenged capacity: a new actor joins the running job...
    if (
      l2 is not None and cluster.fleet.members[2].state == "running" and l2.last.get("step", 0) >= 8
    ):
      cluster.fleet.begin_remove(2)  # ...and leaves again, gracefully (not restarted).
    if (
      l1 is not None
      and "actor" not in killed
      and l1.last.get("step", 0) >= 16
      and l1.proc.actor_pid
    ):
      killed["actor"] = l1.last["step"]
      os.kill(l1.proc.actor_pid, signal.SIGKILL)  # A lost host: the program dies with its actor.
    if l0 is not None and "program" not in killed and l0.last.get("step", 0) >= 24:
      killed["program"] = l0.last["step"]
      os.kill(l0.proc.pid, signal.SIGKILL)  # A crashed learner: its actor exits after it.

  try:
    summary = cluster.run(job, timeout_s=360, progress_every_s=0.5, progress=chaos)
  finally:
    cluster.stop_all()
    cluster.backend.disconnect()
  assert set(killed) == {"actor", "program"}, lines[-5:]
  restarts = [e for e in summary["membership"] if e["event"] == "restart"]
  assert sorted((e["learner_id"], e["restarts"]) for e in restarts) == [(0, 1), (1, 1)], restarts
  events = [(e["event"], e["learner_id"]) for e in summary["membership"]]
  assert ("join", 2) in events and ("leave", 2) in events
  leave = next(e for e in summary["membership"] if e["event"] == "leave")
  assert leave["graceful"] is True and leave["exit_code"] == 0, leave
  assert summary["ok"] is True
  assert summary["digests_agree"] is True and summary["digest_checks"] > 0
  assert summary["budget_reached"] is True
  for i in ("0", "1"):
    learner = summary["learners"][i]
    assert learner["steps"] == 64
    with open(os.path.join(tmp_path, f"learner_{i}", "summary.json")) as f:
      own = json.load(f)  # The restarted incarnation's.
    assert own["restored_from"].startswith("own") and own["resumed_step"] >= 8, own
    with open(os.path.join(tmp_path, f"learner_{i}", "log.txt")) as f:
      log = f.read()  # Both incarnations: the restart appends.
    assert log.count("restored from fresh at step 0") == 1, log[-2000:]
    assert ("[ddiloco-ray] the program exited" in log) == (i == "0")
    assert log.count("[ddiloco-ray] restarted by actor") == 1
    assert "nice 0)" in log  # The local instance runs its workers at normal priority.
  with open(os.path.join(tmp_path, "syncer", "log.txt")) as f:
    log = f.read()
  assert log.count("[ddiloco-ray] started") == 1 and "restarted" not in log  # Never stopped.
  assert summary["merges"] > 0
  # Nothing left: neither a program of the run nor a process of the Ray instance it started.
  assert not ray.is_initialized()
  assert runs.processes_mentioning(str(tmp_path)) == []
  assert runs.processes_mentioning(session) == []


def test_ray_config_refuses_bad_values():
  for bad in (
    {"platform": "tpu-v5"},
    {"max_restarts": -2},
    {"learner_num_gpus": -1.0},
    {"learner_resources": {"TPU": -4}},
    {"placement_strategy": "ANYWHERE"},
    {"local_num_cpus": 0},
    {"syncer_port": 70000},
    {"tpu_topology": "4x4x4"},
    {"tpu_topology": "4x4x4", "tpu_version": "v5p"},  # Not on platform "tpu".
    {"start_timeout_s": 0},
    {"runtime_env": "working_dir=."},
    {"crash_loop_restarts": -1},
    {"crash_loop_window_s": 0},
  ):
    with pytest.raises(ValueError):
      RayConfig(**bad)


def _ray_daemons() -> set[int]:
  return set(runs.processes_mentioning("gcs_server")) | set(runs.processes_mentioning("raylet"))


@pytest.mark.integration
def test_ctrl_c_stops_the_run_in_order_and_leaves_nothing(tmp_path):
  """A terminal's Ctrl-C reaches the whole foreground process group: the launcher and the Ray
  processes it started. The run must still stop in order (every program writes its summary) and
  leave no process behind."""
  before = _ray_daemons()
  workdir = tmp_path / "run"
  # An interactive shell gives its foreground job the default SIGINT handler; a test runner
  # started in the background may not (SIG_IGN is inherited), so the child sets it as a terminal
  # would.
  code = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('ddiloco.launch.ray_main', run_name='__main__', alter_sys=True)"
  )
  cmd = [
    sys.executable,
    "-c",
    code,
    f"--workdir={workdir}",
    "--timeout_s=300",
    "--progress_every_s=0.5",
    *runs.gin_args(GIN, [*FAST, "STEPS = 100000"]),
  ]
  log = open(tmp_path / "launcher.txt", "w")  # noqa: SIM115 - closed in the finally.
  launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    deadline = time.monotonic() + 240
    # Ten merges: the learners have applied updates, so their digests can be checked.
    while not re.search(r"merges +[1-9][0-9]", (tmp_path / "launcher.txt").read_text()):
      assert launcher.poll() is None, (tmp_path / "launcher.txt").read_text()[-3000:]
      assert time.monotonic() < deadline, "no merge within 240 s"
      time.sleep(0.5)
    os.killpg(launcher.pid, signal.SIGINT)  # As a terminal's Ctrl-C does.
    assert launcher.wait(timeout=180) == 130
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait(timeout=30)
    log.close()
  text = (tmp_path / "launcher.txt").read_text()
  assert "interrupted: every process stopped" in text, text[-3000:]
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  assert summary["interrupted"] is True and summary["digest_checks"] > 0
  assert summary["digests_agree"] is True
  for name in ("syncer", "learner_0", "learner_1"):
    assert (workdir / name / "summary.json").exists(), name  # Each stopped gracefully.
  deadline = time.monotonic() + 30  # Ray's daemons exit a moment after the launcher.
  while (left := runs.processes_mentioning(str(workdir)) or sorted(_ray_daemons() - before)) and (
    time.monotonic() < deadline
  ):
    time.sleep(0.5)
  assert not left, left


@pytest.mark.integration
def test_a_program_ray_cannot_place_ends_without_hanging_the_launcher(tmp_path):
  """Learners asking for resources no node has: after `start_timeout_s` the program counts as
  failed and its log says why; a stop before then returns at once."""
  cluster = ray_cluster.make_cluster(
    workdir=str(tmp_path),
    gin_args=runs.gin_args(GIN, FAST),
    num_learners=2,
    ray_config=RayConfig(local_num_cpus=2, learner_resources={"TPU": 4}, start_timeout_s=3.0),
  )
  cluster.backend.connect()
  try:
    cluster.port = 1  # As if a syncer served: the learners never get far enough to dial it.
    waiting, stopped = cluster.start_learner(0), cluster.start_learner(1)
    t0 = time.monotonic()
    cluster.signal(stopped, signal.SIGTERM)
    assert stopped.proc.poll() == ray_actors.ACTOR_DIED
    assert time.monotonic() - t0 < 5
    assert waiting.proc.wait(timeout=30) == ray_actors.ACTOR_DIED
  finally:
    cluster.stop_all()
    cluster.backend.disconnect()
  with open(waiting.log_path) as f:
    assert "Ray did not start this learner within 3.0 s" in f.read()
  with open(stopped.log_path) as f:
    assert "stopped (SIGTERM) before Ray started it" in f.read()


@pytest.mark.e2e  # A second Ray instance and run: ~35 s.
def test_runtime_env_ships_a_users_module_to_the_programs(tmp_path, monkeypatch):
  """A gin file that imports the user's own module: with `RayConfig.runtime_env` =
  {"working_dir": <their folder>}, Ray ships the folder and every program starts in it."""
  user = tmp_path / "user"
  user.mkdir()
  (user / "user_steps.py").write_text(
    "import gin\n\n\n@gin.configurable\ndef user_steps():\n  return 12\n"
  )
  (user / "run.gin").write_text(
    f'import user_steps\n\ninclude "{GIN}"\n\nRunConfig.steps_per_learner = @user_steps()\n'
  )
  elsewhere = tmp_path / "elsewhere"  # The launcher's folder: no user_steps.py there.
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  monkeypatch.syspath_prepend(str(user))  # The launcher parses the gin file itself.
  gin_file = str(user / "run.gin")
  bindings = [b for b in FAST if not b.startswith("STEPS")]
  job = runs.parse_job(gin_file, bindings)
  assert job.run.steps_per_learner == 12
  cluster = ray_cluster.make_cluster(
    workdir=str(tmp_path / "run"),
    gin_args=runs.gin_args(gin_file, bindings),
    num_learners=2,
    ray_config=RayConfig(local_num_cpus=4, runtime_env={"working_dir": str(user)}),
  )
  cluster.backend.connect()
  try:
    summary = cluster.run(job, timeout_s=240, progress_every_s=1.0)
  finally:
    cluster.stop_all()
    cluster.backend.disconnect()
  assert summary["ok"] is True
  assert [summary["learners"][i]["steps"] for i in ("0", "1")] == [12, 12]


@pytest.mark.e2e  # A Ray instance and six failing starts: ~30 s.
def test_a_crash_loop_ends_the_run_instead_of_restarting_for_ever(tmp_path):
  """Learners whose own flags are bad fail at start every time: after `crash_loop_restarts`
  restarts the launcher stops them and the run fails, saying why."""
  cluster = ray_cluster.make_cluster(
    workdir=str(tmp_path),
    gin_args=runs.gin_args(GIN, FAST),
    num_learners=2,
    extra_learner_args=["--gin_bindings=RunConfig.steps_per_learner = 0"],
    ray_config=RayConfig(local_num_cpus=4, crash_loop_restarts=2),
  )
  cluster.backend.connect()
  try:
    with pytest.raises(RuntimeError, match="exited with") as info:
      cluster.run(runs.parse_job(GIN, FAST), timeout_s=240, progress_every_s=1.0)
  finally:
    cluster.stop_all()
    cluster.backend.disconnect()
  assert "a crash loop: not restarted again" in str(info.value)
  assert "steps_per_learner=0" in str(info.value)  # The program's own error, from its log.
