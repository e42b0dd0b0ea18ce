"""An in-memory object store for tests of bucket workdirs (ddiloco/storage.py), with no network.

`fake_gcs()` registers fsspec's memory file system for the gs:// and gcs:// protocols, which is
where `etils.epath` sends gs:// paths when TensorFlow is absent, and empties it on entry and exit.
It stays registered for the rest of the process (epath keeps the file system it first finds), so
use it in test processes only:

  with fake_gcs() as objects:
    ddiloco.simulate(workdir="gs://bucket/run", ...)
    assert "/bucket/run/summary.json" in objects

Orbax checkpoints do not go through it (tensorstore has its own GCS driver).
"""

import contextlib
from collections.abc import Iterator

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FakeGcs(MemoryFileSystem):
  """fsspec's memory file system answering gs:// and gcs:// paths."""

  protocol = ("gs", "gcs")
  store: dict = {}  # Shared by every instance, as one bucket service.
  pseudo_dirs = [""]

  def __init__(self, *args, finalize_on_close=None, **kwargs):
    del finalize_on_close  # What epath passes the real GCS file system.
    super().__init__(*args, **kwargs)

  @classmethod
  def _strip_protocol(cls, path):
    for prefix in ("gs://", "gcs://"):
      if path.startswith(prefix):
        path = path[len(prefix) :]
    return super()._strip_protocol(path)


@contextlib.contextmanager
def fake_gcs() -> Iterator[dict]:
  """Serves gs:// from memory (module docstring); yields the objects ({"/bucket/path": file})."""
  for name in ("gs", "gcs"):
    fsspec.register_implementation(name, FakeGcs, clobber=True)
  FakeGcs.store.clear()
  FakeGcs.pseudo_dirs[:] = [""]
  try:
    yield FakeGcs.store
  finally:
    FakeGcs.store.clear()
    FakeGcs.pseudo_dirs[:] = [""]
