"""Tests for launch/cli.py: every console script's --help, and one-line errors for bad input.

The scripts run as their generated wrappers do: `sys.exit(run())` from a `__main__` module without a
docstring, under the script's name. Every bad input must end in exactly one `error:` line on stderr,
exit status 2, and no workdir.
"""

import ast
import logging
import pathlib
import subprocess
import sys

import pytest

from ddiloco.launch import cli, syncer_shards

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCAL_GIN = str(ROOT / "gin_configs" / "local_tiny.gin")
SIM_GIN = str(ROOT / "gin_configs" / "sim_tiny.gin")

# Console script -> (module, a flag of the module's own, one its --help must list).
SCRIPTS = {
  "ddiloco-simulate": ("launch.simulate", "--workdir"),
  "ddiloco-goodput": ("launch.goodput_main", "--workdir"),
  "ddiloco-syncer": ("launch.syncer_main", "--port_file"),
  "ddiloco-learner": ("launch.learner_main", "--syncer_address"),
  "ddiloco-local": ("launch.local", "--timeout_s"),
  "ddiloco-chaos": ("chaos.main", "--baseline_loss"),
  "ddiloco-replay": ("chaos.replay_main", "--tape"),
  "ddiloco-fleet": ("launch.fleet_main", "--learner_gin"),
  "ddiloco-ray": ("launch.ray_main", "--address"),
  "ddiloco-export": ("launch.export_main", "--out"),
}

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _script(prog: str, *args: str) -> subprocess.CompletedProcess:
  """Runs console script `prog` as its setup.py wrapper would."""
  module = SCRIPTS[prog][0]
  code = f"import sys; from ddiloco.{module} import run; sys.argv[0] = {prog!r}; sys.exit(run())"
  return subprocess.run(
    [sys.executable, "-c", code, *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=90,
    check=False,
  )


def test_setup_declares_exactly_these_scripts():
  text = (ROOT / "setup.py").read_text()
  for prog, (module, _) in SCRIPTS.items():
    assert f'"{prog}=ddiloco.{module}:run"' in text
  assert text.count("=ddiloco.") == len(SCRIPTS)


@pytest.mark.parametrize("prog", sorted(SCRIPTS))
def test_help_prints_the_docstring_and_the_flags(prog):
  module, flag = SCRIPTS[prog]
  proc = _script(prog, "--help")
  assert proc.returncode == 0, proc.stderr[-2000:]
  source = (ROOT / "ddiloco" / f"{module.replace('.', '/')}.py").read_text()
  doc = ast.get_docstring(ast.parse(source))  # Not imported here: its flags would clash.
  assert proc.stdout.startswith(doc.strip().splitlines()[0])
  assert proc.stdout.startswith(f"`{prog}`")
  assert f"  {flag}" in proc.stdout
  if prog not in ("ddiloco-fleet", "ddiloco-export"):  # They read no gin files of their own.
    assert "  --gin_file" in proc.stdout  # The shared gin flags are the command's flags too.
  assert (
    "--verbosity" not in proc.stdout and "USAGE" not in proc.stdout
  )  # Not the libraries' flags.


def test_helpfull_lists_every_flag_and_exits_0():
  proc = _script("ddiloco-local", "--helpfull")
  assert proc.returncode == 0
  assert "--timeout_s" in proc.stdout and "--verbosity" in proc.stdout


def test_help_as_a_module_lists_the_flags():
  proc = subprocess.run(
    [sys.executable, "-m", "ddiloco.launch.local", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=90,
    check=False,
  )
  assert proc.returncode == 0 and "  --timeout_s" in proc.stdout


def _assert_one_line_error(proc, prog, workdir, *expected):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr  # Also: no library noise (gin's "Path not found" ERRORs).
  assert lines[0].startswith(f"{prog}: error: ")
  for text in expected:
    assert text in lines[0]
  assert not workdir.exists()


def test_unknown_flag(tmp_path):
  w = tmp_path / "w"
  proc = _script("ddiloco-local", f"--workdir={w}", f"--gin_file={LOCAL_GIN}", "--num_lerners=2")
  _assert_one_line_error(proc, "ddiloco-local", w, "num_lerners", "--help")


def test_missing_workdir(tmp_path):
  proc = _script("ddiloco-local", f"--gin_file={LOCAL_GIN}")
  _assert_one_line_error(proc, "ddiloco-local", tmp_path / "w", "--workdir")


def test_missing_gin_file(tmp_path):
  w = tmp_path / "w"
  _assert_one_line_error(_script("ddiloco-local", f"--workdir={w}"), "ddiloco-local", w, "gin_file")


def test_gin_file_not_found(tmp_path):
  w = tmp_path / "w"
  proc = _script("ddiloco-local", f"--workdir={w}", "--gin_file=no_such_config.gin")
  _assert_one_line_error(proc, "ddiloco-local", w, "no_such_config.gin")


def test_misspelled_parameter_suggests_the_closest(tmp_path):
  w = tmp_path / "w"
  proc = _script(
    "ddiloco-local", f"--workdir={w}", f"--gin_file={LOCAL_GIN}", "--gin.RunConfig.num_lerners=2"
  )
  _assert_one_line_error(
    proc, "ddiloco-local", w, "'num_lerners'", "Did you mean 'num_learners'", "RunConfig"
  )


def test_misspelled_configurable_suggests_the_closest(tmp_path):
  w = tmp_path / "w"
  proc = _script(
    "ddiloco-local", f"--workdir={w}", f"--gin_file={LOCAL_GIN}", "--gin.RunConfg.num_learners=2"
  )
  _assert_one_line_error(proc, "ddiloco-local", w, "'RunConfg'", "Did you mean 'RunConfig'")


@pytest.mark.parametrize("script", ["ddiloco-local", "ddiloco-simulate"])
def test_misspelled_macro_suggests_the_closest(tmp_path, script):
  # gin would take it as a new macro and ignore it: the run would silently keep LEARNERS = 4.
  w = tmp_path / "w"
  gin_file = LOCAL_GIN if script == "ddiloco-local" else "sim_tiny.gin"
  proc = _script(script, f"--workdir={w}", f"--gin_file={gin_file}", "--gin.LEARNRS=2")
  _assert_one_line_error(proc, script, w, "'LEARNRS'", "Did you mean 'LEARNERS'")


@pytest.mark.parametrize(
  ("binding", "expected"),
  [
    # τ was once bound twice (SyncerConfig.overlap and FragmentSchedule.overlap).
    ("SyncerConfig.overlap=2", ("'overlap'", "FragmentSchedule.overlap")),
    # The merge rule was a string; it is an object now.
    (
      "SyncerConfig.merge_method='mean'",
      ("'merge_method'", "SyncerConfig.merge_rule = @RDA()", '@WeightedMean() (was "mean")'),
    ),
  ],
)
def test_a_moved_parameter_says_where_it_lives_now(tmp_path, binding, expected):
  # A config written for an older version is told which binding replaces it.
  w = tmp_path / "w"
  proc = _script(
    "ddiloco-simulate", f"--workdir={w}", "--gin_file=sim_tiny.gin", f"--gin.{binding}"
  )
  _assert_one_line_error(proc, "ddiloco-simulate", w, *expected)


def test_a_merge_rule_that_is_not_one_is_refused(tmp_path):
  w = tmp_path / "w"
  proc = _script(
    "ddiloco-simulate",
    f"--workdir={w}",
    f"--gin_file={SIM_GIN}",
    "--gin.SyncerConfig.merge_rule='rda'",
  )
  _assert_one_line_error(proc, "ddiloco-simulate", w, "merge_rule must be a MergeRule", "@RDA()")


def test_bad_line_in_a_gin_file_names_the_file(tmp_path):
  w = tmp_path / "w"
  bad = tmp_path / "bad.gin"
  bad.write_text("# A typo on line 2.\nRunConfig.log_evry = 3\n")
  proc = _script("ddiloco-local", f"--workdir={w}", f"--gin_file={bad}")
  _assert_one_line_error(proc, "ddiloco-local", w, str(bad), "line 2", "Did you mean 'log_every'")


def test_bad_fault_string(tmp_path):
  w = tmp_path / "w"
  proc = _script(
    "ddiloco-simulate", f"--workdir={w}", f"--gin_file={SIM_GIN}", '--gin.FAULTS=("crash:x",)'
  )
  _assert_one_line_error(
    proc, "ddiloco-simulate", w, "'crash:x'", "KIND:LEARNER@TIME", "ClusterConfig"
  )


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  w = blocker / "w"  # Under a regular file: cannot be created (even by root).
  proc = _script("ddiloco-local", f"--workdir={w}", f"--gin_file={LOCAL_GIN}")
  _assert_one_line_error(proc, "ddiloco-local", w, "cannot write the workdir", str(w))


@pytest.mark.parametrize(
  "binding", ["RunConfig.num_learners=0", "LEARNERS=-1", "JobConfig.processes_per_learner=0"]
)
def test_a_bad_count_is_refused_by_its_config(tmp_path, binding):
  w = tmp_path / "w"
  proc = _script("ddiloco-local", f"--workdir={w}", f"--gin_file={LOCAL_GIN}", f"--gin.{binding}")
  field = binding.split("=")[0].split(".")[-1].replace("LEARNERS", "num_learners")
  value = binding.split("=")[1]
  _assert_one_line_error(proc, "ddiloco-local", w, f"{field}={value}", "must be >= 1")


def test_simulate_refuses_a_bad_value(tmp_path):
  w = tmp_path / "w"
  proc = _script("ddiloco-simulate", f"--workdir={w}", f"--gin_file={SIM_GIN}", "--gin.LEARNERS=0")
  _assert_one_line_error(proc, "ddiloco-simulate", w, "num_learners=0", "must be >= 1", "RunConfig")


def test_learner_steps_are_checked_as_the_run_config_is(tmp_path):
  w = tmp_path / "w"
  proc = _script(
    "ddiloco-learner",
    f"--workdir={w}",
    f"--gin_file={LOCAL_GIN}",
    "--learner_id=0",
    "--syncer_address=127.0.0.1:1",
    "--gin.RunConfig.steps_per_learner=0",
  )
  _assert_one_line_error(proc, "ddiloco-learner", w, "steps_per_learner=0", "RunConfig")


@pytest.mark.parametrize(
  ("script", "gin_file", "binding", "expected"),
  [
    ("ddiloco-local", LOCAL_GIN, "JobConfig.num_learners=2", "RunConfig.num_learners"),
    ("ddiloco-simulate", SIM_GIN, "ClusterConfig.log_every=2", "RunConfig.log_every"),
    ("ddiloco-simulate", SIM_GIN, "simulate.cluster=None", "simulate.fleet"),
  ],
)
def test_a_parameter_that_moved_to_the_run_config_says_so(
  tmp_path, script, gin_file, binding, expected
):
  w = tmp_path / "w"
  proc = _script(script, f"--workdir={w}", f"--gin_file={gin_file}", f"--gin.{binding}")
  _assert_one_line_error(proc, script, w, expected)


@pytest.mark.parametrize(
  ("prog", "args", "expected"),
  [
    ("ddiloco-syncer", ["--port=70000"], "--port"),
    ("ddiloco-learner", ["--learner_id=-1", "--syncer_address=x:1"], "--learner_id"),
    ("ddiloco-local", ["--timeout_s=-5"], "--timeout_s"),
    # absl's bounds compare with `<`, which NaN passes: the run started and never timed out.
    ("ddiloco-local", ["--timeout_s=nan"], "--timeout_s=nan: not a number"),
    (
      "ddiloco-learner",
      ["--learner_id=0", "--syncer_address=x:1", "--connect_timeout_s=nan"],
      "--connect_timeout_s=nan",
    ),
    # The eval invariant refused it only after the whole chaos run.
    ("ddiloco-chaos", ["--baseline_loss=-1"], "--baseline_loss must be finite and > 0"),
    ("ddiloco-local", ["--tls_cert_file=c.pem"], "go together"),
    ("ddiloco-local", ["--tls_ca_file=c.pem"], "needs --tls_cert_file"),
    ("ddiloco-local", ["--tls_cert_file=c.pem", "--tls_key_file=k.pem"], "no such TLS file"),
    ("ddiloco-ray", ["--tls_cert_file=c.pem"], "go together"),
    ("ddiloco-ray", ["--workdir=gs://bucket/run"], "needs a local or mounted folder"),
    (
      "ddiloco-ray",
      [
        "--gin.ddiloco.RayConfig.syncer_port=9000",
        "--gin.ServiceConfig.bulk_port=9001",
        "--gin.JobConfig.syncer_shards=2",
      ],
      "the two ranges meet",
    ),
    ("ddiloco-fleet", ["--devices=0", "add"], "devices must be in [1, "),
    ("ddiloco-fleet", ["frobnicate"], "add | remove | list"),
    ("ddiloco-export", ["--format=hf", "--out=o"], "neither a run folder (with syncer/)"),
    ("ddiloco-export", ["--format=safetensors", "--out=o"], "--format"),
    ("ddiloco-export", ["--format=orbax", "--out=o", "--learner=0", "--version=3"], "--step"),
  ],
)
def test_launcher_flags_are_checked(tmp_path, prog, args, expected):
  w = tmp_path / "w"
  gin = [] if prog in ("ddiloco-fleet", "ddiloco-export") else [f"--gin_file={LOCAL_GIN}"]
  proc = _script(prog, f"--workdir={w}", *gin, *args)
  _assert_one_line_error(proc, prog, w, expected)


# -- in-process units -------------------------------------------------------------------------


def test_a_syncer_shard_on_another_shards_workdir_stops_with_one_line(tmp_path):
  workdir = tmp_path / "syncer"
  workdir.mkdir()
  syncer_shards.record_workdir(str(workdir), shard=1, num_shards=2)
  proc = _script(
    "ddiloco-syncer",
    f"--gin_file={LOCAL_GIN}",
    f"--workdir={workdir}",
    "--gin.JobConfig.syncer_shards=2",
    "--shard=0",
    "--shard_addresses=127.0.0.1:1,127.0.0.1:2",
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("ddiloco-syncer: cannot restart: ") and (
    "holds the state of syncer shard 1 of 2, not of syncer shard 0 of 2" in last
  ), proc.stderr[-3000:]


def test_describe_config_error_of_a_failed_configurable():
  import gin

  @gin.configurable("cli_test_thing")
  def thing(size=1):
    if size < 1:
      raise ValueError(f"size must be >= 1, got {size}.")

  gin.clear_config()
  try:
    gin.parse_config("cli_test_thing.size = 0")
    with pytest.raises(ValueError) as info:
      thing()
    assert cli.describe_config_error(info.value) == (
      "size must be >= 1, got 0. (in cli_test_thing)"
    )
  finally:
    gin.clear_config()


def _record(name, level, msg, pathname):
  return logging.LogRecord(name, level, pathname, 1, msg, None, None)


@pytest.mark.parametrize(
  ("record", "shown"),
  [
    (_record("root", logging.ERROR, "Path not found: x.gin", "/v/gin/resource_reader.py"), False),
    (
      _record(
        "jax._src.xla_bridge", logging.INFO, "Unable to initialize backend 'tpu': no", "/v/x.py"
      ),
      False,
    ),
    (_record("absl", logging.INFO, "Saving checkpoint", "/v/orbax/checkpoint/x.py"), False),
    (_record("absl", logging.WARNING, "slow save", "/v/orbax/checkpoint/x.py"), True),
    (_record("absl", logging.INFO, "learner 0 on 1 device(s)", "/r/ddiloco/x.py"), True),
    (_record("root", logging.ERROR, "disk full", "/r/ddiloco/x.py"), True),
  ],
)
def test_quiet_logs_drops_only_library_start_up_noise(record, shown):
  assert cli._FILTER.filter(record) is shown
