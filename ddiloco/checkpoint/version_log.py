"""The syncer's version log: the values of the newest published versions, durable before they are served.

The merge journal records each published version's digest; checkpoints hold whole states every few
seconds. A syncer killed between two checkpoints restores an older version of the fragments that
merged since, and the journal says which versions it lost. Learners hold bit-identical copies of
the versions they pulled and hand them back (`SyncerService.begin_recovery`), but a version
published an instant before the kill may have reached no learner yet, and a fleet that restarts
with the syncer holds nothing.

The version log closes that gap: for every version it records, it writes the fragment's values
(float32 or the tensors' own dtypes, as the core holds them) to `<directory>/<p>-<version>.npz`,
fsync'd with its folder entry, before the journal line and before any learner can see it. It keeps
the last two versions of each fragment: the newest may have been written without its journal line
when the kill came, and then the one before is the journal's newest. A restore takes the journal's
newest version back from the log when the digests agree (`restore_core`): zero merges lost. The
outer optimizer state stays the checkpoint's, as with a learner's hand-back.

Cost: one write of each merged fragment's values (its float32 bytes) per merge and two copies of
the model on disk. `SyncerCheckpointConfig.version_log = False` turns it off (the learners'
hand-back remains).
"""

import json
import logging
import os
import re
import zipfile
from collections.abc import Mapping

import ml_dtypes  # noqa: F401  (registers "bfloat16" etc. with np.dtype, as fragments/layout.py)
import numpy as np

from ddiloco.checkpoint.journal import fsync_dir
from ddiloco.fragments.digest import values_digest

log = logging.getLogger(__name__)

VERSION_LOG_DIR = "versions"
_NAME = re.compile(r"^(\d+)-(\d+)\.npz$")
_KEEP = 2  # Versions kept per fragment (see the module docstring).
# Member names no layout key can take (keys never start with "__").
_DIGEST = "__digest__"
_META = "__dtypes__"  # {key: [dtype name, shape]}


class VersionLog:
  """Durable copies of the newest published versions of each fragment (see the module docstring).

  Args:
    directory: its folder (created if missing); leftover temporary files of a write cut short are
      removed.
  """

  def __init__(self, directory: str):
    self.directory = directory
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
      if name.endswith(".tmp"):
        os.remove(os.path.join(directory, name))
    self.bytes_written = 0

  def _path(self, p: int, version: int) -> str:
    return os.path.join(self.directory, f"{p}-{version}.npz")

  def versions(self, p: int) -> list[int]:
    """The versions of fragment p on disk, oldest first."""
    out = []
    for name in os.listdir(self.directory):
      m = _NAME.match(name)
      if m and int(m.group(1)) == p:
        out.append(int(m.group(2)))
    return sorted(out)

  def write(self, p: int, version: int, values: Mapping[str, np.ndarray], digest: str) -> None:
    """Durably writes version `version` of p, then removes p's versions older than the last two.

    Raises:
      OSError: if the values could not be written and synced (a full disk): the caller must not
        serve the version.
    """
    path = self._path(p, version)
    tmp = path + ".tmp"
    arrays: dict[str, np.ndarray] = {}
    dtypes = {}
    for k, value in values.items():
      v = np.ascontiguousarray(value)
      dtypes[k] = [v.dtype.name, list(v.shape)]
      arrays[k] = v.reshape(-1).view(np.uint8)  # npz keeps no ml_dtypes type (bfloat16): raw bytes.
    arrays[_DIGEST] = np.array(digest)
    arrays[_META] = np.array(json.dumps(dtypes))
    try:
      with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
        self.bytes_written += f.tell()
      os.replace(tmp, path)
      fsync_dir(self.directory)
    except OSError:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
    for old in self.versions(p)[:-_KEEP]:
      os.remove(self._path(p, old))

  def read(self, p: int, version: int, digest: str) -> dict[str, np.ndarray] | None:
    """The logged values of version `version` of p if they are intact and have `digest`, else None
    (missing, unreadable or different: logged, never raised)."""
    return read_version(self.directory, p, version, digest)


def read_version(directory: str, p: int, version: int, digest: str) -> dict[str, np.ndarray] | None:
  """`VersionLog.read` without opening the log: nothing in `directory` is created or removed, so
  a running syncer's log can be read."""
  path = os.path.join(directory, f"{p}-{version}.npz")
  if not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as data:
      meta = json.loads(str(data[_META]))
      values = {k: data[k].view(np.dtype(name)).reshape(shape) for k, (name, shape) in meta.items()}
      recorded = str(data[_DIGEST])
  except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
    log.warning("version log: %s is unreadable (%s)", path, e)
    return None
  got = values_digest(values)
  if recorded != digest or got != digest:
    log.warning(
      "version log: %s has digest %s (recorded %s), not the journal's %s",
      path,
      got,
      recorded,
      digest,
    )
    return None
  return values
