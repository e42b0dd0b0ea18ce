"""Tests for a learner's orbax checkpoints (ddiloco/checkpoint/learner.py; docs/algorithm.md §6).

A one-block model (d=32) on the byte vocabulary with the real Shakespeare shard iterator. The
optimizer is clip -> AdamW with a schedule, so its state holds a count at `[1][2].count` (optax
`ScaleByScheduleState`) that equals the number of updates: a hand-checkable number after a restore.
"""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

from ddiloco.checkpoint import learner as ckpt_lib
from ddiloco.checkpoint import learner_params
from ddiloco.data import text as text_data
from ddiloco.fragments import tree
from ddiloco.learner import train_step
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning

L = 8
DATA = text_data.TextDataConfig(seq_len=L, batch_size=2)
DIGEST = "layout-digest"
ONE_BLOCK = {"num_layers": 1, "d_model": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64}


class _Tiny:
  """Compiled steps and initial params of the tiny model on the first `devices` devices."""

  def __init__(self, devices: int):
    cfg = configs.transformer_config("tiny", vocab_size=256, max_len=L, **ONE_BLOCK)
    model = transformer.Transformer(cfg)
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:devices])
    params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=L)
    self.host_params = jax.device_get(params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=1, decay_steps=50))
    self.steps = train_step.CompiledSteps(model, opt, mesh, abstract, shardings)
    self.target = ckpt_lib.abstract_opt_state(self.steps, self.params())

  def params(self):
    return jax.device_put(self.host_params, self.steps.param_shardings)

  def train(self, num_steps: int, *, shard: int = 0):
    """(params, opt_state, iterator) after `num_steps` steps on shard `shard` of 2."""
    it = text_data.make_train_iterator(DATA, shard_index=shard, num_shards=2)
    params = self.params()
    opt_state = self.steps.init_opt_state(params)
    for _ in range(num_steps):
      params, opt_state, _ = self.steps.train(params, opt_state, self.steps.put_batch(next(it)))
    return params, opt_state, it


@pytest.fixture(scope="module")
def one():
  return _Tiny(1)


@pytest.fixture(scope="module")
def two():
  return _Tiny(2)


def _count(opt_state) -> int:
  return int(opt_state[1][2].count)  # chain(clip, adamw): adamw = (adam, masked decay, schedule).


def _checkpointer(tiny, tmp_path, learner_id=0, *, root=True, **kwargs):
  kwargs.setdefault("save_every_steps", 2)
  config = ckpt_lib.LearnerCheckpointConfig(
    directory=str(tmp_path / "ckpt") if root else None, **kwargs
  )
  return ckpt_lib.LearnerCheckpointer(
    config,
    learner_id=learner_id,
    workdir=str(tmp_path / f"work_{learner_id}"),
    opt_target=tiny.target,
    layout_digest=DIGEST,
  )


def _save(ckpt, step, opt_state, it=None, tokens=0):
  return ckpt.save(
    step,
    opt_state=opt_state,
    data_state=None if it is None else it.get_state(),
    tokens_trained=tokens,
    schedule_step=step + 100,
  )


def _assert_tree_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_config_validation_and_directories(tmp_path):
  for bad in ({"save_every_steps": 0}, {"max_to_keep": 0}, {"init_from": "neighbour"}):
    with pytest.raises(ValueError):
      ckpt_lib.LearnerCheckpointConfig(**bad)
  own = ckpt_lib.LearnerCheckpointConfig()
  assert own.learner_directory(3, "/w/l3") == "/w/l3/checkpoints"
  shared = ckpt_lib.LearnerCheckpointConfig(directory="/runs/ck")
  assert shared.learner_directory(3, "/w/l3") == "/runs/ck/learner_3"


