"""Versions a restart lost: taken back from a learner holding them, or republished after a window.

A syncer restored from a checkpoint older than its merge journal lacks the newest versions it had
published. Such a fragment opens no rounds meanwhile (`SyncerCore.freeze`); a learner that
registers holding that version with the journal's digest is asked for it (RegisterResponse.recover)
and uploads it (Recover), and it becomes the fragment's version again: no merge is lost. A fragment
nobody handed back by the deadline is republished from the restored values past the journal's
version (versions never go back; the merges since the checkpoint are lost).
"""

import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from ddiloco.service.publication import Publisher
from ddiloco.syncer.core import MergeEvent, SyncerCore

log = logging.getLogger(__name__)


class Recovery:
  """The fragments waiting to be handed back, and those handed back or republished.

  Not thread-safe: the service calls it under its lock.

  Args:
    core: the syncer core (frozen fragments, `recover`, `republish`).
    publisher: serves a version taken back or republished (and makes the latter durable).
    clock: the service's clock.
    on_recovery: called with (fragment, version, "recovered" | "republished").
  """

  def __init__(
    self,
    core: SyncerCore,
    publisher: Publisher,
    clock: Callable[[], float],
    on_recovery: Callable[[int, int, str], None] | None,
  ):
    self._core = core
    self._publisher = publisher
    self._clock = clock
    self._on_recovery = on_recovery
    # Fragments a restart left behind the versions it had published ({p: (version, digest)}), to be
    # taken back from a learner holding them until `_deadline` (`begin`).
    self._recovering: dict[int, tuple[int, str]] = {}
    self._deadline = 0.0
    self._recovered: list[int] = []  # Fragments taken back from learners.
    self._republished: list[int] = []  # Fragments republished when no learner had them.

  def begin(self, lost: Mapping[int, tuple[int, str]], window_s: float) -> None:
    """Freezes each lost fragment ({fragment: (version, digest)}) and waits `window_s` for it."""
    for p, (version, digest) in lost.items():
      self._core.freeze(p)
      self._recovering[int(p)] = (int(version), str(digest))
    self._deadline = self._clock() + max(window_s, 0.0)
    if self._recovering:
      log.warning(
        "syncer restored behind the journal for fragments %s: asking the learners for them "
        "for %.0f s",
        sorted(self._recovering),
        window_s,
      )

  def deadline(self) -> float | None:
    """When the fragments still waiting are republished; None if none waits."""
    return self._deadline if self._recovering else None

  def wanted(self, p: int) -> tuple[int, str] | None:
    """The (version, digest) of p still waiting to be handed back, or None."""
    return self._recovering.get(p)

  def asked(self, held: Iterable) -> list[int]:
    """The fragments of a registering learner's `held` (fragment, version, digest) to ask back."""
    # It holds a version a restart lost, with the journal's digest: ask for it back.
    return sorted(
      {
        int(h.fragment)
        for h in held
        if self._recovering.get(int(h.fragment)) == (int(h.version), h.digest)
      }
    )

  def take_back(self, p: int, version: int, values: Mapping[str, np.ndarray]) -> None:
    """Makes a learner's copy of p's wanted `version` the fragment's version again, served.

    Raises:
      ValueError: the values are not the journal's version (`SyncerCore.recover`).
    """
    digest = self._recovering[p][1]
    self._core.recover(p, version, values, digest)
    del self._recovering[p]
    self._core.unfreeze(p)
    self._recovered.append(p)
    self._publisher.serve_version(p, version, digest)  # Journaled before the restart.
    if self._on_recovery is not None:
      self._on_recovery(p, version, "recovered")

  def end_if_due(self) -> None:
    """At the deadline, republishes every fragment no learner handed back."""
    if self._recovering and self._clock() >= self._deadline:
      self._end()

  def summary(self) -> dict[str, list[int]]:
    """Fragments still waiting to be handed back, handed back, and republished without."""
    return {
      "waiting": sorted(self._recovering),
      "recovered": list(self._recovered),
      "republished": list(self._republished),
    }

  def _end(self) -> None:
    """Republishes every fragment no learner handed back."""
    for p, (version, _) in sorted(self._recovering.items()):
      new = version + 1
      self._core.republish(p, new)
      state = self._core.state(p)
      event = MergeEvent(
        fragment=p,
        version=new,
        time=self._clock(),
        contributors=(),
        weights=(),
        tokens=0,
        open_time=self._clock(),
        quorum_time=self._clock(),
        grace_s=0.0,
        digest=state.digest,
      )
      if not self._publisher.record_republished(event):
        return
      log.warning(
        "no learner handed back version %d of fragment %d: republished as %d from the "
        "restored values",
        version,
        p,
        new,
      )
      del self._recovering[p]
      self._core.unfreeze(p)
      self._republished.append(p)
      self._publisher.serve_version(p, new, state.digest)
      if self._on_recovery is not None:
        self._on_recovery(p, new, "republished")
