"""The outer optimizer as a plug-in: any optax transformation, one state per fragment, checkpointed."""

import functools

import numpy as np
import optax
import pytest

from ddiloco.syncer import outer_optimizers
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore
from ddiloco.syncer.merge_rules import WeightedMean

KEYS = (("a", "b"), ("c",))
FUSED, NUMPY = 0, 1 << 40  # `SyncerConfig.fused_merge_bytes`: every fragment fused, or none.


class _Clock:
  t = 0.0

  def __call__(self) -> float:
    return self.t


def _init():
  rng = np.random.default_rng(7)
  return {
    k: rng.standard_normal(s).astype(np.float32) for k, s in (("a", (3, 4)), ("b", 5), ("c", 2))
  }


def _core(factory, fused_bytes: int = NUMPY) -> SyncerCore:
  core = SyncerCore(
    fragment_keys=KEYS,
    init_values=_init(),
    config=SyncerConfig(
      use_grace=False,
      merge_rule=WeightedMean(),
      outer_optimizer=factory,
      fused_merge_bytes=fused_bytes,
    ),
    clock=_Clock(),
  )
  core.register(0)
  core.fetch(0, 0)
  return core


def _merge(core: SyncerCore, step: int, delta: dict[str, np.ndarray]) -> None:
  state = core.state(0)
  assert core.open_round(0, step) is not None
  report = Report(
    learner_id=0,
    fragment=0,
    values=delta,
    tokens=64,
    steps=4,
    anchor_version=state.version,
    step=step,
    round_step=step,
    outer_gradient=True,
  )
  assert core.report(report).weight > 0
  (event,) = core.closer.flush()
  assert event.version == state.version + 1