def test_save_restore_own_is_bit_equal_and_resumes_the_data(one, tmp_path):
  params, opt_state, it = one.train(5)
  ckpt = _checkpointer(one, tmp_path)
  assert (ckpt.due(4), ckpt.due(5)) == (True, False)  # save_every_steps = 2.
  assert _save(ckpt, 5, opt_state, it, tokens=5 * 2 * L)
  assert not _save(ckpt, 5, opt_state, it)  # A step is saved once.
  saved = jax.device_get(opt_state)
  expected_next = next(it)  # The 6th batch of shard 0: what must follow step 5.
  # Two more steps donate the saved buffers while the save may still be writing.
  for batch in (expected_next, next(it)):
    params, opt_state, _ = one.steps.train(params, opt_state, one.steps.put_batch(batch))
  ckpt.close()

  restored = _checkpointer(one, tmp_path).restore()
  assert restored.restored_from == "own:5"
  assert (restored.step, restored.tokens_trained) == (5, 5 * 2 * L)
  assert _count(restored.opt_state) == 5
  _assert_tree_equal(restored.opt_state, saved)
  restored_shardings = jax.tree.map(lambda x: x.sharding, restored.opt_state)
  assert jax.tree_util.tree_leaves(restored_shardings) == jax.tree_util.tree_leaves(
    one.steps.opt_shardings
  )
  fresh = text_data.make_train_iterator(DATA, shard_index=0, num_shards=2)
  fresh.set_state(restored.data_state)
  batch = next(fresh)
  np.testing.assert_array_equal(batch["inputs"], expected_next["inputs"])
  np.testing.assert_array_equal(batch["targets"], expected_next["targets"])


def test_due_and_max_to_keep(one, tmp_path):
  _, opt_state, _ = one.train(1)
  ckpt = _checkpointer(one, tmp_path, max_to_keep=2)
  for step in (2, 4, 6):
    assert ckpt.due(step)
    _save(ckpt, step, opt_state)
  ckpt.wait()
  assert ckpt.all_steps() == [4, 6]  # Step 2 was deleted when 6 landed (max_to_keep = 2).
  assert (ckpt.due(6), ckpt.due(7), ckpt.due(8)) == (False, False, True)
  assert ckpt.saved_steps == [2, 4, 6]
  ckpt.close()


def test_interrupted_save_leaves_the_previous_checkpoint_usable(one, tmp_path):
  _, opt_state, it = one.train(3)
  ckpt = _checkpointer(one, tmp_path)
  _save(ckpt, 2, opt_state, it)
  ckpt.close()
  own = ckpt.directory
  # A crash mid-save of step 4: orbax writes into "<step>.orbax-checkpoint-tmp" and renames it only
  # when complete. Leave a half-written one behind: the step-2 files minus the optimizer state.
  partial = os.path.join(own, "4.orbax-checkpoint-tmp")
  shutil.copytree(os.path.join(own, "2"), partial)
  shutil.rmtree(os.path.join(partial, "opt_state"))

  again = _checkpointer(one, tmp_path)
  assert again.latest_step() == 2
  restored = again.restore()
  assert restored.restored_from == "own:2"
  _assert_tree_equal(restored.opt_state, jax.device_get(opt_state))
  assert again.due(4)  # Step 4 can be saved again.
  _save(again, 4, opt_state, it)
  again.close()
  assert sorted(os.listdir(own)) == ["2", "4"]  # The new manager deleted the interrupted save.


def test_peer_restore_takes_the_newest_peer_onto_this_mesh(one, two, tmp_path):
  # Peers on a 2-device mesh: learner 1 saved steps 2 and 4, learner 2 saved step 3.
  _, opt4, _ = two.train(4, shard=1)
  peer1 = _checkpointer(two, tmp_path, learner_id=1)
  _save(peer1, 2, opt4)
  _save(peer1, 4, opt4)
  peer1.close()
  _, opt3, _ = two.train(3, shard=1)
  peer2 = _checkpointer(two, tmp_path, learner_id=2)
  _save(peer2, 3, opt3)
  peer2.close()

  for init_from in ("peer", "own"):  # "own" without an own checkpoint falls through to "peer".
    restored = _checkpointer(one, tmp_path, learner_id=0, init_from=init_from).restore()
    assert restored.restored_from == "peer:1:4"
    assert (restored.step, restored.tokens_trained, restored.data_state) == (0, 0, None)
    assert _count(restored.opt_state) == 4
    _assert_tree_equal(restored.opt_state, jax.device_get(opt4))
    device_sets = {frozenset(x.sharding.device_set) for x in jax.tree.leaves(restored.opt_state)}
    assert device_sets == {frozenset(jax.devices()[:1])}  # Re-sharded onto learner 0's mesh.

  fresh = _checkpointer(one, tmp_path, learner_id=0, init_from="fresh").restore()
  assert fresh == ckpt_lib.Restored("fresh")


def test_own_without_checkpoint_or_peers_is_fresh(one, tmp_path):
  # Without a shared directory a learner has no peers: own -> (no peer) -> fresh.
  restored = _checkpointer(one, tmp_path, root=False).restore()
  assert restored == ckpt_lib.Restored("fresh")


