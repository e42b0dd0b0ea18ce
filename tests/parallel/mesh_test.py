"""Tests for ddiloco.parallel.mesh (8 fake CPU devices, set in tests/conftest.py)."""

import jax
import pytest

from ddiloco.parallel import mesh as mesh_lib


def test_default_mesh_is_all_data_parallel():
  mesh = mesh_lib.make_mesh()
  assert mesh.axis_names == ("data", "model")
  assert dict(mesh.shape) == {"data": 8, "model": 1}
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
  assert list(mesh.devices.flat) == jax.devices()


def test_model_parallel_mesh_layout():
  devices = jax.devices()
  mesh = mesh_lib.make_mesh(model_parallelism=4)
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  # CPU devices keep their order: row r of the mesh is devices[4r : 4r + 4].
  assert list(mesh.devices[0]) == devices[:4]
  assert list(mesh.devices[1]) == devices[4:]


def test_mesh_over_a_subset():
  devices = jax.devices()[2:6]
  mesh = mesh_lib.make_mesh(devices=devices, model_parallelism=2)
  assert dict(mesh.shape) == {"data": 2, "model": 2}
  assert sorted(d.id for d in mesh.devices.flat) == [d.id for d in devices]


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(model_parallelism=3), "does not divide the 8 devices"),
    (dict(model_parallelism=0), ">= 1"),
    (dict(model_parallelism=2.0), "must be an int"),
    (dict(devices=[]), "at least one device"),
  ],
)
def test_make_mesh_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mesh_lib.make_mesh(**kwargs)


def test_make_mesh_rejects_duplicate_devices():
  d = jax.devices()
  with pytest.raises(ValueError, match="duplicate"):
    mesh_lib.make_mesh(devices=[d[0], d[0]])


def test_learner_devices_are_disjoint_slices():
  devices = jax.devices()
  slices = [mesh_lib.learner_devices(i, 2) for i in range(4)]
  assert slices == [devices[0:2], devices[2:4], devices[4:6], devices[6:8]]
  assert len({d.id for s in slices for d in s}) == 8


def test_learner_devices_wrap_around():
  devices = jax.devices()
  # 8 devices / 2 per learner = 4 slots: learner 5 -> slot 1, learner 8 -> slot 0.
  assert mesh_lib.learner_devices(5, 2) == devices[2:4]
  assert mesh_lib.learner_devices(8, 2) == devices[0:2]
  # 8 // 3 = 2 slots, devices 6 and 7 unused: learner 3 -> slot 1 -> devices[3:6].
  assert mesh_lib.learner_devices(3, 3) == devices[3:6]
  # A whole-pool learner: every learner gets all devices.
  assert mesh_lib.learner_devices(7, 8) == devices


def test_learner_devices_explicit_pool():
  pool = jax.devices()[4:]
  assert mesh_lib.learner_devices(1, 1, pool) == [pool[1]]
  assert mesh_lib.learner_devices(6, 1, pool) == [pool[2]]  # 4 slots, 6 mod 4 = 2


@pytest.mark.parametrize(
  "index,per,match",
  [(-1, 2, "learner_index"), (0, 0, r"\[1, 8\]"), (0, 9, r"\[1, 8\]"), (0, 1.5, "must be an int")],
)
def test_learner_devices_errors(index, per, match):
  with pytest.raises(ValueError, match=match):
    mesh_lib.learner_devices(index, per)


def test_learner_mesh_from_learner_devices():
  mesh = mesh_lib.make_mesh(devices=mesh_lib.learner_devices(1, 4), model_parallelism=2)
  assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
