"""`ddiloco-local` end to end: Ctrl-C writes the partial run's summary and plot, and starts quietly.

Runs the console script as its generated wrapper does, on 1 tiny learner, and interrupts it as soon
as the syncer counts the learner alive (about 15 s on 2 cores).
"""

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIN = ROOT / "gin_configs" / "local_tiny.gin"
# The start-up noise that launch/cli.py filters (gin, jax without a TPU, orbax's INFO lines).
NOISE = ("resource_reader.py", "Path not found", "Unable to initialize backend", "orbax")


@pytest.mark.timeout(180)
@pytest.mark.integration
def test_ctrl_c_writes_the_partial_summary_and_plot(tmp_path):
  workdir = tmp_path / "w"
  # An interactive shell gives its foreground job the default SIGINT handler; a test runner started
  # in the background may not (SIG_IGN is inherited), so the child sets it as a terminal would.
  code = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from ddiloco.launch.local import run; sys.argv[0] = 'ddiloco-local'; sys.exit(run())"
  )
  args = [
    f"--gin_file={GIN}",
    f"--workdir={workdir}",
    "--gin.LEARNERS=1",
    "--gin.STEPS=2000",  # Far more than it can train before the interrupt.
    "--gin.RunConfig.eval_batches=1",
    "--gin.InnerOptConfig.warmup_steps=4",
    "--progress_every_s=0.5",
  ]
  err_path = tmp_path / "stderr.txt"
  with open(err_path, "w") as err:
    proc = subprocess.Popen(
      [sys.executable, "-c", code, *args],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=err,
      text=True,
    )
    try:
      deadline = time.monotonic() + 120
      while "alive [0]" not in err_path.read_text():
        assert proc.poll() is None, err_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the learner never joined"
        time.sleep(0.25)
      proc.send_signal(signal.SIGINT)
      out, _ = proc.communicate(timeout=90)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  stderr = err_path.read_text()
  assert proc.returncode == 130, stderr[-3000:]
  assert "Traceback" not in stderr
  assert "interrupted: every process stopped" in stderr
  assert "summary (interrupted):" in out and "of the partial run" in out
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["interrupted"] is True and summary["ok"] is False
  assert summary["token_budget"] == 2000 * 8 * 64
  assert summary["tokens_trained"] < summary["token_budget"]
  assert (workdir / "loss.png").stat().st_size > 0
  # A quiet start: no library noise in the launcher's output or the processes' logs.
  logs = [stderr, *(p.read_text() for p in workdir.glob("*/log.txt"))]
  assert len(logs) == 3  # The launcher, the syncer and the learner.
  for text in logs:
    assert not [n for n in NOISE if n in text], text[-3000:]
