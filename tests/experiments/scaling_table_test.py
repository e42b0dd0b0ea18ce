"""Tests of the scaling table's plan and report helpers on a synthetic store (nothing trains)."""

import importlib
import os
import sys

import pytest
from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXPERIMENTS = os.path.join(ROOT, "experiments")


@pytest.fixture(scope="module")
def st():
  """experiments/scaling_table.py with its command-line flags on a private FlagValues, so that
  importing it defines no flag of this process (a launcher's --workdir, say)."""
  private = flags.FlagValues()
  patch = pytest.MonkeyPatch()
  for name in dir(flags):
    define = getattr(flags, name)
    if name.startswith("DEFINE_") and callable(define):

      def bound(*args, _define=define, **kwargs):
        kwargs.setdefault("flag_values", private)
        return _define(*args, **kwargs)

      patch.setattr(flags, name, bound)
  patch.syspath_prepend(EXPERIMENTS)
  try:
    module = importlib.import_module("scaling_table")
  finally:
    patch.undo()
  yield module
  sys.modules.pop("scaling_table", None)


def _result(system, seed, loss, curve=None, tokens=1000):
  return {
    "config": system.signature(seed),
    "final_eval_loss": loss,
    "curve": curve or [[0.0, tokens, loss]],
    "tokens_trained": tokens,
  }


@pytest.fixture()
def store(st, tmp_path):
  return st.study.ResultStore(str(tmp_path / "store.json"))


def _put(st, store, system, seed, loss, **kw):
  store.put(system, seed, _result(system, seed, loss, **kw))


def test_importing_defines_no_flag_of_this_process(st):
  assert "tier" not in flags.FLAGS
  assert st.STUDY == "scaling_table"


def test_sweep_walks_the_grid_towards_the_lower_loss(st, store):
  # M = 4 starts at 0.4 and 0.7; 0.4 wins, at the low edge: 0.2 is added.
  assert st.sweep_of(store, 4) == [0.4, 0.7]
  _put(st, store, st.diloco(4, 0.4), 0, 1.40)
  assert st.best_lr(store, 4) is None  # 0.7 not run yet.
  _put(st, store, st.diloco(4, 0.7), 0, 1.45)
  assert st.sweep_of(store, 4) == [0.2, 0.4, 0.7]
  assert st.best_lr(store, 4) is None
  # 0.2 is worse: the best is inside the values run, the sweep stops.
  _put(st, store, st.diloco(4, 0.2), 0, 1.42)
  assert st.sweep_of(store, 4) == [0.2, 0.4, 0.7]
  assert st.best_lr(store, 4) == 0.4


def test_sweep_stops_at_the_grid_end(st, store):
  # M = 1 starts at 0.2 and 0.4; lower is better all the way down to the grid's 0.05.
  for lr, loss in ((0.2, 1.3), (0.4, 1.4), (0.1, 1.2), (0.05, 1.1)):
    _put(st, store, st.diloco(1, lr), 0, loss)
  assert st.sweep_of(store, 1) == [0.05, 0.1, 0.2, 0.4]
  assert st.best_lr(store, 1) == 0.05


def test_best_diloco_takes_the_warm_up_only_when_it_is_lower(st, store):
  _put(st, store, st.diloco(4, 0.4), 0, 1.40)
  _put(st, store, st.diloco(4, 0.7), 0, 1.45)
  _put(st, store, st.diloco(4, 0.2), 0, 1.42)
  assert st.best_diloco(store, 4) is None  # The warm-up row is not stored yet.
  _put(st, store, st.diloco(4, 0.4, st.WARMUP), 0, 1.38)
  label, system = st.best_diloco(store, 4)
  assert system == st.diloco(4, 0.4, st.WARMUP)
  assert label == "0.4, warm-up from 0.7"
  _put(st, store, st.diloco(4, 0.4, st.WARMUP), 0, 1.41)
  assert st.best_diloco(store, 4) == ("0.4", st.diloco(4, 0.4))


def test_plan_starts_with_data_parallel_and_the_headline_sweeps(st, store):
  plan = st.plan(store, [0, 1, 2])
  assert plan.waiting
  assert plan.ready[0] == (st.data_parallel(), 0)
  assert plan.ready[1:3] == [(st.diloco(4, 0.4), 0), (st.diloco(4, 0.7), 0)]
  assert (st.diloco(1, 0.2), 0) in plan.ready
  # Nothing of seed 1 or 2 before the sweeps have chosen their rows, except data-parallel's.
  assert {s for _, s in plan.ready} == {0, 1, 2}
  assert all(sys_ == st.data_parallel() for sys_, s in plan.ready if s)
  _put(st, store, st.data_parallel(), 0, 1.35)
  assert st.plan(store, [0, 1, 2]).ready[0] == (st.diloco(4, 0.4), 0)


