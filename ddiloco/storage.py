"""Where a program's outputs go: a local folder, or an object store (`gs://`, `s3://`) through
`etils.epath`.

A learner's or a simulation's workdir may be a bucket path. Three kinds of outputs go there:
- files written whole (`config.gin`, `summary.json`) are written through epath; on an object store
  an object appears whole or not at all, so no temporary name is needed;
- files appended to while the program runs (`metrics.jsonl`, TensorBoard events) cannot be
  appended to in an object store: they are written to a local staging folder (`Mirror`) and copied
  up as they grow (`Mirror.sync`, throttled) and at close, after which the staging folder is
  removed. A restarted program first copies down what is there, so it appends as it would locally;
- checkpoints go through orbax, which writes to bucket paths itself.

A local path is made absolute; a URI is kept as it is, so nothing named `gs:` is created in the
current folder. Reading a bucket needs the store's fsspec driver (`pip install 'ddiloco[gcs]'` for
`gs://`); tests register an in-memory one.

Not every program takes a bucket workdir: the syncer fsyncs its merge journal before it serves a
version, and the local launchers read their programs' files while they run. Both refuse a URI
with a one-line error (`require_local`); give them a local disk or a mounted bucket.
"""

import os
import shutil
import tempfile
import time

from etils import epath

_TAIL_BLOCK = 64 * 1024  # Bytes read at a time while looking for a file's last newline.


def is_remote(path: str | os.PathLike) -> bool:
  """Whether `path` names an object store (has a URI scheme such as gs://)."""
  return "://" in os.fspath(path)


def resolve(path: str | os.PathLike) -> str:
  """A local path made absolute, or a URI as it is."""
  path = os.fspath(path)
  return path if is_remote(path) else os.path.abspath(path)


def join(path: str, *parts: str) -> str:
  return (
    os.fspath(epath.Path(path).joinpath(*parts)) if is_remote(path) else os.path.join(path, *parts)
  )


def makedirs(path: str) -> None:
  """Creates the folder (on an object store: nothing to create until an object is written)."""
  epath.Path(path).mkdir(parents=True, exist_ok=True)


def exists(path: str) -> bool:
  return epath.Path(path).exists()


def glob(path: str, pattern: str) -> list[str]:
  """Paths in folder `path` matching `pattern` (none if the folder does not exist)."""
  folder = epath.Path(path)
  return sorted(os.fspath(p) for p in folder.glob(pattern)) if folder.exists() else []


def read_text(path: str) -> str:
  return epath.Path(path).read_text()


def write_text(path: str, text: str) -> None:
  """Writes a whole file so that readers see the old one or the new one, never half of one."""
  if is_remote(path):
    epath.Path(path).write_text(text)  # Objects are replaced whole.
    return
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def cut_partial_line(path: str, *, fsync: bool = False) -> int:
  """Truncates a local file after its last newline: drops the partial last line a writer that was
  killed mid-line left. Returns the number of bytes cut (0 for a missing or empty file).

  Args:
    path: the file.
    fsync: make the cut durable before returning.
  """
  if not os.path.exists(path):
    return 0
  with open(path, "rb+") as f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return 0
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return 0
    keep, end = 0, size
    while end > 0:  # Back from the end, a block at a time, to the last newline.
      start = max(0, end - _TAIL_BLOCK)
      f.seek(start)
      i = f.read(end - start).rfind(b"\n")
      if i >= 0:
        keep = start + i + 1
        break
      end = start
    f.truncate(keep)
    if fsync:
      f.flush()
      os.fsync(f.fileno())
  return size - keep


def require_local(path: str, *, who: str, why: str) -> None:
  """Raises ValueError (with `who` and `why`) if `path` is an object store URI."""
  if is_remote(path):
    raise ValueError(
      f"{who} needs a local or mounted folder, not {path}: {why}. Mount the bucket (e.g. with "
      "gcsfuse) and give its path."
    )


class Mirror:
  """A local staging folder for files appended to while a program runs, copied to `remote`.

  `local` is where the program writes. `sync` copies every file that changed since the last copy
  (at most every `every_s` seconds unless forced); `close` copies the rest and removes `local`.

  Args:
    remote: the object store folder (a URI).
    names: files to copy down first (if they exist there), so that appends continue them.
    every_s: the least time between two throttled syncs.
  """

  def __init__(self, remote: str, *, names: tuple[str, ...] = (), every_s: float = 30.0):
    self.remote = remote
    self.every_s = every_s
    self.local = tempfile.mkdtemp(prefix="ddiloco-mirror-")
    self._copied: dict[str, tuple[int, int]] = {}  # Relative path -> (size, mtime_ns) copied.
    self._last = time.monotonic()
    for name in names:
      src = epath.Path(remote) / name
      if src.exists():
        dest = os.path.join(self.local, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "wb") as f:
          f.write(src.read_bytes())
        self._copied[name] = self._stamp(dest)

  @staticmethod
  def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns

  def sync(self, *, force: bool = False) -> int:
    """Copies the changed files up; returns how many (0 when throttled)."""
    if not force and time.monotonic() - self._last < self.every_s:
      return 0
    self._last = time.monotonic()
    n = 0
    for folder, _, files in os.walk(self.local):
      for name in files:
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, self.local)
        stamp = self._stamp(path)
        if self._copied.get(rel) == stamp:
          continue
        dest = epath.Path(self.remote) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "rb") as f:
          dest.write_bytes(f.read())
        self._copied[rel] = stamp
        n += 1
    return n

  def close(self) -> None:
    """Copies what changed and removes the staging folder."""
    try:
      self.sync(force=True)
    finally:
      shutil.rmtree(self.local, ignore_errors=True)
