"""A golden trajectory of a tiny simulated run: a change to the numerics shows up here.

The run: 3 tiny learners, 24 steps, P = 4, H = 4, τ = 1, K = 1 + grace, outer Nesterov 0.7 / 0.9,
a crash and a restart, int8 uplink, int4 downlink. The fixture holds its learners' logged losses,
its evaluations and its merges. Refactoring must leave it unchanged; a change that means to alter
the numerics regenerates it and says so in its commit message:

  DDILOCO_WRITE_FIXTURE=1 .venv/bin/python -m pytest -m integration tests/simulation/golden_test.py

The run goes in a child process whose code paths are pinned to x86-64 AVX2 (`_PINNED_ENV`): XLA's
generated CPU code, numpy's SIMD loops and OpenBLAS's kernels otherwise follow the host's CPU, and
an AVX-512 host rounds differently from an AVX2 one (a few ulps at step 2, ~3e-5 relative after 24
steps of training), which is a property of the host, not a change to the numerics. XLA's
platform-dependent math (faster code "at the expense of consistent results across CPUs", in its
flag's words) is off for the same reason: with it on, an AMD EPYC host with AVX-512 drifted from a
recording made elsewhere by 7e-5 relative after 24 steps, under the same ISA pin.
"""

import json
import os
import pathlib
import platform
import subprocess
import sys

import optax
import pytest

from ddiloco.data import text as text_data
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.metrics.writer import read_events
from ddiloco.models import configs
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig
from ddiloco.simulation.config import ClusterConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.syncer.core import SyncerConfig

pytestmark = pytest.mark.integration  # The run goes in a child process.

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "golden_tiny.json"
WRITE = os.environ.get("DDILOCO_WRITE_FIXTURE") == "1"
SEQ = 32
ROOT = pathlib.Path(__file__).resolve().parents[2]
# Read once, when each library starts: hence the child process.
_PINNED_ENV = {
  "XLA_FLAGS": (
    "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2 "
    "--xla_cpu_enable_platform_dependent_math=false"
  ),
  "JAX_PLATFORMS": "cpu",
  "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
  "OPENBLAS_CORETYPE": "Haswell",
  "OPENBLAS_NUM_THREADS": "1",
}


def _trajectory(workdir: str) -> dict:
  summary = simulate(
    workdir=workdir,
    run=RunConfig(
      model=configs.transformer_config("tiny", max_len=SEQ),
      data=text_data.TextDataConfig(seq_len=SEQ, batch_size=4),
      schedule=FragmentSchedule(num_fragments=4, period=4, overlap=1),
      syncer=SyncerConfig(outer_optimizer=lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)),
      inner_opt=train_step.InnerOptConfig(warmup_steps=2, decay_steps=24),
      service=ServiceConfig(uplink_codec="int8", downlink_codec="int4"),
      num_learners=3,
      steps_per_learner=24,
      eval_batches=2,
      eval_every_s=6.0,
      log_every=2,
    ),
    fleet=ClusterConfig(faults=("crash:1@3+2",)),
    tensorboard=False,
  )
  losses: dict[str, list] = {}
  for ev in read_events(workdir, "train"):
    losses.setdefault(str(ev["learner"]), []).append([ev["step"], ev["loss"]])
  return {
    "merges": summary["merges"],
    # JSON keys are strings: the same in the fixture and here.
    "quorum_size_counts": {str(k): v for k, v in summary["syncer"]["quorum_size_counts"].items()},
    "final_eval_loss": summary["final_eval_loss"],
    "evals": [loss for _, loss in summary["evals"]],
    "losses": losses,
  }


def _pinned_trajectory(tmp_path: pathlib.Path) -> dict:
  out = tmp_path / "trajectory.json"
  env = {**os.environ, **_PINNED_ENV}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  proc = subprocess.run(
    [sys.executable, __file__, str(tmp_path / "run"), str(out)],
    env=env,
    check=False,
    capture_output=True,
    text=True,
    timeout=600,  # subprocess.run kills the child when it runs over.
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.skipif(
  platform.machine() not in ("x86_64", "AMD64"),
  reason="the fixture is recorded with x86-64 AVX2 code paths",
)
def test_the_tiny_run_follows_its_golden_trajectory(tmp_path):
  got = _pinned_trajectory(tmp_path)
  if WRITE:
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(got, indent=1) + "\n")
    pytest.skip(f"wrote {FIXTURE}")
  want = json.loads(FIXTURE.read_text())
  assert got["merges"] == want["merges"]
  assert got["quorum_size_counts"] == want["quorum_size_counts"]
  assert sorted(got["losses"]) == sorted(want["losses"])
  for learner, points in want["losses"].items():
    steps = [s for s, _ in points]
    assert [s for s, _ in got["losses"][learner]] == steps, learner
    assert [x for _, x in got["losses"][learner]] == pytest.approx(
      [x for _, x in points], rel=1e-5
    ), learner
  assert got["evals"] == pytest.approx(want["evals"], rel=1e-5)
  assert got["final_eval_loss"] == pytest.approx(want["final_eval_loss"], rel=1e-5)


if __name__ == "__main__":  # The child of `_pinned_trajectory`: python golden_test.py WORKDIR OUT.
  pathlib.Path(sys.argv[2]).write_text(json.dumps(_trajectory(sys.argv[1])))
