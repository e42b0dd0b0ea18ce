"""The merge fused with the outer step (`outer.py`) against the numpy merge followed by the step."""

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from ddiloco.syncer import outer
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore
from ddiloco.syncer.merge_rules import RDA, WeightedMean, token_weight
from ddiloco.testing import merges as reference

KEYS = (("a", "b", "emb"), ("c",))
LEARNERS = (0, 1, 2)
FUSED, NUMPY = 0, 1 << 40  # `SyncerConfig.fused_merge_bytes`: every fragment fused, or none.


class _Clock:
  t = 0.0

  def __call__(self) -> float:
    return self.t


def _init():
  rng = np.random.default_rng(0)
  return {
    "a": rng.standard_normal((3, 5)).astype(np.float32),
    "b": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
    "emb": rng.standard_normal((4, 2)).astype(np.float32),
    "c": rng.standard_normal(6).astype(np.float32),
  }


def _core(fused_bytes: int, *, optimizer=None, **cfg) -> SyncerCore:
  cfg.setdefault("use_grace", False)
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=_init(),
    config=SyncerConfig(
      fused_merge_bytes=fused_bytes,
      **({} if optimizer is None else {"outer_optimizer": lambda: optimizer}),
      **cfg,
    ),
    clock=_Clock(),
    embedding_keys=("emb",),
  )
  for i in LEARNERS:
    core.register(i)
    core.fetch(i, 0)
  return core


def _answers(
  core: SyncerCore, step: int, seed: int, *, scale: float = 0.05, theta_from: int | None = 1
) -> list[Report]:
  """One answer per learner to round (0, step): learner `theta_from` sends θ, the others δ;
  unequal tokens."""
  rng = np.random.default_rng(seed)
  cur = core.state(0)
  out = []
  for i in LEARNERS:
    delta = {
      k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in cur.values.items()
    }
    if i == theta_from:
      values = {
        k: (cur.values[k].astype(np.float32) - d).astype(v.dtype)
        for (k, d), v in zip(delta.items(), cur.values.values())
      }
    else:
      values = {k: d.astype(cur.values[k].dtype) for k, d in delta.items()}
    out.append(
      Report(
        learner_id=i,
        fragment=0,
        values=values,
        tokens=100 * (i + 1),
        steps=10,
        anchor_version=cur.version,
        step=step,
        round_step=step,
        outer_gradient=i != theta_from,
      )
    )
  return out


def _merge(core: SyncerCore, step: int, answers: list[Report]) -> None:
  assert core.open_round(0, step) is not None
  for r in answers:
    assert core.report(r).weight > 0
  (event,) = core.closer.flush()
  assert event.version == core.version(0)


def _opt_arrays(core: SyncerCore) -> list[np.ndarray]:
  sd = core.state_dict()
  return [np.asarray(v, np.float64) for k, v in sorted(sd.items()) if "/opt/" in k]


@pytest.mark.parametrize("rule", [RDA(), WeightedMean()], ids=["rda", "mean"])
def test_the_fused_merge_matches_the_numpy_merge_then_step(rule):
  """RDA (and the mean for the embedding) over δ and θ answers, a bfloat16 tensor, three merges:
  the two ways agree to float32 rounding, in the values and in the optimizer state."""
  fused, ref = _core(FUSED, merge_rule=rule), _core(NUMPY, merge_rule=rule)
  for step in (10, 34, 58):
    answers = _answers(ref, step, seed=step)
    for core in (fused, ref):
      _merge(core, step, answers)
    got, want = fused.state(0).values, ref.state(0).values
    for k in want:
      assert got[k].dtype == want[k].dtype
      tol = 1e-2 if want[k].dtype == ml_dtypes.bfloat16 else 2e-6
      np.testing.assert_allclose(
        got[k].astype(np.float64), want[k].astype(np.float64), rtol=tol, atol=tol, err_msg=k
      )
    assert fused.state(0).values["a"].tobytes() != _init()["a"].tobytes()  # It moved.
  for a, b in zip(_opt_arrays(fused), _opt_arrays(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_fused_merge_is_the_reference_rda_and_mean():
  """The fused program's merged gradient, read through SGD(lr = 1) without momentum (Θ_new =
  Θ − merge), is `reference.rda` for RDA keys and `reference.weighted_mean` for the embedding."""
  core = _core(FUSED, optimizer=optax.sgd(1.0), merge_rule=RDA())
  answers = [r for r in _answers(core, 10, seed=3) if r.outer_gradient]  # δ answers only.
  _merge(core, 10, answers)
  weights = [token_weight(r.tokens, r.steps) for r in answers]
  init = _init()
  for k in ("a", "emb"):
    vs = [r.values[k] for r in answers]
    want = reference.weighted_mean(vs, weights) if k == "emb" else reference.rda(vs, weights)
    got = init[k] - core.state(0).values[k]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=k)


def test_zero_outer_gradients_leave_the_values_where_they_are():
  """RDA's degenerate case (every norm 0) in the fused program: a zero gradient, not NaN."""
  core = _core(FUSED, optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True), merge_rule=RDA())
  answers = _answers(core, 10, seed=0, scale=0.0)
  _merge(core, 10, answers)
  for k, v in _init().items():
    if k in KEYS[0]:
      np.testing.assert_array_equal(core.state(0).values[k], v)


