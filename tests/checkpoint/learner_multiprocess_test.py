"""LearnerCheckpointer across the two processes of one learner (jax.distributed + gloo on CPU).

The test runs this file as two processes (2 fake CPU devices each, one 4-device mesh). They save two
steps of an optimizer-like state and of θ sharded across both processes, with a different data
position per process, then restore it (own), restore it as another learner (peer) and discard it
(fresh); process 0 reads θ back whole, as an export does. Each process writes what it saw to a JSON
file; the test compares them.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _child(process_id: int, port: int, root: str, out: str) -> None:
  """One process of learner 0 (then of learner 1 for the peer restore)."""
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
  )
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from ddiloco.checkpoint.learner import LearnerCheckpointConfig, LearnerCheckpointer
  from ddiloco.checkpoint.learner_params import read_params
  from ddiloco.parallel.multihost import ProcessGroup

  mesh = Mesh(np.array(jax.devices()), ("data",))
  sharded = NamedSharding(mesh, PartitionSpec("data"))
  replicated = NamedSharding(mesh, PartitionSpec())

  def state(step):  # Rows 0-3 live on process 0's devices, rows 4-7 on process 1's.
    mu = np.arange(32, dtype=np.float32).reshape(8, 4) * step
    return {
      "mu": jax.make_array_from_callback((8, 4), sharded, lambda i: mu[i]),
      "count": jax.make_array_from_callback((), replicated, lambda i: np.int32(step)),
    }

  target = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state(1)
  )
  group = ProcessGroup(mesh)

  def checkpointer(learner_id, init_from="own"):
    config = LearnerCheckpointConfig(
      directory=root, init_from=init_from, max_to_keep=3, save_params=True
    )
    return LearnerCheckpointer(
      config,
      learner_id=learner_id,
      workdir="unused",
      opt_target=target,
      layout_digest="layout",
      group=group,
    )

  def local_rows(tree):  # This process's rows of mu, and the count.
    shards = sorted(tree["mu"].addressable_shards, key=lambda s: s.index[0].start)
    return [np.asarray(s.data).tolist() for s in shards], int(tree["count"])

  seen = {}
  ckpt = checkpointer(0)
  for step in (5, 10):
    data = {"next_index": 100 * step + process_id}  # Each process its own position, ...
    if process_id == 1:
      data["note"] = "x" * 3000  # ... of another length (the gather pads to the longest).
    ledger = {"owner": process_id}  # The leader's is the learner's.
    ckpt.save(
      step,
      opt_state=state(step),
      data_state=data,
      tokens_trained=step,
      schedule_step=step,
      ledger=ledger,
      params={"w": state(step)["mu"]},
    )
  ckpt.close()
  seen["saved_rows"] = local_rows(state(10))
  if process_id == 0:  # No collective: one process reads every process's shards.
    theta = read_params(f"{root}/learner_0")
    seen["theta"] = {"step": theta.step, "w": theta.params["w"].tolist()}

  restored = checkpointer(0).restore()
  seen["own"] = {
    "from": restored.restored_from,
    "step": restored.step,
    "data": restored.data_state,
    "ledger": restored.ledger,
    "rows": local_rows(restored.opt_state),
  }
  peer = checkpointer(1, init_from="peer").restore()
  seen["peer"] = {"from": peer.restored_from, "step": peer.step, "data": peer.data_state}
  seen["peer"]["rows"] = local_rows(peer.opt_state)
  fresh = checkpointer(0, init_from="fresh")
  restored = fresh.restore()
  seen["fresh"] = {"from": restored.restored_from, "discarded": list(restored.discarded_steps)}
  seen["left"] = fresh.all_steps()
  with open(out, "w") as f:
    json.dump(seen, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_save_and_restore_one_learner_checkpoint(tmp_path):
  port = _free_port()
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "PYTHONPATH": ROOT,
  }
  procs, logs = [], []
  try:
    for i in range(2):
      logs.append(tmp_path / f"p{i}.log")
      with open(logs[-1], "w") as log:
        procs.append(
          subprocess.Popen(
            [
              sys.executable,
              __file__,
              str(i),
              str(port),
              str(tmp_path / "ck"),
              str(tmp_path / f"{i}.json"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
          )
        )
    for proc, log in zip(procs, logs):
      assert proc.wait(timeout=150) == 0, log.read_text()[-3000:]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
  seen = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
  for i, s in enumerate(seen):
    # Own: the newest step, this process's rows bit for bit, its own data position, the leader's
    # ledger (only process 0 writes the JSON item).
    assert s["own"]["from"] == "own:10" and s["own"]["step"] == 10
    assert s["own"]["rows"] == s["saved_rows"]
    assert s["own"]["data"] == {"next_index": 1000 + i, **({"note": "x" * 3000} if i else {})}
    assert s["own"]["ledger"] == {"owner": 0}
    # Peer (learner 1 has no checkpoint): learner 0's step 10, optimizer state only.
    assert s["peer"] == {"from": "peer:0:10", "step": 0, "data": None, "rows": s["saved_rows"]}
    # Fresh: both processes discarded the same steps.
    assert s["fresh"] == {"from": "fresh", "discarded": [5, 10]}
    assert s["left"] == []
  # Process 0 holds rows 0-3 (step 10: values 0, 10, ..., 150), process 1 rows 4-7 (160 ... 310).
  assert seen[0]["saved_rows"][0][0][0] == [0.0, 10.0, 20.0, 30.0]
  assert seen[1]["saved_rows"][0][0][0] == [160.0, 170.0, 180.0, 190.0]
  assert seen[0]["saved_rows"][1] == seen[1]["saved_rows"][1] == 10
  assert not [n for n in os.listdir(tmp_path / "ck" / "learner_0") if n[0].isdigit()]
  # θ of step 10 whole: both processes' rows, 0, 10, ..., 310.
  assert seen[0]["theta"] == {"step": 10, "w": (np.arange(32.0).reshape(8, 4) * 10).tolist()}


if __name__ == "__main__":
  _child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
