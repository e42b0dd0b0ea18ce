"""Quality cost of compression on the wire: eval loss with each codec, side by side (issue 3).

The same simulated Decoupled DiLoCo run (the run file's model, fleet and fault schedule) with the
uplink and downlink codecs set to each codec in turn (`ClusterConfig.uplink_codec` /
`downlink_codec`): the syncer sees what the gRPC service would decode from θ − Θ^(anchor) and adopts
what learners decode from Θ_new − Θ_old, exactly as `ddiloco-syncer` does. Prints a table and the
int4 / bf16 ratio (goal: within 0.5 %), and writes docs/results/compression.md.

  python experiments/compression_quality.py --run=gin_configs/runs/sim_small.gin \
      --binding=STEPS=96 --binding=BATCH=4 --binding=DP_BATCH=16 --binding=SEQ_LEN=64
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import sys
import time

import gin
from absl import app, flags

from ddiloco.simulation.simulate import simulate

_RUN = flags.DEFINE_string("run", "gin_configs/runs/sim_small.gin", "run gin file")
_OUT = flags.DEFINE_string("out", "docs/results", "folder for the table")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/compression", "run outputs")
_BINDINGS = flags.DEFINE_multi_string("binding", [], "extra gin bindings for every run")
_CODECS = flags.DEFINE_list("codecs", ["fp32", "bf16", "int4"], "codecs to compare")


def run_codec(codec: str) -> dict:
  gin.clear_config()
  gin.add_config_file_search_path("gin_configs")
  bindings = [
    *_BINDINGS.value,
    f"ClusterConfig.uplink_codec = '{codec}'",
    f"ClusterConfig.downlink_codec = '{codec}'",
  ]
  gin.parse_config_files_and_bindings([_RUN.value], bindings)
  t0 = time.time()
  summary = simulate(
    workdir=os.path.join(_WORKDIR.value, codec),
    progress=lambda line: print(f"[{codec}] {line}", file=sys.stderr, flush=True),
  )
  summary["elapsed_s"] = time.time() - t0
  return summary


def main(argv: list[str]) -> None:
  del argv
  results = {codec: run_codec(codec) for codec in _CODECS.value}
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump(results, f, indent=2, default=str)
  args = [f"--run={_RUN.value}", *[f"--binding={b}" for b in _BINDINGS.value]]
  args.append(f"--codecs={','.join(_CODECS.value)}")
  command = "python experiments/compression_quality.py " + " ".join(args)
  lines = [
    "# Quality cost of compression on the wire",
    "",
    f"Command: `{command}`",
    "",
    "| codec (both ways) | final eval loss | merges | digests agree | wall s |",
    "|---|---|---|---|---|",
  ]
  for codec, s in results.items():
    lines.append(
      f"| {codec} | {s['final_eval_loss']:.4f} | {s['merges']} | {s['digests_agree']} "
      f"| {s['elapsed_s']:.0f} |"
    )
  if "bf16" in results and "int4" in results:
    ratio = results["int4"]["final_eval_loss"] / results["bf16"]["final_eval_loss"]
    verdict = "met" if ratio <= 1.005 else "NOT met"
    lines += ["", f"int4 / bf16 eval loss = {ratio:.4f} (goal <= 1.005: {verdict})."]
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "compression.md"), "w") as f:
    f.write(text)


if __name__ == "__main__":
  app.run(main)