def _snapshot(core: SyncerCore):
  return core.state(0).version, core.state(0).digest, _opt_arrays(core)


def _assert_same(before, after):
  assert before[:2] == after[:2]
  for a, b in zip(before[2], after[2]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fused_bytes", [FUSED, NUMPY], ids=["fused", "numpy"])
def test_a_merge_that_overflows_changes_nothing(fused_bytes):
  """Plausible answers (‖δ‖ about ‖Θ‖) whose outer step overflows float32 (lr 1e38)."""
  core = _core(fused_bytes, optimizer=optax.sgd(1e38, momentum=0.9, nesterov=True))
  core.open_round(0, 10)
  before = _snapshot(core)
  for r in _answers(core, 10, seed=1, scale=1.0):
    assert core.report(r).weight > 0
  assert core.closer.flush() == []
  _assert_same(before, _snapshot(core))
  assert (core.stats()["failed_merges"], core.stats()["merges"]) == (1, 0)


def test_a_fused_merge_that_raises_changes_nothing(monkeypatch):
  core = _core(FUSED)
  core.open_round(0, 10)
  for r in _answers(core, 10, seed=1):
    core.report(r)
  before = _snapshot(core)

  def boom(*args, **kwargs):
    raise RuntimeError("merge bug")

  monkeypatch.setattr(outer.OuterStep, "merge_and_step", boom)
  assert core.closer.flush() == []
  _assert_same(before, _snapshot(core))
  assert core.stats()["failed_merges"] == 1


def test_a_restored_round_merges_as_the_original():
  """A restored round's answers carry no squared norms (they are not saved): the fused merge
  computes them as filing does, and the result is the same bits."""
  core = _core(FUSED)
  core.open_round(0, 10)
  for r in _answers(core, 10, seed=5):
    core.report(r)
  restored = _core(FUSED)
  restored.load_state_dict(core.state_dict())
  assert core.closer.flush()[0].digest == restored.closer.flush()[0].digest


def test_the_outer_step_refuses_mismatched_answers():
  step = outer.OuterStep(optax.sgd(1.0), {"a": 1e30})
  params = {"a": np.zeros(3, np.float32)}
  with pytest.raises(ValueError, match="one kind per answer"):
    step.merge_and_step(
      params,
      base=None,
      answers=[params],
      deltas=[True, True],
      coefs={"a": {0: 1.0}},
      radius={"a": None},
      opt_state=step.init(params),
    )
  with pytest.raises(ValueError, match="needs the base"):
    step.merge_and_step(
      params,
      base=None,
      answers=[params],
      deltas=[False],
      coefs={"a": {0: 1.0}},
      radius={"a": None},
      opt_state=step.init(params),
    )


def test_warm_up_compiles_the_fused_program_for_the_fleet(caplog):
  """`warm_up(p, answers=M)` compiles the program a merge of M δ answers runs; that merge then
  compiles nothing."""
  core = _core(FUSED)
  core.warm_up(0, answers=len(LEARNERS))
  before = core.state(0).digest
  caplog.clear()
  with caplog.at_level("WARNING"), jax.log_compiles(True):
    _merge(core, 10, _answers(core, 10, seed=2, theta_from=None))
  compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
  assert not [m for m in compiles if "_merge_and_step" in m], compiles
  assert core.state(0).digest != before
  with pytest.raises(ValueError, match="answers must be >= 1"):
    core.warm_up(0, answers=0)


@pytest.mark.parametrize("fused", [False, True])
def test_only_the_spare_buffers_are_donated(fused):
  # The outputs go into `spare`'s memory; the params, answers and state stay readable (a failed
  # step keeps them), and the results are those of a step into fresh memory.
  step = outer.OuterStep(optax.sgd(0.5, momentum=0.9, nesterov=True), {"a": 1e30})
  params = {"a": np.arange(6, dtype=np.float32)}
  grads = {"a": np.linspace(-1, 1, 6, dtype=np.float32)}
  state = step.step(params, grads, {"a": 1.0}, step.init(params))[1]  # Non-zero momentum.

  def run(spare):
    return _one_answer_step(step, params, grads, state, fused=fused, scale=2.0, spare=spare)

  want = run(None)
  spare = step.spare(params, state)
  got = run(spare)
  assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(spare))
  for tree in (params, grads, state, want):
    assert not any(
      getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(tree)
    )
  for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
  np.testing.assert_array_equal(params["a"], np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
  ("lr", "nu", "ok"),
  [
    (-1.0, 0.0, True),  # Adam's first step moves each value by −lr: 1 + 1 = 2, within ±4.
    (-4.0, 0.0, False),  # 5: above the limit.
    (6.0, 0.0, False),  # −5: below −limit.
    (float("nan"), 0.0, False),  # NaN values.
    (1.0, float("inf"), False),  # An Inf second moment: the values stay, the state is Inf.
  ],
)
def test_the_step_checks_values_on_both_sides_and_the_state(fused, lr, nu, ok):
  """`ok` is False for a new value beyond ±limit or NaN, or a non-finite state value."""
  step = outer.OuterStep(optax.adam(lr), {"w": 4.0})
  params = {"w": np.ones(1000, np.float32)}
  grads = {"w": np.full(1000, 2.0, np.float32)}
  (adam, *rest) = step.init(params)
  state = (adam._replace(nu={"w": np.full(1000, nu, np.float32)}), *rest)
  _, _, got = _one_answer_step(step, params, grads, state, fused=fused, scale=1.0)
  assert bool(got) is ok


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("source", ["gradient", "state"])
def test_one_nan_in_a_large_tensor_fails_the_step(fused, source):
  """A NaN among 2^18 values: XLA's CPU backend reduces a max of that many values in a kernel
  that skips NaN, so a check built on max |v| passed it."""
  n = 1 << 18
  step = outer.OuterStep(optax.adam(0.1), {"w": 4.0})
  params, grads = {"w": np.ones(n, np.float32)}, {"w": np.full(n, 0.5, np.float32)}
  (adam, *rest) = step.init(params)
  nu = np.zeros(n, np.float32)
  if source == "gradient":
    grads["w"][n // 3] = np.nan
  else:
    nu[n - 5] = np.nan
  state = (adam._replace(nu={"w": nu}), *rest)
  _, _, ok = _one_answer_step(step, params, grads, state, fused=fused, scale=1.0)
  assert not bool(ok)
  grads["w"][:], nu[:] = 0.5, 0.0  # The same step without the NaN passes.
  state = (adam._replace(nu={"w": nu}), *rest)
  _, _, ok = _one_answer_step(step, params, grads, state, fused=fused, scale=1.0)
  assert bool(ok)


def _one_answer_step(step, params, grads, state, *, fused, scale, spare=None):
  """The step on `grads` · `scale`: one δ answer merged with that coefficient in the fused
  program, or the step on the gradients with that scale."""
  if fused:
    return step.merge_and_step(
      params,
      base=None,
      answers=[grads],
      deltas=[True],
      coefs={k: {0: scale} for k in params},
      radius=dict.fromkeys(params),
      opt_state=state,
      spare=spare,
    )
  return step.step(params, grads, dict.fromkeys(params, scale), state, spare)
