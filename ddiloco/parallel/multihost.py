"""The processes of one multi-host learner: start-up, the leader's broadcasts and host reads.

docs/algorithm.md §1: a learner is one data/tensor-parallel job on its own slice. On a pod slice that job spans
several hosts, one JAX process each (multi-controller JAX): the learner's mesh covers the global
devices of all its processes, its parameters and optimizer state are global arrays, and every process
must launch the same computations in the same order. This module holds the JAX side of that:

- `initialize` joins the processes (`jax.distributed.initialize`; on CPU the cross-process
  collectives go through gloo).
- `ProcessGroup.share` is the one channel from process 0 (the leader, the only process that talks to
  the syncer) to the others: a small int32 header gathered from every process (so any process may
  raise a flag, e.g. a stop request) and an optional byte payload broadcast from the leader. Bytes,
  not floats: `multihost_utils.broadcast_one_to_all` sums the leader's values with zeros, and
  -0.0 + 0.0 = +0.0 would change the bits the syncer's digests check (docs/algorithm.md §4.7).
- `ProcessGroup.gather` hands every process's bytes to every process (each process's data position
  for a learner checkpoint).
- `ProcessGroup.replicate` makes device arrays readable on every host (an all-gather of the leaves
  sharded across processes, a local copy of the rest): how the leader reads a due fragment.
- `GlobalBatches` turns the learner's host batches into global arrays, each process placing only
  the rows of its own devices.

Nothing here knows about syncers or gRPC (docs/architecture.md "Layers"); learner_process/multihost.py
drives the protocol on top of it.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LEADER = 0  # The process that talks to the syncer.
_MIN_PAYLOAD = 1024  # Smallest padded payload: payloads are padded to powers of two (few compiles).


def initialize(*, coordinator_address: str, num_processes: int, process_id: int) -> None:
  """Joins this process to its learner's processes; call before any other JAX work.

  Args:
    coordinator_address: "host:port" of the coordinator (served by process 0).
    num_processes: processes of this learner (>= 2).
    process_id: this process's index in [0, num_processes).

  Raises:
    ValueError: for fewer than two processes, an index out of range or no address.
  """
  if num_processes < 2:
    raise ValueError(f"A multi-process learner needs num_processes >= 2, got {num_processes}.")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}.")
  if not coordinator_address:
    raise ValueError("A multi-process learner needs a coordinator address (host:port).")
  # gloo carries CPU collectives across processes (the default in jax 0.10, stated for clarity);
  # TPU and GPU use their own interconnects and ignore this option.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )


@dataclasses.dataclass(frozen=True)
class Shared:
  """What `ProcessGroup.share` hands every process.

  Attributes:
    payload: the leader's bytes (b"" when it had none).
    value: the leader's integer.
    any_flag: True if any process raised its flag.
  """

  payload: bytes
  value: int
  any_flag: bool


class ProcessGroup:
  """This process's view of the learner's processes, with the learner's mesh.

  Every method that communicates (`share`, `gather`, `replicate`) must be called by every
  process, in the same order: callers keep that invariant (learner_process/multihost.py,
  checkpoint/learner.py).

  Args:
    mesh: the learner's mesh (over the global devices of all its processes).
  """

  def __init__(self, mesh: Mesh):
    self.mesh = mesh
    self.process_index = jax.process_index()
    self.num_processes = jax.process_count()
    self.is_leader = self.process_index == LEADER
    self._replicated = NamedSharding(mesh, PartitionSpec())
    # One jitted identity; out_shardings turns it into an all-gather where a leaf is sharded
    # across processes. Compiled once per fragment's leaf shapes.
    self._replicate = jax.jit(lambda xs: xs, out_shardings=self._replicated)

  def replicate(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Copies of `arrays`, fully replicated on the mesh: `jax.device_get` works on every host."""
    return list(self._replicate(list(arrays)))

  def share(self, payload: bytes = b"", *, value: int = 0, flag: bool = False) -> Shared:
    """The leader's payload and value, and whether any process raised its flag.

    One gather of a 3-int header; a second collective (a broadcast) only when the leader has bytes.
    Followers' `payload` and `value` are ignored.

    Args:
      payload: the leader's bytes.
      value: the leader's integer (an int32).
      flag: this process's flag.

    Returns:
      The shared result, identical on every process.

    Raises:
      ValueError: if `value` does not fit an int32.
    """
    if not -(2**31) <= value < 2**31:
      raise ValueError(f"value must fit an int32, got {value}.")
    mine = payload if self.is_leader else b""
    header = np.array([len(mine), value if self.is_leader else 0, int(flag)], np.int32)
    rows = np.asarray(multihost_utils.process_allgather(header)).reshape(self.num_processes, 3)
    size = int(rows[LEADER, 0])
    data = b""
    if size:
      padded = np.zeros(_padded_size(size), np.uint8)
      if self.is_leader:
        padded[:size] = np.frombuffer(mine, np.uint8)
      data = np.asarray(multihost_utils.broadcast_one_to_all(padded))[:size].tobytes()
    return Shared(payload=data, value=int(rows[LEADER, 1]), any_flag=bool(rows[:, 2].any()))

  def gather(self, payload: bytes) -> list[bytes]:
    """Every process's bytes, in process order, on every process (two all-gathers).

    How per-process state reaches the leader: e.g. each process's data iterator position, which a
    learner checkpoint stores for every process (checkpoint/learner.py).

    Args:
      payload: this process's bytes.

    Returns:
      `payload` of process 0, 1, ..., identical on every process.
    """
    sizes = np.asarray(multihost_utils.process_allgather(np.array([len(payload)], np.int32)))
    sizes = [int(s) for s in sizes.reshape(self.num_processes)]
    padded = np.zeros(_padded_size(max(sizes)), np.uint8)
    padded[: len(payload)] = np.frombuffer(payload, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(self.num_processes, -1)
    return [rows[i, :size].tobytes() for i, size in enumerate(sizes)]


def _padded_size(size: int) -> int:
  """The next power of two >= size (at least _MIN_PAYLOAD)."""
  return max(_MIN_PAYLOAD, 1 << (size - 1).bit_length())


class GlobalBatches:
  """Host batches of the whole learner -> global arrays placed on the learner's mesh.

  Every process reads the learner's whole batch (the same shard, the same order, so the learner
  trains on exactly the batches a one-process learner would) and places only the rows that its own
  devices hold (`jax.make_array_from_callback`). The train step's `put_batch` then leaves the
  arrays where they are. Checkpointable iterators keep their `get_state`/`set_state`.

  Args:
    data: the learner's host batches {name: array with the batch on axis 0}.
    sharding: the batch sharding of the learner's mesh.
  """

  def __init__(self, data: Iterator[dict[str, np.ndarray]], sharding: NamedSharding):
    self._data = data
    self._sharding = sharding

  def __iter__(self) -> "GlobalBatches":
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = next(self._data)
    return {k: self._place(np.asarray(v)) for k, v in batch.items()}

  def _place(self, full: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(full.shape, self._sharding, lambda index: full[index])

  def get_state(self) -> Any:
    return self._data.get_state()

  def set_state(self, state: Any) -> None:
    self._data.set_state(state)
