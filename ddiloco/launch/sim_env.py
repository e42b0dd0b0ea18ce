"""Process settings of the programs that run the simulated cluster in one process.

`ddiloco-simulate` and `ddiloco-replay` import this module before numpy and jax load (absl and the
launch package's own modules import neither):
- one OpenBLAS thread: the in-process syncer's merge calls BLAS (syncer/merge.py), and an idle
  OpenBLAS thread pool spins and takes CPU from the learners' steps (as in ddiloco-syncer);
- fake CPU devices for the learners' meshes, unless XLA_FLAGS already asks for a count.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
