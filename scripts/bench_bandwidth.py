"""Benchmark: bytes on the wire per inner step, data-parallel gradients against Decoupled DiLoCo.

Model: `transformer_config("small")` (~14M float32 parameters), initialised for real (Θ_old), then
trained for `--inner_steps` real AdamW steps on the text pipeline (θ). The balanced layout
(docs/algorithm.md §2, P = 24) cuts it into fragments, and one SyncerCore outer step over θ gives Θ_new: the
core opens a round of every fragment at step `--inner_steps`, θ_p answers it, and a flush merges
them.

  data-parallel   a ring all-reduce of the full gradient every step: each of n workers sends
                  2(n−1)/n × G bytes and receives as many (G = 4 bytes × params for fp32
                  gradients, 2 for bf16). Computed from the parameter count, not measured.
                  n = --dp_workers: 8 is the same fleet as M = 8 learners, 2 is the paper's
                  two-site setting (docs/algorithm.md §7), where a ring sends exactly one G per step.
  Decoupled       per inner step P/H fragments (one, with P = H = 24) go up and come down. Sizes
  DiLoCo          are measured: the `ByteSize()` of the real chunk streams a learner and the syncer
                  send, i.e. `report_to_chunks` of θ_p as a delta θ − Θ_old with the
                  codec (what the worker pushes; the fragment wire format inside) and
                  `state_to_chunks` of Θ_new with base Θ_old (the downlink update
                  Θ_new − Θ_old, docs/algorithm.md §5), framing, headers and 1 MiB chunking included, averaged
                  over all P fragments.

Both sides are counted per worker (a DP replica, or a learner) per inner step and per direction;
the ratio is taken on the mean of the two directions (they differ by a few bytes of header).
Every codec is fixed-rate (bf16: 2 bytes a value; int4: half a byte plus a float32 scale per 64
values), so the sizes depend on the shapes, not on the values; the real values only make the
encoding path the one the service runs. To within framing, the ratio is 2(n−1)/n × g × H / b,
with g the gradient's bits per parameter and b the wire bits per value (a fragment holds N/P
params, and P/H fragments go each step).
It prints the DP/DDiLoCo ratios for fp32 and bf16 DP gradients (goals: >= 50x with bf16 on the
wire, >= 200x with int4).

  python scripts/bench_bandwidth.py --size=small --num_fragments=24 --period=24 --dp_workers=2,8
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import sys

import jax
import numpy as np
import optax
from absl import app, flags

from ddiloco.data import text as text_data
from ddiloco.fragments import layout as layout_lib
from ddiloco.fragments import tree
from ddiloco.learner import train_step
from ddiloco.models import configs, transformer
from ddiloco.parallel import mesh as mesh_lib
from ddiloco.parallel import partitioning
from ddiloco.syncer.core import Report, SyncerConfig, SyncerCore
from ddiloco.testing.wire import report_to_chunks, state_to_chunks

_SIZE = flags.DEFINE_string("size", "small", "model size (ddiloco.models.configs.SIZES)")
_P = flags.DEFINE_integer("num_fragments", 24, "P, fragments of the balanced layout")
_H = flags.DEFINE_integer("period", 24, "H, inner steps per fragment period")
_STEPS = flags.DEFINE_integer("inner_steps", 3, "real AdamW steps from Θ_old to θ")
_SEQ = flags.DEFINE_integer("seq_len", 128, "tokens per sequence")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step")
_WORKERS = flags.DEFINE_list("dp_workers", ["2", "8"], "data-parallel ring sizes n to compare")
_CODECS = flags.DEFINE_list("codecs", ["fp32", "bf16", "int8", "int4"], "wire codecs to measure")
_GOALS = {"bf16": 50.0, "int4": 200.0}


def _train(model, mesh, seq_len: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """(Θ_old, θ): flat host params at init and after `--inner_steps` real AdamW steps."""
  params, shardings = partitioning.init_params(model, mesh, jax.random.key(0), seq_len=seq_len)
  init = {k: np.asarray(v) for k, v in tree.flatten(jax.device_get(params)).items()}
  optimizer = train_step.make_inner_optimizer(
    train_step.InnerOptConfig(warmup_steps=0, decay_steps=100)
  )

  @jax.jit
  def step(p, s, batch):
    grads = jax.grad(lambda q: train_step.loss_fn(model, q, batch)[0])(p)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  data = text_data.TextDataConfig(seq_len=seq_len, batch_size=_BATCH.value)
  batches = text_data.make_train_iterator(data, shard_index=0, num_shards=1)
  state = optimizer.init(params)
  batch_sharding = partitioning.batch_sharding(mesh)
  for _ in range(_STEPS.value):
    params, state = step(params, state, jax.device_put(next(batches), batch_sharding))
  del shardings
  theta = {k: np.asarray(v) for k, v in tree.flatten(jax.device_get(params)).items()}
  return init, theta


def _stream_bytes(chunks) -> int:
  return sum(c.ByteSize() for c in chunks)


def _measure(
  init: dict[str, np.ndarray], theta: dict[str, np.ndarray]
) -> tuple[list[int], dict[str, list[int]], dict[str, list[int]]]:
  """Per fragment: (params, {codec: uplink stream bytes}, {codec: downlink stream bytes})."""
  layout = layout_lib.make_layout(init, num_fragments=_P.value)
  old_frags, new_frags = layout.split(init), layout.split(theta)

  # One real outer step (docs/algorithm.md §4.3-4.6) over every fragment: Θ_new for the downlink update.
  core = SyncerCore(
    fragment_keys=layout.fragments,
    init_values={k: v for frag in old_frags for k, v in frag.items()},
    config=SyncerConfig(use_grace=False),
    clock=lambda: 0.0,
  )
  core.register(0)
  round_step = _STEPS.value  # Every round is opened, and answered, at the step θ was trained to.
  for p in range(layout.num_fragments):
    core.mark_delivered(0, p, 0)
    if core.open_round(p, round_step) is None:
      raise RuntimeError(f"Could not open the round of fragment {p}.")
    report = Report(
      learner_id=0,
      fragment=p,
      values=new_frags[p],
      tokens=_BATCH.value * _SEQ.value * _STEPS.value,
      steps=_STEPS.value,
      anchor_version=0,
      step=_STEPS.value,
      round_step=round_step,
    )
    if core.report(report).weight <= 0:
      raise RuntimeError(f"Report of fragment {p} was not filed with weight > 0.")
  if len(core.closer.flush()) != layout.num_fragments:
    raise RuntimeError("Expected one merge per fragment.")

  up: dict[str, list[int]] = {c: [] for c in _CODECS.value}
  down: dict[str, list[int]] = {c: [] for c in _CODECS.value}
  for p in range(layout.num_fragments):
    report = Report(
      learner_id=0,
      fragment=p,
      values=new_frags[p],
      tokens=1,
      steps=1,
      anchor_version=0,
      step=round_step,
      round_step=round_step,  # Headers as the worker sends them: its answer names the round.
    )
    for codec in _CODECS.value:
      chunks = report_to_chunks(report, codec, anchor_values=old_frags[p])
      up[codec].append(_stream_bytes(chunks))
      chunks = state_to_chunks(core.state(p), codec, base=core.state_at(p, 0))
      down[codec].append(_stream_bytes(chunks))

  return [sum(v.size for v in f.values()) for f in old_frags], up, down


def main(argv: list[str]) -> None:
  del argv
  cfg = configs.transformer_config(_SIZE.value, max_len=_SEQ.value)
  model = transformer.Transformer(cfg)
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  init, theta = _train(model, mesh, _SEQ.value)
  frag_params, up, down = _measure(init, theta)
  n_params = sum(v.size for v in init.values())
  per_step = (
    _P.value / _H.value
  )  # Fragments sent per inner step (docs/algorithm.md §2: one with P = H).
  print(
    f"model {_SIZE.value}: {n_params:,} params ({4 * n_params / 2**20:.1f} MiB fp32); balanced "
    f"layout P={_P.value}, H={_H.value} ({per_step:g} fragment/step); fragment params min/mean/max "
    f"{min(frag_params):,}/{np.mean(frag_params):,.0f}/{max(frag_params):,}; θ after "
    f"{_STEPS.value} AdamW steps"
  )
  print("  bytes per worker per inner step, per direction (MiB):")
  dp = {}
  for n in (int(w) for w in _WORKERS.value):
    for grad, width in (("fp32", 4), ("bf16", 2)):
      dp[(n, grad)] = 2 * (n - 1) / n * width * n_params
      print(
        f"    data-parallel ring n={n}, {grad} grads (2(n-1)/n x G)  {dp[(n, grad)] / 2**20:9.3f}"
      )
  dd = {}
  for codec in _CODECS.value:
    mean_up, mean_down = float(np.mean(up[codec])), float(np.mean(down[codec]))
    dd[codec] = per_step * (mean_up + mean_down) / 2
    bits = 8 * (mean_up + mean_down) / 2 / np.mean(frag_params)
    print(
      f"    DDiLoCo {codec:4s} up {per_step * mean_up / 2**20:7.4f}  down "
      f"{per_step * mean_down / 2**20:7.4f}  ({bits:.3f} bits/param on the wire)"
    )
  print("  ratios DP / DDiLoCo:")
  for (n, grad), dp_bytes in dp.items():
    cells = "  ".join(f"{codec} {dp_bytes / dd[codec]:7.1f}x" for codec in _CODECS.value)
    print(f"    n={n} {grad} grads: {cells}")
  goals = ", ".join(f"{c} >= {g:g}x" for c, g in _GOALS.items() if c in dd)
  print(f"  goals: {goals}")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
