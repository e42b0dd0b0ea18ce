"""Times a learner host's encoding of one answer's δ: one streamed pass against parts on threads.

  python scripts/bench_host_encode.py --mib=64 --codecs=int4,bf16 --workers=1,2 --reps=5

Where a learner's host encodes δ = Θ^(anchor) − θ (a learner on CPU, a multi-process learner's
leader, a fragment its devices cannot encode), its link either encodes in the one pass that frames
the push as it is sent (`FragmentEncoder.pieces`, one thread) or, with `JobConfig.encode_workers`
> 1, first in parts on threads (`fragment_encoder.encode_in_parts`, into memory it reuses) and
then frames the bytes. Both
are timed here side by side in one run on one fragment of `--mib` MiB of float32 (the pieces are
consumed, not sent): median wall and process CPU seconds of `--reps` repetitions, GB/s of fp32
values, and each row's wall against the streamed pass. Wall ratios need as many idle cores as
workers; CPU per GB shows what the threads cost.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from ddiloco.syncer.blockwise import OutputBuffer
from ddiloco.transport.fragment_encoder import SEND_RUN_VALUES, FragmentEncoder, encode_in_parts

_MIB = flags.DEFINE_integer("mib", 64, "MiB of float32 values in the fragment")
_CODECS = flags.DEFINE_list("codecs", ["int4", "bf16"], "uplink codecs")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "threads of the parts path (1: streamed)")
_REPS = flags.DEFINE_integer("reps", 5, "repetitions per row (median)")
_OUT = flags.DEFINE_string("out", "", "JSON file for the rows (empty: none)")


def _consume(encoder: FragmentEncoder) -> int:
  return sum(memoryview(p).nbytes for p in encoder.pieces(SEND_RUN_VALUES))  # As `framed`.


def _time(fn, reps: int) -> tuple[float, float]:
  fn()  # Warm: page faults of the first outputs, caches.
  walls, cpus = [], []
  for _ in range(reps):
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    walls.append(time.perf_counter() - w0)
    cpus.append(time.process_time() - c0)
  return statistics.median(walls), statistics.median(cpus)


def main(argv: list[str]) -> None:
  del argv
  n = _MIB.value * (1 << 20) // 4
  rng = np.random.default_rng(0)
  # Two tensors, as a fragment holds several; θ near its anchor, as an answer's is.
  theta = {
    "w": rng.standard_normal(n - n // 8, np.float32),
    "b": rng.standard_normal(n // 8, np.float32),
  }
  anchor = {
    k: v + np.float32(1e-3) * rng.standard_normal(v.size, np.float32) for k, v in theta.items()
  }
  gb = 4 * n / 1e9
  load = round(os.getloadavg()[0], 2)
  print(
    f"one fragment of {_MIB.value} MiB float32, {os.cpu_count()} CPUs, load {load}; "
    f"median of {_REPS.value}"
  )
  rows = []
  for codec in _CODECS.value:
    base_wall = None
    for workers in (int(w) for w in _WORKERS.value):
      if workers == 1:

        def run(codec=codec):
          return _consume(FragmentEncoder(anchor, codec, base=theta))

        name = "streamed, 1 thread"
      else:
        out = OutputBuffer()  # The link's: each sender thread reuses its own.

        def run(codec=codec, workers=workers, out=out):
          parts = encode_in_parts(anchor, codec, base=theta, workers=workers, allocate=out.arrays)
          return _consume(FragmentEncoder(anchor, codec, encoded=parts))

        name = f"parts, {workers} threads"
      wall, cpu = _time(run, _REPS.value)
      base_wall = wall if base_wall is None else base_wall
      row = {
        "codec": codec,
        "workers": workers,
        "wall_s": wall,
        "cpu_s": cpu,
        "gb_per_s": gb / wall,
        "cpu_s_per_gb": cpu / gb,
        "wall_vs_streamed": wall / base_wall,
      }
      rows.append(row)
      print(
        f"  {codec:5s} {name:20s} wall {1e3 * wall:8.1f} ms  cpu {1e3 * cpu:8.1f} ms  "
        f"{row['gb_per_s']:5.2f} GB/s  {row['cpu_s_per_gb']:5.2f} CPU-s/GB  "
        f"wall / streamed {row['wall_vs_streamed']:.2f}"
      )
  if _OUT.value:
    commit = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {
      "command": "python scripts/bench_host_encode.py " + " ".join(sys.argv[1:]),
      "commit": commit,
      "date": datetime.date.today().isoformat(),
      "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load": load},
      "rows": rows,
    }
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
