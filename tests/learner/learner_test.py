"""Tests for the learner's side of the fragment protocol (SPEC §3), with hand-built merges."""

import jax
import numpy as np
import pytest

from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.learner import Learner, LearnerConfig
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.syncer.core import FragmentState, ReportResult

B, L, V = 2, 8, 32


def _learner(*, num_fragments=2, period=4, overlap=1, config=None, split_large=False):
  cfg = configs.transformer_config("tiny", vocab_size=V, max_len=L)
  model = transformer.Transformer(cfg)
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=L)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt = train_step.make_inner_optimizer(train_step.InnerOptConfig(warmup_steps=1, decay_steps=20))
  steps = train_step.CompiledSteps(model, opt, mesh, abstract, shardings)
  flat = {k: np.asarray(v) for k, v in tree.flatten(jax.device_get(params)).items()}
  layout = layout_lib.make_layout(flat, num_fragments=num_fragments, split_large=split_large)
  schedule = FragmentSchedule(num_fragments=num_fragments, period=period, overlap=overlap)
  learner = Learner(
    learner_id=0, steps=steps, params=params, layout=layout, schedule=schedule, config=config
  )
  states = [_state(layout.select(flat, p), p, 0) for p in range(num_fragments)]
  learner.load_global(states)
  return learner, layout


def _state(values, p, version):
  return FragmentState(fragment=p, version=version, values=values, digest=values_digest(values))


def _batch(seed):
  x = np.random.default_rng(seed).integers(0, V, size=(B, L + 1), dtype=np.int32)
  return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def _ok():
  return ReportResult(status="accepted", reason="", weight=1.0)


def test_counters_and_due_schedule():
  learner, _ = _learner()  # P=2, H=4: offsets 0, 2 -> fragment 1 due at t=2, 6; fragment 0 at t=4.
  due = {}
  for t in range(1, 7):
    learner.train_step(_batch(t))
    due[t] = learner.due()
  assert due == {1: (), 2: (1,), 3: (), 4: (0,), 5: (), 6: (1,)}
  assert list(learner.tokens) == [6 * B * L, 6 * B * L]
  assert list(learner.step_counts) == [6, 6]


def test_report_carries_host_copy_counters_and_anchor():
  learner, layout = _learner()
  for t in range(2):
    learner.train_step(_batch(t))
  report = learner.make_report(1, step_time_s=0.5)
  assert (report.fragment, report.tokens, report.steps, report.anchor_version, report.step) == (
    1,
    2 * B * L,
    2,
    0,
    2,
  )
  assert set(report.values) == set(layout.fragments[1])
  host = learner.fragment_values(1)
  for k, v in report.values.items():
    np.testing.assert_array_equal(v, host[k])


def _sent_and_merged(learner):
  """Two steps, fragment 1 sent at step 2 (apply step 3) and accepted, version 1 received."""
  for t in range(2):
    learner.train_step(_batch(t))
  report = learner.make_report(1)
  learner.on_report_result(1, _ok())
  merged = {k: np.full_like(v, 0.25) for k, v in report.values.items()}
  learner.receive(_state(merged, 1, 1))
  return merged


def test_apply_waits_for_overlap_then_resets_counters():
  learner, _ = _learner(overlap=1)
  merged = _sent_and_merged(learner)
  assert learner.apply_ready() == []  # Step 2 < apply step 3.
  learner.train_step(_batch(3))
  assert learner.apply_ready() == [(1, 1)]
  assert learner.anchor[1] == 1
  assert learner.digest_of(1) == values_digest(merged)  # Bit-identical to what was published.
  assert (learner.tokens[1], learner.step_counts[1]) == (0, 0)
  assert learner.step_counts[0] == 3  # The other fragment's counters keep running.


@pytest.mark.parametrize("defer", [False, True], ids=["at_once", "deferred"])
def test_apply_digests_are_checked_in_order_at_once_or_when_ready(defer):
  learner, _ = _learner(overlap=1)
  learner.defer_digests = defer  # A learner process defers on CPU (LearnerWorker).
  merged = _sent_and_merged(learner)
  learner.train_step(_batch(3))
  assert learner.apply_ready() == [(1, 1)]
  if defer:  # Read back later, from the very arrays written: the next step must keep them.
    (_, _, written) = learner._unverified[0]
    learner.train_step(_batch(4))  # Would donate them without the deferred check.
    assert not any(a.is_deleted() for a in written)
    assert learner.step_counts[1] == 1  # Training went on after the apply.
  checked = learner.verified_applies(block=True)
  assert checked == [(1, 1, values_digest(merged))]  # What was written, not what trained since.
  assert learner.verified_applies(block=True) == []  # Each check is handed out once.
  assert learner.applied_digest[1] == values_digest(merged)


def test_late_report_keeps_counters_growing():
  learner, _ = _learner(overlap=1)
  for t in range(2):
    learner.train_step(_batch(t))
  report = learner.make_report(1)
  learner.on_report_result(1, ReportResult(status="late", reason="merged already", weight=0.0))
  learner.receive(_state({k: v * 0 for k, v in report.values.items()}, 1, 1))
  learner.train_step(_batch(3))
  assert learner.apply_ready() == [(1, 1)]
  assert learner.step_counts[1] == 3


def test_version_without_outstanding_send_is_held():
  learner, layout = _learner()
  learner.train_step(_batch(0))
  values = {k: np.zeros(layout.shapes[k], layout.dtypes[k]) for k in layout.fragments[0]}
  learner.receive(_state(values, 0, 3))
  learner.train_step(_batch(1))
  assert learner.apply_ready() == []  # Fragment 0 not sent yet: held until its send + τ.
  assert learner.anchor[0] == 0


