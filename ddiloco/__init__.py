"""ddiloco: Decoupled DiLoCo for resilient distributed pre-training, in JAX.

The names a notebook needs to run the simulated cluster, from one import:

  import ddiloco

  summary = ddiloco.simulate(
    workdir="/tmp/run",
    run=ddiloco.RunConfig(
      model=ddiloco.transformer_config("tiny", max_len=64),
      data=ddiloco.TextDataConfig(seq_len=64, batch_size=8),
      num_learners=4,
      steps_per_learner=96,
    ),
    fleet=ddiloco.ClusterConfig(faults=("crash:2@40+20",)),
  )

They are imported on first use (`__getattr__`), so `import ddiloco` itself loads neither jax nor the
models: entry points that must set XLA_FLAGS before jax loads can still import the package.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it.
_EXPORTS = {
  "simulate": "ddiloco.simulation.simulate",
  "RunConfig": "ddiloco.run_config",
  "ClusterConfig": "ddiloco.simulation.config",
  "FragmentSchedule": "ddiloco.fragments.schedule",
  "SyncerConfig": "ddiloco.syncer.types",
  "LearnerConfig": "ddiloco.learner.config",
  "InnerOptConfig": "ddiloco.learner.train_step",
  "TextDataConfig": "ddiloco.data.text",
  "TokenShardDataConfig": "ddiloco.data.token_shards",
  "transformer_config": "ddiloco.models.configs",
  "hf_llama_config": "ddiloco.models.configs",
  "JobConfig": "ddiloco.launch.job",
  "read_events": "ddiloco.metrics.writer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name not in _EXPORTS:
    raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # Imported once; later lookups do not come here.
  return value


def __dir__() -> list[str]:
  return sorted([*globals(), *_EXPORTS])
