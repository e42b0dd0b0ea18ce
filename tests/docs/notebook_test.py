"""Executes docs/colab/quickstart.ipynb with nbclient, so the quick start cannot rot.

The notebook runs in a fresh kernel of this interpreter in a temporary folder outside the repository
(with this checkout first on PYTHONPATH), writes its runs and a results.json under
$DDILOCO_NOTEBOOK_OUT, and the test checks both the numbers it reports and, independently, the
metrics.jsonl files and TensorBoard events its runs wrote.
"""

import importlib.metadata
import json
import math
import os
import pathlib
import subprocess
import sys

import nbclient
import nbformat
import pytest

from ddiloco.metrics.writer import read_events, read_scalars

# A whole job: the notebook runs in a kernel of its own, and every test here reads its one execution.
pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "docs" / "colab" / "quickstart.ipynb"
KERNEL = "ddiloco-test-python3"
# ~60-90 s on 2 idle cores (most of it the two training runs); generous for a loaded CI machine.
CELL_TIMEOUT_S = 600


def _kernel_spec(tmp: pathlib.Path) -> pathlib.Path:
  """A kernel spec that starts ipykernel on this very interpreter, in a private JUPYTER_PATH.

  Without it, "python3" resolves to the first spec on Jupyter's search path, which may be a user's
  (~/.local/share/jupyter) pointing at another Python without ddiloco.
  """
  spec_dir = tmp / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  spec = {
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "ddiloco test kernel",
    "language": "python",
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  return tmp / "jupyter"


# One worker runs this module's tests (pyproject.toml); "session" keeps the one execution even if
# a worker ran another module's tests between them.
@pytest.fixture(scope="session")
def executed(tmp_path_factory):
  """Runs the notebook once per test process: (executed notebook, its output folder)."""
  tmp = tmp_path_factory.mktemp("notebook")
  out = tmp / "out"
  with pytest.MonkeyPatch.context() as mp:  # The kernel process inherits this environment.
    mp.setenv("JUPYTER_PATH", str(_kernel_spec(tmp)))
    mp.setenv("JUPYTER_RUNTIME_DIR", str(tmp / "runtime"))  # Connection files, never in $HOME.
    mp.setenv("IPYTHONDIR", str(tmp / "ipython"))
    mp.delenv("MPLBACKEND", raising=False)  # ipykernel's inline backend puts figures in outputs.
    mp.setenv("DDILOCO_NOTEBOOK_OUT", str(out))
    # This checkout, not another installed copy; the kernel works in a folder without any configs.
    mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
      nb,
      kernel_name=KERNEL,
      timeout=CELL_TIMEOUT_S,
      resources={"metadata": {"path": str(elsewhere)}},  # The kernel's working directory.
    )
    client.execute()  # Raises CellExecutionError if any cell fails.
  return nb, out


def test_committed_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.timeout(1200)
def test_notebook_runs_and_reports_a_crash_tolerant_run(executed):
  nb, out = executed
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in code)
  errors = [o for c in code for o in c.outputs if o.output_type == "error"]
  assert not errors
  images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
  assert len(images) == 2  # Loss + merge timeline; eval loss vs tokens.

  results = json.loads((out / "results.json").read_text())
  ddl, dp = results["Decoupled DiLoCo"], results["data-parallel"]
  for run in (ddl, dp):
    losses = [loss for _, _, loss in run["evals"]]
    assert all(math.isfinite(x) for x in losses)
    assert run["final_eval_loss"] == pytest.approx(losses[-1])
    # Held-out byte loss starts near ln 256 = 5.55 nats (uniform); 48 steps bring it to ~3.
    assert losses[-1] < 4.0 and losses[-1] < losses[0] - 1.0
  # Equal tokens: 4 learners x 48 steps x 8 sequences x 64 tokens = 98,304 = 1 x 48 x 32 x 64.
  assert ddl["tokens_trained"] == dp["tokens_trained"] == 98_304
  assert ddl["digests_agree"] is True
  assert ddl["global_downtime_s"] == 0.0  # The others kept training through the crash.
  # Learner 2 lost 12 of the fleet's ~4 x 52 provisioned seconds: goodput strictly between.
  assert 0.85 < ddl["goodput"] < 1.0 and dp["goodput"] == 1.0
  # P = H = 8: one fragment due per step, ~48 merges plus the drain; the baseline has no syncer.
  assert ddl["merges"] >= 40 and dp["merges"] == 0
  assert 3.0 < ddl["mean_quorum_size"] < 4.0  # 4 learners, 3 during the crash.
  assert results["crash_windows"] == [[2, 16.0, 28.0]]


@pytest.mark.timeout(1200)
def test_crash_is_visible_in_the_run_metrics(executed):
  _, out = executed
  workdir = out / "decoupled_diloco"
  faults = [(f["action"], f["learner"], f["time"]) for f in read_events(workdir, "fault")]
  assert faults == [("kill_learner", 2, 16.0), ("start_learner", 2, 28.0)]
  merges = read_events(workdir, "merge")
  during = [m for m in merges if 16.0 < m["time"] < 28.0]
  # One merge a second while learner 2 is down, each without it: the syncer never waits (K = 1).
  assert len(during) >= 10
  assert all(2 not in m["contributors"] and len(m["contributors"]) == 3 for m in during)
  assert any(2 in m["contributors"] for m in merges if m["time"] > 28.0)  # Back in after rejoin.
  train2 = read_events(workdir, "train")
  assert not [e for e in train2 if e["learner"] == 2 and 16.0 < e["time"] < 28.0]
  assert [e for e in train2 if e["learner"] == 2 and e["time"] > 28.0]


@pytest.mark.timeout(1200)
def test_runs_wrote_tensorboard_scalars_against_tokens(executed):
  _, out = executed
  scalars = read_scalars(str(out / "decoupled_diloco"))
  assert {"learner_0/loss", "eval/loss", "syncer/quorum_size", "goodput/goodput"} <= scalars.keys()
  eval_tokens = [x for x, _ in scalars["eval/loss"]]
  assert eval_tokens[-1] == 98_304  # The final evaluation, at the run's token budget.


def _setup_cell() -> str:
  nb = nbformat.read(NOTEBOOK, as_version=4)
  return next(c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("inside", [True, False])
def test_setup_cell_installs_once_from_the_checkout_or_by_name(tmp_path, monkeypatch, inside):
  """Not installed: pip installs the checkout it runs in, else the package by name; rerun: nothing."""
  monkeypatch.chdir(REPO / "docs" / "colab" if inside else tmp_path)
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  state = {"installed": False}
  calls = []

  def distribution(name):
    if not state["installed"]:
      raise importlib.metadata.PackageNotFoundError(name)

  def run(cmd, check):
    calls.append(cmd)
    state["installed"] = True

  monkeypatch.setattr(importlib.metadata, "distribution", distribution)
  monkeypatch.setattr(subprocess, "run", run)
  for _ in range(2):
    exec(compile(_setup_cell(), "setup_cell", "exec"), {"__name__": "notebook"})
  assert calls == [
    [
      *(sys.executable, "-m", "pip", "install", "--quiet"),
      f"{REPO}[text,plots]" if inside else "ddiloco[text,plots]",  # The extras it uses.
    ]
  ]
  text = _setup_cell()
  assert "git clone" not in text and "://" not in text  # Nothing fetched from a host by URL.
