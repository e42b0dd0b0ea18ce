"""Benchmark: the learner's step rate against a bare `jax.jit` optax loop on the same model and mesh.

Three loops are measured side by side, interleaved in rounds so machine noise hits them equally:
  bare      jax.jit(grad + optax.adamw): params placed with the model's shardings and the batch split
            over "data" (the same mesh), but no pinned in/out shardings, no donation, no context
  learner   ddiloco's Learner.train_step (pinned shardings, donation, counters), no syncing
  syncing   learner + the syncer-paced round protocol with an in-process SyncerCore: at every
            step the core opens the round of each fragment due on its schedule (P = H = 24: one
            fragment per step), the learner is asked for it and answers it with a host copy of
            θ_p, and the merge is polled and applied τ steps after the answer
It prints steps/s per loop and the ratios learner/bare and syncing/bare (to learner without --loops=bare).

  python scripts/bench_learner_step.py --size=tiny --devices=2 --steps=40 --rounds=3
  python scripts/bench_learner_step.py --size=2b --devices=1 --batch=4 --seq_len=512 --loops=learner,syncing
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time

import jax
import numpy as np
import optax
from absl import app, flags

from ddiloco.data import text as text_data
from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import train_step
from ddiloco.learner.boundary import step_boundary
from ddiloco.learner.learner import Learner
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.syncer.core import SyncerConfig, SyncerCore

_SIZE = flags.DEFINE_string("size", "tiny", "model size")
_DEVICES = flags.DEFINE_integer("devices", 2, "devices in the learner's mesh")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step")
_SEQ = flags.DEFINE_integer("seq_len", 128, "tokens per sequence")
_STEPS = flags.DEFINE_integer("steps", 40, "timed steps per loop per round")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved rounds")
_LOOPS = flags.DEFINE_list(
  "loops",
  ["bare", "learner", "syncing"],
  "loops to measure; leave out `bare` for a model whose unpinned, undonated step does not fit",
)
flags.register_validator(
  "loops",
  lambda names: bool(names) and set(names) <= {"bare", "learner", "syncing"},
  "--loops takes one or more of bare, learner, syncing",
)


def _batches(n: int) -> list[dict[str, np.ndarray]]:
  data = text_data.TextDataConfig(seq_len=_SEQ.value, batch_size=_BATCH.value)
  it = text_data.make_train_iterator(data, shard_index=0, num_shards=1)
  return [next(it) for _ in range(n)]


def main(argv: list[str]) -> None:
  del argv
  cfg = configs.transformer_config(_SIZE.value, max_len=_SEQ.value)
  model = transformer.Transformer(cfg)
  mesh = mesh_lib.make_mesh(devices=jax.devices()[: _DEVICES.value])
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=_SEQ.value)
  host = jax.device_get(params)
  del params  # Each loop places its own copy; a large model has no room for a fourth.
  opt_cfg = train_step.InnerOptConfig(warmup_steps=10, decay_steps=10_000)
  optimizer = train_step.make_inner_optimizer(opt_cfg)
  batches = _batches(_STEPS.value)

  # -- bare loop ---------------------------------------------------------------------------
  @jax.jit
  def bare_step(p, s, batch):
    grads = jax.grad(lambda q: train_step.loss_fn(model, q, batch)[0])(p)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  bare = {}

  batch_sharding = partitioning.batch_sharding(mesh)

  def run_bare():
    if not bare:
      bare["p"] = jax.device_put(host, shardings)
      bare["s"] = optimizer.init(bare["p"])
    p, s = bare["p"], bare["s"]
    for b in batches:  # Same mesh: the batch is split over "data" as the learner's is.
      p, s = bare_step(p, s, jax.device_put(b, batch_sharding))
    jax.block_until_ready(p)
    bare["p"], bare["s"] = p, s

  # -- learner loop (no syncing) ------------------------------------------------------------
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
  steps = train_step.CompiledSteps(model, optimizer, mesh, abstract, shardings)
  flat = {k: np.asarray(v) for k, v in tree.flatten(host).items()}
  layout = layout_lib.make_layout(flat, num_fragments=24)
  schedule = FragmentSchedule(num_fragments=24, period=24, overlap=2)

  def make_learner():
    return Learner(
      learner_id=0,
      steps=steps,
      params=jax.device_put(host, shardings),
      layout=layout,
      schedule=schedule,
    )

  plain = []

  def run_learner():
    if not plain:
      plain.append(make_learner())
    for b in batches:
      plain[0].train_step(b)
    jax.block_until_ready(plain[0].params)

  # -- learner + syncing through an in-process core -------------------------------------------
  clock = {"t": 0.0}
  core = SyncerCore(
    fragment_keys=layout.fragments,
    init_values={k: v for frag in layout.split(flat) for k, v in frag.items()},
    config=SyncerConfig(use_grace=False),
    clock=lambda: clock["t"],
    schedule=schedule,
  )
  core.register(0)
  syncing = make_learner() if "syncing" in _LOOPS.value else None
  if syncing is not None:
    syncing.load_global([core.fetch(0, p) for p in range(layout.num_fragments)])

  core_s = {"total": 0.0, "steps": 0}  # Time inside the core: the syncer's process in a deployment.

  def run_syncing():
    for b in batches:
      syncing.train_step(b)
      clock["t"] += 1.0
      # The core's step clock is this learner's step (one learner: the fleet is it). Opening the
      # rounds directly instead of `tick` keeps the schedule exact without a rate estimate.
      t = syncing.kernel.schedule_step
      for p in schedule.due(t):
        t0 = time.perf_counter()
        request = core.open_round(p, t)
        core_s["total"] += time.perf_counter() - t0
        if request is not None:
          syncing.kernel.ask(request)
      for answer in step_boundary(syncing, host_copies=True).answers:
        t0 = time.perf_counter()  # The core files θ as an fp32 push's Report, merged as Θ − θ.
        result = core.report(answer.as_report(answer.theta()))
        core_s["total"] += time.perf_counter() - t0
        syncing.kernel.on_result(answer.fragment, result)
      t0 = time.perf_counter()
      states = []
      for event in core.closer.poll():
        state = core.state(event.fragment)
        core.mark_delivered(0, state.fragment, state.version)
        states.append(state)
      core_s["total"] += time.perf_counter() - t0
      for state in states:
        syncing.kernel.receive(state)
      syncing.apply_ready()  # What is ready now, before the next step (as the boundary would).
      core_s["steps"] += 1
    jax.block_until_ready(syncing.params)

  every = {"bare": run_bare, "learner": run_learner, "syncing": run_syncing}
  loops = {name: fn for name, fn in every.items() if name in _LOOPS.value}
  for fn in loops.values():  # Warm-up: compile everything.
    fn()
  times = {name: [] for name in loops}
  for _ in range(_ROUNDS.value):
    for name, fn in loops.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  rate = {name: _STEPS.value / float(np.median(ts)) for name, ts in times.items()}
  n_params = sum(v.size for v in flat.values())
  print(
    f"model {_SIZE.value} ({n_params:,} params), mesh {dict(mesh.shape)}, batch "
    f"{_BATCH.value}x{_SEQ.value}, {_STEPS.value} steps x {_ROUNDS.value} rounds (median)"
  )
  for name in loops:
    print(f"  {name:8s} {rate[name]:8.2f} steps/s")
  base = "bare" if "bare" in rate else "learner"
  for name in ("learner", "syncing"):
    if name in rate and name != base:
      print(f"  {name}/{base} = {rate[name] / rate[base]:.3f}")
  if "syncing" in rate:
    per_step = 1e3 * core_s["total"] / max(core_s["steps"], 1)
    print(
      f"  merges: {core.stats()['merges']}; in the core (the syncer's side): {per_step:.1f} ms/step"
    )
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
