"""ProcessGroup, GlobalBatches and initialize: in this process (8 fake CPU devices) and across two.

The two-process test starts two Python processes with 2 fake CPU devices each, joined by
`jax.distributed` (gloo), and checks the primitives a multi-process learner relies on: the leader's
bytes arrive bit-exact (a -0.0 that a float broadcast would turn into +0.0), any process's flag
reaches all, an array sharded across the processes becomes readable on both, and a batch placed
from each process's rows is the whole batch.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import multihost, partitioning

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"coordinator_address": "127.0.0.1:1", "num_processes": 1, "process_id": 0}, ">= 2"),
    ({"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 2}, r"\[0, 2\)"),
    ({"coordinator_address": "", "num_processes": 2, "process_id": 0}, "coordinator"),
  ],
)
def test_initialize_validates_before_joining(kwargs, match):
  with pytest.raises(ValueError, match=match):
    multihost.initialize(**kwargs)


@pytest.mark.parametrize("size, padded", [(1, 1024), (1024, 1024), (1025, 2048), (5000, 8192)])
def test_payloads_pad_to_powers_of_two(size, padded):
  assert multihost._padded_size(size) == padded


def test_one_process_is_its_own_leader():
  group = multihost.ProcessGroup(mesh_lib.make_mesh())
  assert (group.process_index, group.num_processes, group.is_leader) == (0, 1, True)
  assert group.share(b"abc", value=7) == multihost.Shared(b"abc", 7, False)
  assert group.share(flag=True) == multihost.Shared(b"", 0, True)
  with pytest.raises(ValueError, match="int32"):
    group.share(value=2**31)


def test_replicate_makes_sharded_arrays_whole_everywhere():
  mesh = mesh_lib.make_mesh(model_parallelism=4)  # (2, 4) over the 8 devices.
  x = jax.device_put(
    np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh, PartitionSpec(None, "model"))
  )
  assert not x.is_fully_replicated
  (y,) = multihost.ProcessGroup(mesh).replicate([x])
  assert y.is_fully_replicated
  assert y.addressable_shards[0].data.shape == (4, 8)  # Each device holds all 32 values.
  np.testing.assert_array_equal(np.asarray(y), np.arange(32).reshape(4, 8))


class _Counting:
  def __init__(self):
    self.k, self.state = 0, None

  def __next__(self):
    self.k += 1
    return {"inputs": np.arange(16 * 3).reshape(16, 3) + self.k, "targets": np.ones((16, 3))}

  def get_state(self):
    return {"k": self.k}

  def set_state(self, state):
    self.state = state


def test_global_batches_places_each_devices_rows():
  mesh = mesh_lib.make_mesh(model_parallelism=2)  # "data" axis of 4: 16 rows -> 4 per device.
  sharding = partitioning.batch_sharding(mesh)
  source = _Counting()
  batches = multihost.GlobalBatches(source, sharding)
  batch = next(iter(batches))
  x = batch["inputs"]
  assert x.sharding == sharding and x.shape == (16, 3)
  np.testing.assert_array_equal(np.asarray(x), np.arange(48).reshape(16, 3) + 1)
  for shard in x.addressable_shards:
    rows = shard.index[0]
    assert rows.stop - rows.start == 4
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[rows])
  assert batches.get_state() == {"k": 1}
  batches.set_state({"k": 5})
  assert source.state == {"k": 5}


_CHILD = textwrap.dedent(
  """
  import json, sys
  import jax, numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from ddiloco.parallel import multihost
  pid, address = int(sys.argv[1]), sys.argv[2]
  multihost.initialize(coordinator_address=address, num_processes=2, process_id=pid)
  mesh = Mesh(np.array(jax.devices()).reshape(4, 1), ("data", "model"))
  group = multihost.ProcessGroup(mesh)
  floats = np.array([-0.0, 1.5, -2.25], np.float32)
  leader = group.share(floats.tobytes() if pid == 0 else b"ignored", value=41 + pid)
  follower_flag = group.share(flag=pid == 1)
  got = np.frombuffer(leader.payload, np.float32)
  rows = NamedSharding(mesh, PartitionSpec("data"))  # Rows 0-1 on process 0, 2-3 on process 1.
  x = jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), rows)
  (whole,) = group.replicate([x])
  batch = next(multihost.GlobalBatches(iter([{"t": np.arange(8).reshape(8, 1)}]), rows))["t"]
  local_rows = sorted(int(v) for s in batch.addressable_shards for v in np.asarray(s.data).ravel())
  print(json.dumps({
    "signbits": np.signbit(got).tolist(), "values": got.tolist(), "value": leader.value,
    "flag": leader.any_flag, "follower_flag": follower_flag.any_flag,
    "readable": x.is_fully_addressable, "whole": np.asarray(whole).ravel().tolist(),
    "local_rows": local_rows, "batch_shape": list(batch.shape),
  }))
  """
)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.timeout(180)
@pytest.mark.integration
def test_two_processes_share_replicate_and_place_batches(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  address = f"127.0.0.1:{_free_port()}"
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), str(i), address],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
      cwd=ROOT,
      start_new_session=True,
    )
    for i in range(2)
  ]
  try:
    outs = [p.communicate(timeout=150) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
  results = []
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  for r in results:
    assert r["signbits"] == [True, False, True]  # -0.0 kept its sign: bytes, not a float sum.
    assert r["values"] == [-0.0, 1.5, -2.25]
    assert r["value"] == 41  # The leader's (process 1 passed 42).
    assert r["flag"] is False and r["follower_flag"] is True
    assert r["readable"] is False
    assert r["whole"] == list(range(8))
    assert r["batch_shape"] == [8, 1]
  # Each process placed only its devices' rows: 4 of the 8, process 0 the first half.
  assert results[0]["local_rows"] == [0, 1, 2, 3]
  assert results[1]["local_rows"] == [4, 5, 6, 7]