def _deltas(n: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(3)
  return [
    {
      "a": rng.standard_normal((3, 4)).astype(np.float32),
      "b": rng.standard_normal(5).astype(np.float32),
    }
    for _ in range(n)
  ]


ADAM = functools.partial(optax.adam, 0.05)
LION = functools.partial(optax.lion, 0.01, b1=0.8)


@pytest.mark.parametrize("fused", [FUSED, NUMPY])
@pytest.mark.parametrize("factory", [ADAM, LION], ids=["adam", "lion"])
def test_a_merge_applies_the_configured_transformation(factory, fused):
  """One learner, the mean merge: the merged outer gradient is its δ, and three merges move Θ as
  the same optax transformation applied to those δs directly would (fused program or numpy)."""
  core = _core(factory, fused)
  opt = factory()
  params = {k: v for k, v in _init().items() if k in KEYS[0]}
  state = opt.init(params)
  for i, delta in enumerate(_deltas(3)):
    _merge(core, 24 * (i + 1), delta)
    updates, state = opt.update(delta, state, params)
    params = optax.apply_updates(params, updates)
  got = core.state(0).values
  for k in params:
    np.testing.assert_allclose(got[k], params[k], rtol=1e-6, atol=1e-6, err_msg=k)
  assert not np.allclose(got["a"], _init()["a"])  # It moved.


def test_the_state_is_kept_per_fragment_and_survives_a_checkpoint():
  """Adam's moments and count are checkpointed per fragment: a restored core continues exactly."""
  core = _core(ADAM)
  deltas = _deltas(3)
  _merge(core, 24, deltas[0])
  _merge(core, 48, deltas[1])
  state = core.state_dict()
  # Fragment 1 was never merged: its Adam count is still 0, fragment 0's is 2.
  leaves = {k: v for k, v in state.items() if "/opt/" in k and k.split("/opt/")[1].isdigit()}
  counts = sorted(int(v) for v in leaves.values() if np.ndim(v) == 0)
  assert counts == [0, 2]
  restored = _core(ADAM)
  restored.load_state_dict(state)
  for c in (core, restored):
    _merge(c, 72, deltas[2])
  assert restored.state(0).digest == core.state(0).digest


def test_a_checkpoint_of_another_outer_optimizer_is_refused_and_changes_nothing():
  """SGD with momentum's state is not Adam's: the restore says so and leaves the core as it was."""
  sgd = _core(functools.partial(optax.sgd, 0.7, momentum=0.9, nesterov=True))
  _merge(sgd, 24, _deltas(1)[0])
  adam = _core(ADAM)
  before = adam.state_dict()
  with pytest.raises(ValueError, match="does not match the outer optimizer"):
    adam.load_state_dict(sgd.state_dict())
  after = adam.state_dict()
  assert sorted(before) == sorted(after)
  for k in before:
    np.testing.assert_array_equal(np.asarray(before[k]), np.asarray(after[k]), err_msg=k)


@pytest.mark.parametrize(
  ("factory", "message"),
  [
    (optax.sgd(0.7), "must be a callable"),
    (optax.sgd, "failed to build the optimizer"),  # Its learning rate unbound.
    (lambda: 0.7, "must return an optax GradientTransformation"),
  ],
  ids=["not-callable", "raises", "not-a-transformation"],
)
def test_a_bad_outer_optimizer_is_refused_at_construction(factory, message):
  with pytest.raises(ValueError, match=f"SyncerConfig.outer_optimizer {message}|{message}"):
    SyncerConfig(outer_optimizer=factory)


def test_nesterov_warmup_ramps_the_momentum_then_is_nesterov_sgd():
  """Step t uses μ_t = 0.9 · t / 4 for t < 4, then 0.9: checked against a hand-written trace."""
  opt = outer_optimizers.nesterov_warmup(0.5, momentum=0.9, warmup_steps=4)
  grads = [{"w": np.array([1.0, -2.0], np.float32) * (t + 1)} for t in range(7)]
  state = opt.init({"w": np.zeros(2, np.float32)})
  trace = np.zeros(2)
  for t, g in enumerate(grads):
    mu = 0.9 * min(t / 4, 1.0)
    trace = mu * trace + g["w"]
    want = -0.5 * (g["w"] + mu * trace)  # Nesterov: the gradient plus μ times the new trace.
    update, state = opt.update(g, state)
    np.testing.assert_allclose(update["w"], want, rtol=1e-6, err_msg=f"step {t}")


def test_nesterov_warmup_can_bring_the_learning_rate_down_over_the_ramp():
  """lr_t = 0.7 + (0.4 − 0.7) · t / 4 for t < 4, then 0.4, beside the momentum's ramp."""
  opt = outer_optimizers.nesterov_warmup(0.4, 0.9, 4, initial_learning_rate=0.7)
  state = opt.init({"w": np.zeros(2, np.float32)})
  trace = np.zeros(2)
  for t in range(7):
    g = np.array([1.0, -2.0], np.float32) * (t + 1)
    mu, lr = 0.9 * min(t / 4, 1.0), 0.7 + (0.4 - 0.7) * min(t / 4, 1.0)
    trace = mu * trace + g
    update, state = opt.update({"w": g}, state)
    np.testing.assert_allclose(update["w"], -lr * (g + mu * trace), rtol=1e-6, err_msg=f"step {t}")


def test_nesterov_warmup_of_zero_steps_is_optax_nesterov():
  opt, ref = outer_optimizers.nesterov_warmup(0.7, 0.9, 0), optax.sgd(0.7, 0.9, nesterov=True)
  s, r = opt.init({"w": np.zeros(3, np.float32)}), ref.init({"w": np.zeros(3, np.float32)})
  for t in range(3):
    g = {"w": np.full(3, t + 1.0, np.float32)}
    (u, s), (v, r) = opt.update(g, s), ref.update(g, r)
    np.testing.assert_allclose(u["w"], v["w"], rtol=1e-7)


@pytest.mark.parametrize(
  "kwargs",
  [
    {"learning_rate": 0.0},
    {"learning_rate": 0.7, "momentum": 1.0},
    {"learning_rate": 0.7, "warmup_steps": -1},
    {"learning_rate": 0.4, "initial_learning_rate": 0.0},
    {"learning_rate": 0.4, "initial_learning_rate": "0.7"},
  ],
)
def test_nesterov_warmup_refuses_bad_settings(kwargs):
  with pytest.raises(ValueError):
    outer_optimizers.nesterov_warmup(**kwargs)


def test_one_gin_binding_sets_the_outer_optimizer():
  """`SyncerConfig.outer_optimizer = @outer/...` with its settings in the `outer` scope."""
  from ddiloco.launch import configurables
  from ddiloco.run_config import RunConfig

  for binding, settings, probe in (
    ("@outer/optax.adam", ["outer/optax.adam.learning_rate = 0.1"], "mu"),
    ("@outer/nesterov_warmup", ["outer/nesterov_warmup.learning_rate = 0.5"], "hyperparams"),
  ):
    configurables.parse(["sim_tiny.gin"], [f"SyncerConfig.outer_optimizer = {binding}", *settings])
    try:
      run = configurables.configured(RunConfig)()
    finally:
      configurables.clear()
    state = run.the_syncer().make_outer_optimizer().init({"w": np.zeros(2, np.float32)})
    assert probe in repr(state), binding


@pytest.mark.parametrize(
  "binding",
  [
    ["SyncerConfig.outer_optimizer = @outer/optax.adam", "outer/optax.adam.learning_rate = 0.01"],
    [
      "SyncerConfig.outer_optimizer = @outer/optax.lion",
      "outer/optax.lion.learning_rate = 0.003",
      "outer/optax.lion.b1 = 0.8",
    ],
  ],
  ids=["adam", "lion"],
)
def test_a_run_trains_with_an_outer_optimizer_set_by_gin(binding, tmp_path):
  """Two non-default outer transformations, each one gin binding: a short simulated run of two
  learners merges with it and its global model's held-out loss falls far below an untrained
  model's."""
  from ddiloco.launch import configurables
  from ddiloco.metrics.writer import read_events
  from ddiloco.run_config import RunConfig
  from ddiloco.simulation.simulate import simulate

  configurables.parse(
    ["sim_tiny.gin"],
    [
      *binding,
      "STEPS = 16",
      "InnerOptConfig.warmup_steps = 2",
      "LEARNERS = 2",
      "FAULTS = ()",
      "FragmentSchedule.num_fragments = 2",
      "FragmentSchedule.period = 4",
      "RunConfig.eval_batches = 1",
      "RunConfig.eval_batch_size = 8",
    ],
  )
  try:
    run = configurables.configured(RunConfig)()
  finally:
    configurables.clear()
  summary = simulate(workdir=str(tmp_path / "run"), run=run, tensorboard=False)
  assert summary["merges"] >= 4
  evals = [e["loss"] for e in read_events(str(tmp_path / "run"), "eval")]
  # An untrained byte model scores about ln 256 = 5.55; 16 steps bring it to about 3.4.
  assert evals and evals[-1] == summary["final_eval_loss"] < 4.5
  name = binding[0].split(".")[-1]  # adam / lion: its state is what the syncer keeps.
  state = run.the_syncer().make_outer_optimizer().init({"w": np.zeros(2, np.float32)})
  assert f"ScaleBy{name.capitalize()}State" in repr(state)