def _finish_seed_0(st, store):
  """Seed 0 of every sweep, warm-up, α, diagnosis and Streaming row: M's best lr is 0.4."""
  _put(st, store, st.data_parallel(), 0, 1.35)
  for m in st.MS:
    for lr in st.GRID:
      _put(st, store, st.diloco(m, lr), 0, 1.40 + abs(lr - 0.4))
    _put(st, store, st.diloco(m, 0.4, st.WARMUP), 0, 1.38)
  for m in st.STREAMING_MS:
    _put(st, store, st.decoupled(m, 0.4, 0.0), 0, 1.39)
    _put(st, store, st.decoupled(m, 0.4, 0.5), 0, 1.395)


def test_plan_runs_the_pairs_seed_by_seed_then_the_final_rows(st, store):
  _finish_seed_0(st, store)
  assert st.best_alpha(store) == 0.0
  plan = st.plan(store, [0, 1, 2])
  assert not plan.waiting
  ready = plan.ready
  # The diagnoses and the other α with the mean come first, at M = 4 and seed 0.
  assert ready[:3] == [
    (st.decoupled(4, 0.4, 0.0, False, False), 0),
    (st.decoupled(4, 0.4, 0.0, False, True), 0),
    (st.decoupled(4, 0.4, 0.5, mean=True), 0),
  ]
  pairs = ready[3:15]
  assert pairs[:2] == [(st.streaming(4, 0.4, 0.0), 0), (st.decoupled(4, 0.4, 0.0, mean=True), 0)]
  assert [s for _, s in pairs] == [0, 0, 1, 1, 2, 2] * 2
  rest = ready[15:]
  assert rest[:2] == [(st.data_parallel(), 1), (st.data_parallel(), 2)]
  assert rest[2:] == [(st.diloco(m, 0.4, st.WARMUP), s) for m in st.MS for s in (1, 2)]
  # A stored job leaves the plan.
  _put(st, store, st.streaming(4, 0.4, 0.0), 1, 1.37)
  assert (st.streaming(4, 0.4, 0.0), 1) not in st.plan(store, [0, 1, 2]).ready


def test_at_tokens_interpolates_and_refuses_outside_the_curve(st):
  curve = [[0.0, 100, 2.0], [1.0, 300, 1.0]]
  assert st._at_tokens(curve, 200) == pytest.approx(1.5)
  assert st._at_tokens(curve, 100) == pytest.approx(2.0)
  assert st._at_tokens(curve, 50) is None
  assert st._at_tokens(curve, 301) is None


def test_protocol_gap_pairs_decoupled_with_streaming_by_seed_and_fraction(st, store):
  _finish_seed_0(st, store)
  curve_s = [[0, 0, 3.0], [1, 1000, 2.0]]
  curve_d = [[0, 0, 3.0], [1, 1000, 2.2]]  # +10 % at the end, +4 % at half the tokens.
  for m in st.STREAMING_MS:
    for seed in (0, 1):
      _put(st, store, st.streaming(m, 0.4, 0.0), seed, 2.0, curve=curve_s)
      _put(st, store, st.decoupled(m, 0.4, 0.0, mean=True), seed, 2.2, curve=curve_d)
  text = "\n".join(st.protocol_gap(store, [0, 1, 2]))
  assert "as shipped against Streaming DiLoCo" in text
  row_4 = next(line for line in text.splitlines() if line.startswith("| 4 |"))
  cells = [c.strip() for c in row_4.strip("|").split("|")]
  assert cells[2].startswith("4.00 %")  # 50 %: 2.6 / 2.5 − 1.
  assert cells[5].startswith("10.00 %")  # The end.
  assert cells[6] == "2"  # Seed 2 is not stored.


def test_protocol_gap_is_empty_before_the_sweeps_choose(st, store):
  assert st.protocol_gap(store, [0]) == []


def test_a_run_gets_the_drivers_autogroup_nice(st, tmp_path):
  proc = tmp_path / "proc"
  for pid, text in (("self", "/autogroup-2 nice 19\n"), ("41", "/autogroup-9 nice 0\n")):
    (proc / pid).mkdir(parents=True)
    (proc / pid / "autogroup").write_text(text)
  assert st._autogroup_nice(proc=str(proc)) == 19
  assert st._autogroup_nice(41, proc=str(proc)) == 0
  st._share_priority(41, proc=str(proc))
  assert (proc / "41" / "autogroup").read_text() == "19"
  # A driver at nice 0, a run gone, no autogroups (another kernel): nothing changes, nothing fails.
  (proc / "self" / "autogroup").write_text("/autogroup-2 nice 0\n")
  (proc / "41" / "autogroup").write_text("/autogroup-9 nice 5\n")
  st._share_priority(41, proc=str(proc))
  assert (proc / "41" / "autogroup").read_text() == "/autogroup-9 nice 5\n"
  (proc / "self" / "autogroup").write_text("/autogroup-2 nice 19\n")
  st._share_priority(42, proc=str(proc))
  assert st._autogroup_nice(proc=str(tmp_path / "none")) is None
