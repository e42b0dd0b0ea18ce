"""Config dataclasses refuse bad field values at construction, naming the field.

NaN is the case most checks missed: `x < 0` and `x <= 0` are False for NaN, so it passed checks
written that way and failed (or trained to NaN) only once the run was under way.
"""

import math

import numpy as np
import pytest

from ddiloco.checkpoint.learner import LearnerCheckpointConfig
from ddiloco.data.text import TextDataConfig
from ddiloco.data.vision import VisionDataConfig
from ddiloco.faults.schedule import ChaosConfig
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.launch.job import JobConfig
from ddiloco.launch.ray_config import RayConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.models.transformer import TransformerConfig
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig
from ddiloco.simulation.config import ClusterConfig
from ddiloco.syncer.types import SyncerConfig

NAN = math.nan
INF = math.inf


def _text() -> dict:
  model = TransformerConfig(
    vocab_size=64, d_model=8, num_layers=1, num_heads=1, head_dim=8, mlp_dim=8, max_len=128
  )
  return {"model": model, "data": TextDataConfig()}


def _run(**kwargs) -> RunConfig:
  return RunConfig(**_text(), **kwargs)


def _job(**kwargs) -> JobConfig:
  return JobConfig(run=_run(), **kwargs)


_CASES = [
  # (builder, field, bad value)
  (InnerOptConfig, "peak_lr", NAN),
  (InnerOptConfig, "peak_lr", INF),
  (InnerOptConfig, "b1", NAN),
  (InnerOptConfig, "b1", -0.1),
  (InnerOptConfig, "b2", 1.0),
  (InnerOptConfig, "eps", 0.0),
  (InnerOptConfig, "eps", NAN),
  (InnerOptConfig, "weight_decay", -0.1),
  (InnerOptConfig, "weight_decay", NAN),
  (InnerOptConfig, "grad_clip_norm", NAN),
  (InnerOptConfig, "grad_clip_norm", -1.0),
  (ClusterConfig, "step_time_s", NAN),
  (ClusterConfig, "step_time_s", INF),
  (ClusterConfig, "slow_factor", NAN),
  (ClusterConfig, "jitter", NAN),
  (ClusterConfig, "latency_jitter", NAN),
  (ClusterConfig, "uplink_latency_s", NAN),
  (ClusterConfig, "downlink_latency_s", INF),
  (ClusterConfig, "bandwidth_gbps", NAN),
  (ClusterConfig, "max_time_s", NAN),
  (ClusterConfig, "max_time_s", -1.0),
  (ClusterConfig, "max_time_s", 0.0),
  (ServiceConfig, "member_retention_s", NAN),
  # An int field given a float failed mid-run ("'float' object cannot be interpreted as an integer").
  (ServiceConfig, "block_size", 1.5),
  (ServiceConfig, "max_chunk_bytes", 1e6),
  (FragmentSchedule, "num_fragments", 4.5),
  (SyncerConfig, "fused_merge_bytes", 1.5),
  (SyncerConfig, "keep_versions", "4"),
  (ClusterConfig, "seed", "x"),
  (ClusterConfig, "slow_learners", 1.5),
  (ChaosConfig, "seed", 0.5),
  (ChaosConfig, "min_up", 1.5),
  (TextDataConfig, "seq_len", 64.5),
  (VisionDataConfig, "batch_size", 8.5),
  (LearnerCheckpointConfig, "save_every_steps", 10.5),
  (ChaosConfig, "net_latency_s", NAN),
  (ChaosConfig, "net_latency_s", INF),
  (VisionDataConfig, "noise_std", NAN),
  (VisionDataConfig, "noise_std", INF),
  (RayConfig, "learner_num_cpus", NAN),
  (RayConfig, "learner_num_gpus", INF),
  (RayConfig, "syncer_num_cpus", NAN),
  (_run, "num_learners", 1.5),
  (_run, "steps_per_learner", 2.5),
  (_run, "eval_batches", 0),
  (_run, "seed", "x"),
  (_run, "batch_size", 0),
  (_run, "batch_size", -4),
  (_run, "batch_size", 8.5),
  (_run, "layout_strategy", "bogus"),
  (_run, "eval_every_s", NAN),
  (_run, "data_slots", 1.5),
  (_run, "data_slots", -1),
  (_run, "data_slots", 3),  # Below num_learners (4): learners would share data from the start.
  (_job, "senders", 1.5),
  (_job, "syncer_shards", 1.5),
]


@pytest.mark.parametrize(
  ("build", "field", "value"),
  _CASES,
  ids=[f"{getattr(b, '__name__', b)}-{f}-{v!r}" for b, f, v in _CASES],
)
def test_bad_value_is_refused_naming_the_field(build, field, value):
  with pytest.raises(ValueError, match=field):
    build(**{field: value})


@pytest.mark.parametrize(
  ("build", "kwargs"),
  [
    (ClusterConfig, {"max_time_s": INF, "bandwidth_gbps": INF}),
    (InnerOptConfig, {"b1": 0.0, "weight_decay": 0.0, "grad_clip_norm": 0.0}),
    (RayConfig, {"learner_num_cpus": 0.0, "learner_num_gpus": 0.5}),
    (_run, {"batch_size": None, "seed": -1, "layout_strategy": "tensor", "eval_every_s": 0.0}),
  ],
)
def test_edge_values_still_accepted(build, kwargs):
  config = build(**kwargs)
  for name, value in kwargs.items():
    assert getattr(config, name) == value


def test_numpy_integers_count_as_integers():
  # Counts computed with numpy (a study's grid, say) are integers too.
  FragmentSchedule(num_fragments=np.int64(4), period=np.int32(4), overlap=np.int64(1))
