"""Taking a restored syncer back to where its lost incarnation was: versions republished past the
lost ones, lost versions taken back from a learner, fragments frozen meanwhile (docs/resilience.md)."""

from collections.abc import Mapping

import numpy as np

from ddiloco.syncer.closing import RoundCloser
from ddiloco.syncer.pacing import RoundPacer
from ddiloco.syncer.rounds import RoundTable
from ddiloco.syncer.versions import VersionStore


class FragmentRestore:
  """The restore operations on fragments (known to exist: the core checks them)."""

  def __init__(
    self, *, versions: VersionStore, rounds: RoundTable, pacer: RoundPacer, closer: RoundCloser
  ):
    self._versions = versions
    self._rounds = rounds
    self._pacer = pacer
    self._closer = closer

  def republish(self, p: int, version: int) -> None:
    """Publishes Θ_p's current values again as `version` (a restore, docs/resilience.md).

    A syncer restored from a checkpoint older than versions it had published before a kill moves
    past them, so that versions stay monotonic for every learner: a learner holding a lost version
    sees a newer one and pulls it. Kept versions stay (reports anchored at them still decode); the
    outer optimizer state and the open round are those of the checkpoint.

    Raises:
      ValueError: if `version` is not greater than the current version.
    """
    current = self._versions.version(p)
    if version <= current:
      raise ValueError(
        f"Republishing fragment {p} as version {version} needs a version > {current}."
      )
    self._versions.republish(p, version)
    # An open round moves to the republished version: the same values, which the learners now
    # fetch and answer against. Left at the old base, every answer would weigh 0 and p would never
    # merge again. Answers already in the round were made against these values too.
    if self._rounds.is_open(p):
      self._rounds[p].base_version = version

  def freeze(self, p: int) -> None:
    """Opens no more rounds of p until `unfreeze(p)`; an open round of p is closed, its answers
    dropped and counted (a restored syncer waiting to take a lost version back from a learner)."""
    self._pacer.freeze(p)
    if self._rounds.is_open(p):
      self._closer.drop_round(p)

  def recover(self, p: int, version: int, values: Mapping[str, np.ndarray], digest: str) -> None:
    """Takes `values` back as `version` of p: a version this syncer published, then lost in a kill.

    A restored syncer holds p at an older version than it had published (its checkpoint predates
    the newest merges); a learner still holds the newest, bit-identical, and the merge journal has
    its digest. If `values` have that digest, they become Θ_p at `version`: no merge is lost. The
    outer optimizer state stays the checkpoint's (the lost merges' momentum is not recovered). An
    open round of p is closed without a merge (its base moved).

    Raises:
      ValueError: if `version` is not newer than p's, the keys, shapes or dtypes differ, a value is
        not finite, or the values' digest is not `digest`. Nothing changes then.
    """
    copies = self._versions.checked_copies(p, version, values, digest)
    if self._rounds.is_open(p):
      self._closer.drop_round(p)
    self._versions.take_back(p, version, copies, digest)
