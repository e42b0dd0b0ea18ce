"""A learner's parameters on its devices, reached by fragment: the kernel's one jax-aware collaborator.

`DeviceParams` does what the protocol's decisions (learner/kernel.py) need done on the devices:
read θ_p to the host, write Θ_p into the parameter leaves (whole, or rows of a split tensor),
snapshot θ_p for an answer's sender (learner/snapshot.py), read back and digest what an apply
wrote (docs/algorithm.md §4.7), and keep θ_p of the last step boundary readable while the next
step runs (donation and standby copies, docs/algorithm.md §3 "answers do not wait for the step in
flight").

Donation. The train step donates its input parameters, so an array a snapshot or a pending digest
check still reads must be kept: on GPU and TPU an answer's θ_p is copied on device (dispatched
asynchronously; `standby` copies before the step of the fragments the syncer will likely ask for
while it runs). XLA's CPU client runs a computation as cheap as a copy inline on the calling
thread, so there a copy waits for the step that makes θ_p and the training loop loses its step in
flight (bench_learner_overhead.py): on CPU a snapshot holds θ_p's arrays themselves
(`snapshot_by_reference`) and the next step keeps its input parameters (`before_step`). A digest
check is read back at once, or, with `defer_digests` on CPU (a learner process sets it), once
the written arrays are ready: the read-back waited there for the step in flight too.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.layout import FragmentLayout
from ddiloco.learner import writes
from ddiloco.learner.snapshot import FragmentSnapshot
from ddiloco.types import PyTree


class DigestCheck(NamedTuple):
  """An apply's digest check: Θ_p of `version` read back from the devices, and the syncer's."""

  fragment: int
  version: int
  digest: str  # What the devices held after the write.
  expected: str  # The syncer's digest of the version.

  @property
  def ok(self) -> bool:
    return self.digest == self.expected


class DeviceParams:
  """A learner's parameters on its devices (see module docstring).

  Args:
    params: the parameters, placed with `shardings`.
    shardings: each leaf's sharding (`CompiledSteps.param_shardings`).
    layout: the fragment layout.
    device_encode: where answers' δ is encoded on the devices (`LearnerConfig.device_encode`:
      "auto" on accelerators, "always", "never").
  """

  def __init__(
    self, params: PyTree, shardings: PyTree, layout: FragmentLayout, *, device_encode: str
  ):
    self.params = params
    self.layout = layout
    leaves, self._treedef = jax.tree_util.tree_flatten_with_path(params)
    self._index = {tree.path_str(path): i for i, (path, _) in enumerate(leaves)}
    self._shardings = jax.tree_util.tree_leaves(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    # The leaves each fragment touches (split tensors are keyed "path@start:stop"; docs/algorithm.md §2).
    self._leaf_names = [
      sorted({layout_lib.parse_key(k)[0] for k in keys}) for keys in layout.fragments
    ]
    # Makes device arrays readable on this host before a host copy. None (one process): they are.
    # A multi-process learner replicates them (a collective, so every process reads in the same
    # order): parallel/multihost.py ProcessGroup.replicate.
    self.host_readable: Callable[[list[jax.Array]], list[jax.Array]] | None = None
    devices = jax.tree_util.tree_leaves(params)[0].sharding.device_set if self._index else set()
    self.snapshot_by_reference = all(d.platform == "cpu" for d in devices)
    self.device_encode = device_encode == "always" or (
      device_encode == "auto" and not self.snapshot_by_reference
    )
    self.defer_digests = False
    self.applied_digest: dict[int, str] = {}  # p -> digest of Θ_p read back at its last apply.
    self._keep_params = False  # The next train step must not donate the parameters.
    self._in_flight: PyTree | None = None  # Parameters of the step dispatched and not landed.
    self._in_flight_kept = False  # That step keeps its input parameters readable.
    self._standby: dict[int, list[jax.Array]] = {}  # p -> θ_p copied before the step in flight.
    self._unverified: list[tuple[int, int, str, list[jax.Array]]] = []  # (p, v, expected, θ_p).
    self._verified: list[DigestCheck] = []

  # -- reading and writing --------------------------------------------------------------------

  def _readable(self, arrays: list[jax.Array]) -> list[jax.Array]:
    return arrays if self.host_readable is None else self.host_readable(arrays)

  def _arrays(self, p: int) -> list[jax.Array]:
    """The parameter arrays fragment p touches (`_leaf_names[p]` order)."""
    leaves = jax.tree_util.tree_leaves(self.params)
    return [leaves[self._index[k]] for k in self._leaf_names[p]]

  def _host(self, p: int, arrays: list[jax.Array]) -> dict[str, np.ndarray]:
    host = jax.device_get(self._readable(arrays))  # One transfer.
    return self.layout.select({k: np.asarray(v) for k, v in zip(self._leaf_names[p], host)}, p)

  def read(self, p: int) -> dict[str, np.ndarray]:
    """A host copy of θ_p, keyed as the layout keys it."""
    return self._host(p, self._arrays(p))

  def digest(self, p: int) -> str:
    """Digest of θ_p as the devices hold it now."""
    return values_digest(self.read(p))

  def write(self, p: int, values: dict[str, np.ndarray]) -> None:
    """Writes fragment p's `values` (whole leaves, or rows of a split one) into the parameters."""
    leaves = jax.tree_util.tree_leaves(self.params)
    whole = writes.leaf_values(
      values, leaves, self._index, lambda i: jax.device_get(self._readable([leaves[i]])[0])
    )
    # One batched transfer for the fragment's leaves: a device_put per leaf costs its Python
    # dispatch each (bench_learner_overhead.py).
    order = sorted(whole)
    placed = jax.device_put([whole[i] for i in order], [self._shardings[i] for i in order])
    for i, array in zip(order, placed):
      leaves[i] = array
    self.params = jax.tree_util.tree_unflatten(self._treedef, leaves)

  # -- the step in flight ---------------------------------------------------------------------

  @property
  def answers_mid_step(self) -> bool:
    """Whether rounds can be answered while a step runs (one process; a multi-process learner's
    processes must snapshot together, at boundaries)."""
    return self.host_readable is None

  @property
  def by_reference(self) -> bool:
    """Whether snapshots hold θ's arrays themselves instead of copies (one process on CPU)."""
    return self.snapshot_by_reference and self.host_readable is None

  @property
  def copies_standby(self) -> bool:
    """Whether `before_step` copies the `standby` fragments (θ is donated to the step)."""
    return self.answers_mid_step and not self.by_reference

  @property
  def step_in_flight(self) -> bool:
    return self._in_flight is not None

  def before_step(self, standby: Iterable[int], *, mid_step: bool) -> bool:
    """Prepares the next step's dispatch; returns whether it must keep its input parameters.

    Copies the `standby` fragments first where the step donates θ; keeps them all where a
    snapshot or a pending digest check reads them, or, on CPU, where rounds are answered while
    the step runs (`mid_step`).
    """
    self._standby = {}
    if self.copies_standby:
      for p in sorted(set(standby)):
        if not 0 <= p < self.layout.num_fragments:
          raise ValueError(f"Unknown fragment {p}; the layout has {self.layout.num_fragments}.")
        self._standby[p] = [jnp.copy(a) for a in self._arrays(p)]
    keep = self._keep_params or bool(self._unverified) or (mid_step and self.by_reference)
    self._keep_params = False
    return keep

  def dispatched(self, params: PyTree, *, kept: bool) -> None:
    """The step was dispatched: its new parameters are θ once it lands."""
    self._in_flight, self._in_flight_kept = params, kept

  def land(self) -> None:
    """The step in flight becomes θ."""
    self.params, self._in_flight = self._in_flight, None
    self._standby = {}

  def readable(self, p: int) -> bool:
    """Whether θ_p of the last boundary can be read now (always, but while a step that donated it
    runs: then only a standby copy can)."""
    if self._in_flight is None or p in self._standby:
      return True
    return self.by_reference and self._in_flight_kept

  def snapshot(self, p: int) -> FragmentSnapshot:
    """θ_p of the last boundary for an answer's sender, its host transfer started; θ_p stays on
    the devices (learner/snapshot.py), so the training loop never waits for it.

    Raises:
      RuntimeError: if θ_p cannot be read while this step runs (`readable`).
    """
    if not self.readable(p):
      raise RuntimeError(f"θ_{p} of the last step is not readable while this step runs.")
    if p in self._standby:  # Copied before the step in flight donated θ (`before_step`).
      copies = self._standby.pop(p)
    elif self.by_reference:
      copies = self._arrays(p)
      self._keep_params = True
    else:  # A multi-process learner's replication (host_readable) makes new arrays itself.
      copies = self._readable([jnp.copy(a) for a in self._arrays(p)])
    # With device encoding only δ's bytes come back. Not for a multi-process learner: a program
    # on its arrays would need every process, and only the leader sends.
    encode = self.device_encode and self.host_readable is None
    if not encode:
      for c in copies:
        c.copy_to_host_async()
    return FragmentSnapshot(self.layout, p, self._leaf_names[p], copies, device_encode=encode)

  # -- digest checks --------------------------------------------------------------------------

  def record_digest(self, p: int) -> str:
    """Reads θ_p back now and records its digest as the one applied (a load of global values)."""
    self.applied_digest[p] = self.digest(p)
    return self.applied_digest[p]

  def check(self, p: int, version: int, expected: str) -> None:
    """Queues the digest check of an apply that just wrote Θ_p (`verified`), read back at once
    or, deferred, from the very arrays written once they are ready (a carry or a mix is written
    over them next: the check still proves Θ_p's bits reached the devices)."""
    if self.defer_digests and self.by_reference:
      arrays = self._arrays(p)
      for a in arrays:
        a.copy_to_host_async()
      self._unverified.append((p, version, expected, arrays))
    else:
      self._verified.append(DigestCheck(p, version, self.record_digest(p), expected))

  def verified(self, anchor: Sequence[int], *, block: bool = False) -> list[DigestCheck]:
    """The digest checks made since the last call, in apply order. Deferred checks whose arrays
    are not ready yet wait for a later call unless `block`; one of a version still applied
    (`anchor[p]`) records its digest as the one applied."""
    out, self._verified = self._verified, []
    waiting = []
    for p, version, expected, arrays in self._unverified:
      if waiting or not (block or all(a.is_ready() for a in arrays)):
        waiting.append((p, version, expected, arrays))  # Later ones wait too: apply order.
        continue
      digest = values_digest(self._host(p, arrays))
      if anchor[p] == version:
        self.applied_digest[p] = digest
      out.append(DigestCheck(p, version, digest, expected))
    self._unverified = waiting
    return out
