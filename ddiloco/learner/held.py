"""The versions of each fragment a learner holds: Θ_p as received, with its digest.

A held version serves twice (docs/algorithm.md §5): as the base a downlink delta of a newer
version decodes against, and as the anchor Θ_p^(anchor) an answer's outer gradient
δ = Θ^(anchor) − θ is formed against. This store is their one owner: the learner's kernel
(learner/kernel.py) owns it, reads an answer's anchor from it and prunes it at every apply and
load (a version older than the one applied is never a base or an anchor again); the learner's
link to the syncer (learner_process/link.py) is handed the same store, keeps every version it pulls
in it and reads the bases of its deltas and what a registration offers a restarted syncer from it.

The kernel is single-threaded. A learner process pulls on a thread of its own, so its link guards
the store with a lock (`guard`); the simulator's is never shared across threads and needs none.
"""

import contextlib
from collections.abc import Mapping

import numpy as np

from ddiloco.protocol import FragmentState


class HeldVersions:
  """Per fragment, the versions held: {version: Θ_p as received} and their digests.

  Args:
    num_fragments: P.
  """

  def __init__(self, num_fragments: int):
    self.num_fragments = num_fragments
    self._values: list[dict[int, Mapping[str, np.ndarray]]] = [{} for _ in range(num_fragments)]
    self._digests: list[dict[int, str]] = [{} for _ in range(num_fragments)]
    self._lock: contextlib.AbstractContextManager = contextlib.nullcontext()

  def guard(self, lock: contextlib.AbstractContextManager) -> None:
    """Guards every later call with `lock`: the store is shared with other threads."""
    self._lock = lock

  def keep(self, state: FragmentState) -> None:
    """Holds a received version of its fragment (a base and, once applied, an anchor)."""
    with self._lock:
      self._values[state.fragment][state.version] = state.values
      self._digests[state.fragment][state.version] = state.digest

  def get(self, p: int, version: int) -> Mapping[str, np.ndarray] | None:
    """Θ_p at `version` as received, or None if it is not held (or `version` < 0)."""
    if version < 0:
      return None
    with self._lock:
      return self._values[p].get(version)

  def values(self, p: int, version: int) -> Mapping[str, np.ndarray]:
    """Θ_p at `version` as received (a delta's base).

    Raises:
      KeyError: if that version is not held.
    """
    with self._lock:
      return self._values[p][version]

  def newest_held(self) -> dict[int, tuple[int, str]]:
    """{p: (the newest version held, its digest)} over the fragments that hold one."""
    with self._lock:
      return {
        p: (v, self._digests[p][v])
        for p, held in enumerate(self._values)
        if (v := max(held, default=-1)) >= 0
      }

  def versions(self, p: int) -> list[int]:
    """The versions of p held, oldest first."""
    with self._lock:
      return sorted(self._values[p])

  def forget_before(self, p: int, version: int) -> None:
    """Drops the versions of p older than `version` (never a base or an anchor again)."""
    with self._lock:
      for v in [v for v in self._values[p] if v < version]:
        del self._values[p][v]
        del self._digests[p][v]

  def clear(self) -> None:
    """Drops every version (a restarted learner holds none)."""
    with self._lock:
      for p in range(self.num_fragments):
        self._values[p].clear()
        self._digests[p].clear()