def test_blocking_learner_waits_for_newer_version():
  learner, _ = _learner(overlap=1, config=LearnerConfig(blocking=True))
  for t in range(2):
    learner.train_step(_batch(t))
  report = learner.make_report(1)
  learner.on_report_result(1, _ok())
  assert not learner.blocked()
  learner.train_step(_batch(2))
  assert learner.blocked()
  learner.receive(_state(dict(report.values), 1, 1))
  assert not learner.blocked()
  assert learner.apply_ready() == [(1, 1)]


def test_mixing_alpha():
  learner, _ = _learner(overlap=1, config=LearnerConfig(mixing_alpha=0.5))
  for t in range(2):
    learner.train_step(_batch(t))
  report = learner.make_report(1)
  learner.on_report_result(1, _ok())
  mine = learner.fragment_values(1)
  zeros = {k: np.zeros_like(v) for k, v in report.values.items()}
  learner.receive(_state(zeros, 1, 1))
  learner.train_step(_batch(2))
  after_step = learner.fragment_values(1)
  learner.apply_ready()
  got = learner.fragment_values(1)
  for k in got:  # θ ← 0.5·0 + 0.5·θ
    np.testing.assert_allclose(got[k], 0.5 * after_step[k], rtol=1e-6)
  assert mine  # The fragment is not empty.


def test_align_phase_moves_the_schedule_not_the_step():
  learner, _ = _learner()  # P=2, H=4: fragment 1 due at schedule steps 2, 6, ...; fragment 0 at 4.
  learner.train_step(_batch(0))
  learner.align_phase(5)  # The fleet is at step 5: the next step is the fleet's 6th.
  learner.train_step(_batch(1))
  assert (learner.step, learner.schedule_step, learner.due()) == (2, 6, (1,))
  report = learner.make_report(1)
  assert report.step == 6


def test_split_tensors_round_trip_through_the_learner():
  """With split_large, a fragment holds row ranges of big tensors: reading and writing them back
  must touch exactly those rows (SPEC §2 decision)."""
  learner, layout = _learner(num_fragments=24, period=24, split_large=True)
  pieces = [k for frag in layout.fragments for k in frag if "@" in k]
  assert pieces  # The MLP kernels (128 x 512) are larger than total / 24.
  p = layout.fragment_of(pieces[0])
  before = {q: learner.fragment_values(q) for q in range(layout.num_fragments)}
  new = {k: np.full_like(v, 0.5) for k, v in before[p].items()}
  learner.load_global([_state(new, p, 1)])
  for q in range(layout.num_fragments):
    got = learner.fragment_values(q)
    want = new if q == p else before[q]
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert learner.digest_of(p) == values_digest(new)


def test_follow_jumps_forward_and_holds_without_sending_twice():
  learner, _ = _learner(num_fragments=4, period=4)  # P = H = 4: fragment s mod 4 due at step s.
  sent = []
  for t in range(1, 4):
    learner.train_step(_batch(t))
    sent.append((learner.schedule_step, learner.due()))
  assert sent == [(1, (1,)), (2, (2,)), (3, (3,))]
  # 3 steps behind the cadence: jump to it (the sends of schedule steps 4..5 are skipped).
  assert learner.follow(6, tolerance=3) == 3
  assert (learner.schedule_step, learner.due()) == (6, (2,))
  # 1 step off: within tolerance, nothing moves.
  assert learner.follow(7, tolerance=3) == 0
  # Ahead by 3: hold for one step; the held step sends nothing, the next one sends its fragment.
  learner.train_step(_batch(9))
  assert learner.schedule_step == 7
  assert learner.follow(4, tolerance=3) == -1
  assert (learner.schedule_step, learner.due()) == (6, ())
  learner.train_step(_batch(10))
  assert (learner.schedule_step, learner.due()) == (7, (3,))
  assert learner.step == 5


@pytest.mark.parametrize("by_reference", [True, False], ids=["by_reference", "device_copy"])
def test_snapshot_report_survives_donation_and_matches_make_report(by_reference):
  learner, _ = _learner()
  assert learner.snapshot_by_reference  # The default on CPU devices.
  learner.snapshot_by_reference = by_reference  # False: the GPU/TPU path, an on-device copy.
  learner.train_step(_batch(1))
  report, fetch = learner.snapshot_report(1, step_time_s=0.5)
  assert report.values == {} and report.step_time_s == 0.5 and report.anchor_version == 0
  expected = learner.fragment_values(1)
  before = jax.tree_util.tree_leaves(learner.params)
  learner.train_step(_batch(2))  # Would donate the parameters the snapshot was taken from.
  # By reference, that step kept its input parameters (the second compiled variant); the next
  # one donates again.
  # (XLA aliases, so JAX deletes, only the donated buffers an output can reuse: not all of them.)
  assert any(x.is_deleted() for x in before) == (not by_reference)
  assert learner.steps.train_cache_size() == (2 if by_reference else 1)
  kept = jax.tree_util.tree_leaves(learner.params)
  learner.train_step(_batch(3))
  assert any(x.is_deleted() for x in kept)
  values = fetch()
  assert set(values) == set(expected)
  assert all(np.array_equal(values[k], expected[k]) for k in expected)
  assert not all(np.array_equal(values[k], v) for k, v in learner.fragment_values(1).items())
