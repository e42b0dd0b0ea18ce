"""Tests of ddiloco.checkpoint.version_log and of restores that take lost versions back from it."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.checkpoint.version_log import VersionLog
from ddiloco.fragments.digest import values_digest


def _values():
  return {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "h": np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16),
  }


def test_write_read_is_exact_for_every_dtype_and_keeps_two_versions(tmp_path):
  log = VersionLog(str(tmp_path))
  values = _values()
  digest = values_digest(values)
  for v in (3, 4, 5):
    log.write(0, v, values, digest)
  log.write(1, 1, values, digest)
  assert log.versions(0) == [4, 5]  # The newest two: the older one may be the journal's newest.
  assert log.versions(1) == [1]
  got = log.read(0, 5, digest)
  assert got is not None and sorted(got) == sorted(values)
  for k, v in values.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape
    np.testing.assert_array_equal(got[k], v)
  assert values_digest(got) == digest
  assert log.read(0, 3, digest) is None  # Removed.
  assert log.read(0, 5, "0" * 32) is None  # Another digest (the journal's) is never taken.
  assert log.bytes_written > 0


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip"])
def test_a_damaged_file_reads_as_missing(tmp_path, damage, caplog):
  log = VersionLog(str(tmp_path))
  values = _values()
  digest = values_digest(values)
  log.write(0, 1, values, digest)
  path = tmp_path / "0-1.npz"
  data = path.read_bytes()
  if damage == "truncate":
    path.write_bytes(data[: len(data) // 2])
  elif damage == "garbage":
    path.write_bytes(b"not a zip file at all")
  else:  # A flipped bit inside the stored values (npz is not compressed): the digest catches it.
    i = data.index(np.float32(5.0).tobytes())
    path.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])
  assert log.read(0, 1, digest) is None
  assert "version log" in caplog.text


def test_leftover_temporary_files_are_removed(tmp_path):
  (tmp_path / "0-7.npz.tmp").write_bytes(b"half")
  VersionLog(str(tmp_path))
  assert not (tmp_path / "0-7.npz.tmp").exists()


def test_a_write_that_fails_raises_and_leaves_no_file(tmp_path, monkeypatch):
  log = VersionLog(str(tmp_path))
  values = _values()

  def full_disk(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr("os.fsync", full_disk)
  with pytest.raises(OSError):
    log.write(0, 1, values, values_digest(values))
  monkeypatch.undo()
  assert sorted(p.name for p in tmp_path.iterdir()) == []