def test_peer_of_another_layout_is_skipped_and_own_of_another_layout_refused(one, tmp_path):
  _, opt_state, _ = one.train(1)
  other = ckpt_lib.LearnerCheckpointer(
    ckpt_lib.LearnerCheckpointConfig(directory=str(tmp_path / "ckpt")),
    learner_id=1,
    workdir=str(tmp_path),
    opt_target=one.target,
    layout_digest="another-layout",
  )
  _save(other, 2, opt_state)
  other.close()
  assert _checkpointer(one, tmp_path, learner_id=0).restore().restored_from == "fresh"
  with pytest.raises(ValueError, match="layout digest another-layout"):
    _checkpointer(one, tmp_path, learner_id=1).restore()


def test_starting_past_own_discards_own_checkpoints(one, tmp_path):
  _, opt_state, it = one.train(2)
  ckpt = _checkpointer(one, tmp_path)
  _save(ckpt, 2, opt_state, it)
  _save(ckpt, 4, opt_state, it)
  ckpt.close()
  again = _checkpointer(one, tmp_path, init_from="fresh")
  restored = again.restore()
  assert restored == ckpt_lib.Restored("fresh", discarded_steps=(2, 4))
  assert again.all_steps() == [] and again.due(2)
  again.close()


def test_params_are_saved_on_request_for_export_and_never_restored(two, tmp_path):
  params, opt_state, it = two.train(3)
  with_params = {"save_params": True}
  ckpt = _checkpointer(two, tmp_path, **with_params)
  with pytest.raises(ValueError, match="needs the learner's parameters"):
    _save(ckpt, 2, opt_state, it)
  assert ckpt.all_steps() == []  # Refused before anything was started.
  assert ckpt.save(
    3, opt_state=opt_state, data_state=it.get_state(), tokens_trained=48, schedule_step=3,
    params=params,
  )  # fmt: skip
  ckpt.close()
  assert sorted(os.listdir(f"{ckpt.directory}/3")) == [
    "_CHECKPOINT_METADATA", "commit_success.txt", "learner", "opt_state", "params",
  ]  # fmt: skip
  # What the learner held, gathered from its 2 devices; never what a restore returns.
  theta = learner_params.read_params(ckpt.directory)
  assert (theta.learner_id, theta.step, theta.tokens_trained) == (0, 3, 48)
  flat = tree.flatten(jax.device_get(params))
  assert theta.params.keys() == flat.keys()
  for k, v in flat.items():
    assert theta.params[k].dtype == v.dtype
    np.testing.assert_array_equal(theta.params[k], v, err_msg=k)
  for init_from, restored_from in (("own", "own:3"), ("peer", "peer:0:3")):
    learner_id = 0 if init_from == "own" else 1
    restored = _checkpointer(two, tmp_path, learner_id, init_from=init_from).restore()
    assert restored.restored_from == restored_from
    assert [f.name for f in dataclasses.fields(restored)] == [
      "restored_from", "step", "opt_state", "data_state", "tokens_trained", "discarded_steps",
      "ledger",
    ]  # fmt: skip
    _assert_tree_equal(restored.opt_state, jax.device_get(opt_state))


def test_a_checkpoint_without_params_restores_with_them_on_and_exports_nothing(one, tmp_path):
  _, opt_state, it = one.train(2)
  ckpt = _checkpointer(one, tmp_path)  # save_params off: params given or not, none are saved.
  ckpt.save(
    2, opt_state=opt_state, data_state=it.get_state(), tokens_trained=32, schedule_step=2,
    params=one.params(),
  )  # fmt: skip
  ckpt.close()
  assert "params" not in os.listdir(f"{ckpt.directory}/2")
  restored = _checkpointer(one, tmp_path, save_params=True).restore()
  assert (restored.restored_from, restored.tokens_trained) == ("own:2", 32)
  _assert_tree_equal(restored.opt_state, jax.device_get(opt_state))
  with pytest.raises(ValueError, match=r"holds no parameters: .*save_params = True"):
    learner_params.read_params(ckpt.directory)
  with pytest.raises(ValueError, match=r"has no checkpoint 4; it has steps \[2\]"):
    learner_params.read_params(ckpt.directory, step=4)
  with pytest.raises(FileNotFoundError, match="holds no learner checkpoint"):
    learner_params.read_params(str(tmp_path / "nothing"))
