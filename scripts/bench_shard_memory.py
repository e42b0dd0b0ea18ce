r"""Peak memory of a syncer shard's start-up, by shard count: does a shard hold 1/S of the model?

Each S runs in a fresh process (peak RSS is per process): it builds the run's factory, initialises
shard 0's fragments as `ddiloco-syncer --shard=0` does (and, for comparison, as it did before:
the whole model first, then its part), and creates the syncer core on them
(version 0 and the outer optimizer's state). Prints the peak RSS above the process's baseline
(Python, JAX and the compiled eval step) against the model's fp32 size, and the ratio to S = 1.

  python scripts/bench_shard_memory.py --shards=1,2,4 --d_model=1024 --num_layers=8
"""

import json
import os
import resource
import subprocess
import sys

from absl import app, flags

_SHARDS = flags.DEFINE_list("shards", ["1", "2", "4"], "Shard counts to compare.")
_D_MODEL = flags.DEFINE_integer("d_model", 1024, "Model width (the 'small' config otherwise).")
_LAYERS = flags.DEFINE_integer("num_layers", 8, "Transformer layers.")
_FRAGMENTS = flags.DEFINE_integer("fragments", 8, "P.")
_WHOLE = flags.DEFINE_bool(
  "whole", True, "Also measure each S > 1 initialising the whole model first (the old start-up)."
)
_CHILD = flags.DEFINE_integer("child", 0, "Internal: run one measurement with this S.")
_CHILD_WHOLE = flags.DEFINE_bool("child_whole", False, "Internal: that measurement's start-up.")


def _rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _measure(num_shards: int, whole: bool) -> dict:
  import time

  from ddiloco.data import text as text_data
  from ddiloco.fragments import shards as shards_lib
  from ddiloco.learner import train_step
  from ddiloco.learner.factory import LearnerFactory
  from ddiloco.models import configs
  from ddiloco.syncer.core import SyncerConfig, SyncerCore

  factory = LearnerFactory(
    model_config=configs.transformer_config(
      "small",
      d_model=_D_MODEL.value,
      num_layers=_LAYERS.value,
      num_heads=_D_MODEL.value // 64,
      mlp_dim=4 * _D_MODEL.value,
    ),
    data_config=text_data.TextDataConfig(seq_len=16, batch_size=2, tokenizer="byte"),
    inner_opt=train_step.InnerOptConfig(warmup_steps=1, decay_steps=10),
    num_fragments=_FRAGMENTS.value,
    eval_batches=1,
  )
  base = _rss_mib()
  t0 = time.monotonic()
  owned = shards_lib.owned(0, num_shards, factory.layout.num_fragments)
  if whole:  # Every shard made the whole model and kept its own part.
    keys = {k for p in owned for k in factory.layout.fragments[p]}
    init = {k: v for k, v in factory.global_init_values().items() if k in keys}
  else:
    init = factory.global_init_values(owned if num_shards > 1 else None)
  core = SyncerCore(
    fragment_keys=factory.layout.fragments,
    init_values=init,
    config=SyncerConfig(min_quorum=1),
    clock=time.monotonic,
    owned=owned,
  )
  del init
  held = sum(v.nbytes for p in sorted(owned) for v in core.state(p).values.values())
  return {
    "shards": num_shards,
    "start": "whole model, then own part" if whole else "own fragments only",
    "params": factory.num_params,
    "model_mib": factory.num_params * 4 / 2**20,
    "held_mib": held / 2**20,
    "base_mib": base,
    "peak_above_base_mib": _rss_mib() - base,
    "seconds": time.monotonic() - t0,
  }


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(_measure(_CHILD.value, _CHILD_WHOLE.value)))
    return
  rows = []
  runs = [(int(s), False) for s in _SHARDS.value]
  runs += [(int(s), True) for s in _SHARDS.value if _WHOLE.value and int(s) > 1]
  for s, whole in runs:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
      [sys.executable, __file__, f"--child={s}", f"--child_whole={whole}", *sys.argv[1:]],
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
      check=True,
    ).stdout
    rows.append(json.loads(out.strip().splitlines()[-1]))
  first = rows[0]["peak_above_base_mib"]
  print(f"model: {rows[0]['params'] / 1e6:.1f}M params, {rows[0]['model_mib']:.0f} MiB fp32")
  print("| S | start-up | held by shard 0 (MiB) | peak above base (MiB) | ratio to S=1 | s |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['shards']} | {r['start']} | {r['held_mib']:.0f} | {r['peak_above_base_mib']:.0f} | "
      f"{r['peak_above_base_mib'] / first:.2f} | {r['seconds']:.1f} |"
    )


if __name__ == "__main__":
  app.run(main)
