"""Every gin configurable of ddiloco, registered in one place; the library itself never imports gin.

The library's classes and functions are plain Python (t5x keeps its library free of gin the same
way). `register()` makes each one below known to gin under its name (`ddiloco.JobConfig`,
`ddiloco.simulate`, `ddiloco.transformer_config`, `optax.sgd`, `goodput.Fleet`, ...) without changing
it: a direct call such as `SyncerConfig()` ignores gin, while gin applies the bindings to the objects
it builds through references (`RunConfig.syncer = @SyncerConfig()`) and to `configured(X)()`.

An entry point registers before it parses its gin files (`gin_flags.parse_gin` does) and builds its
top-level object through gin:

  configurables.parse(["gin_configs/local_tiny.gin"], ["STEPS = 48"])
  job = configurables.configured(JobConfig)()

A new configurable (a model's config function, a task, a config class) is one more entry in
`_CONFIGURABLES` below, under the name its gin files use.
"""

import inspect
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import gin
import optax

from ddiloco.checkpoint.learner import LearnerCheckpointConfig
from ddiloco.checkpoint.syncer import SyncerCheckpointConfig
from ddiloco.data.text import TextDataConfig
from ddiloco.data.token_shards import TokenShardDataConfig
from ddiloco.data.vision import VisionDataConfig
from ddiloco.faults.schedule import ChaosConfig
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.goodput import bandwidth, capacity
from ddiloco.goodput import model as goodput_model
from ddiloco.goodput import report as goodput_report
from ddiloco.launch import configs
from ddiloco.launch.job import JobConfig
from ddiloco.launch.ray_config import RayConfig
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train_step import InnerOptConfig
from ddiloco.models.configs import (
  TransformerConfig,
  VitConfig,
  hf_llama_config,
  transformer_config,
  vit_config,
)
from ddiloco.run_config import RunConfig
from ddiloco.service.service_config import ServiceConfig
from ddiloco.simulation.config import ClusterConfig
from ddiloco.simulation.simulate import simulate
from ddiloco.syncer.merge_rules import RDA, WeightedMean
from ddiloco.syncer.outer_optimizers import nesterov_warmup
from ddiloco.syncer.staleness_rule import StalenessDiscountedMean
from ddiloco.syncer.types import SyncerConfig
from ddiloco.tasks import TextTask, TokenShardTask, VisionTask

T = TypeVar("T")

# (gin module, what it holds, keyword arguments of gin.register): each name is `module.__name__`.
_CONFIGURABLES: tuple[tuple[str, tuple[Callable[..., Any], ...], dict[str, Any]], ...] = (
  (
    "ddiloco",
    (
      RunConfig,
      JobConfig,
      ClusterConfig,
      FragmentSchedule,
      SyncerConfig,
      # The merge rules, e.g. `SyncerConfig.merge_rule = @RDA()` (docs/algorithm.md §4.5).
      RDA,
      WeightedMean,
      StalenessDiscountedMean,
      ServiceConfig,
      LearnerConfig,
      InnerOptConfig,
      TextDataConfig,
      VisionDataConfig,
      TextTask,
      TokenShardDataConfig,
      TokenShardTask,
      VisionTask,
      transformer_config,
      hf_llama_config,
      TransformerConfig,
      vit_config,
      VitConfig,
      SyncerCheckpointConfig,
      LearnerCheckpointConfig,
      ChaosConfig,
      RayConfig,
    ),
    {},
  ),
  # `workdir` and `progress` are the caller's, never a gin file's.
  ("ddiloco", (simulate,), {"denylist": ["workdir", "progress"]}),
  # Outer optimizers beside optax's (`SyncerConfig.outer_optimizer = @outer/nesterov_warmup`).
  ("ddiloco", (nesterov_warmup,), {}),
  # The optax transformations an inner optimizer may be built from in gin, e.g.
  #   InnerOptConfig.optimizer = @optax.sgd
  #   optax.sgd.momentum = 0.9
  # Any other callable taking `learning_rate` and returning an optax transformation works from Python.
  ("optax", (optax.sgd, optax.adam, optax.adamw, optax.lion, optax.lamb, optax.rmsprop), {}),
  # `ddiloco-goodput`: the analytic models and their studies (docs/goodput.md).
  (
    "goodput",
    (
      goodput_model.RecoveryDelay,
      goodput_model.Fleet,
      goodput_model.Costs,
      goodput_model.DataParallel,
      goodput_model.DecoupledDiLoCo,
      goodput_model.Scavenging,
      goodput_report.GoodputStudy,
      goodput_report.experiment,
    ),
    {},
  ),
  (
    "bandwidth",
    (
      bandwidth.Wire,
      bandwidth.DataParallelLink,
      bandwidth.DiLoCoLink,
      goodput_report.BandwidthStudy,
    ),
    {},
  ),
  (
    "capacity",
    (capacity.SyncerCosts, capacity.SyncerLoad, capacity.MeasuredShard, capacity.CapacityStudy),
    {},
  ),
)

# Arguments that the library replaces, when None, by their class built without arguments
# (`run.syncer or SyncerConfig()`, `fleet or ClusterConfig()`). Those classes' bindings used to reach
# such a default even when a file never referred to the class (`SyncerConfig.min_quorum = 2` without
# `RunConfig.syncer = @SyncerConfig()`); `configured` passes gin's version in their place, so such a
# file keeps its meaning. That holds for the objects `configured` builds (a `RunConfig` built as
# `configured(RunConfig)()`, or by `configured(JobConfig)()` and `configured(simulate)()` when the
# file leaves their `run` unset); the shipped base files refer to every one of them explicitly.
_DEFAULTED = {
  "syncer": SyncerConfig,
  "learner": LearnerConfig,
  "inner_opt": InnerOptConfig,
  "service": ServiceConfig,
  "fleet": ClusterConfig,
  "run": RunConfig,
}
_TOP_LEVEL = {
  RunConfig: "ddiloco.RunConfig",
  JobConfig: "ddiloco.JobConfig",
  simulate: "ddiloco.simulate",
}

_lock = threading.Lock()
_registered = False


def register() -> None:
  """Registers every configurable with gin; later calls do nothing (gin refuses a second one)."""
  global _registered
  with _lock:
    if _registered:
      return
    with gin.unlock_config():  # A finalized config refuses new configurables.
      for module, objects, kwargs in _CONFIGURABLES:
        for obj in objects:
          gin.register(obj, module=module, **kwargs)
    _registered = True


def configured(fn_or_cls: Callable[..., T] | str) -> Callable[..., T]:
  """gin's version of a registered class or function: calling it applies the parsed bindings.

  Arguments given in the call win over bindings, as with any gin configurable. For `RunConfig`,
  `JobConfig` and `simulate`, a `run`, `fleet`, `syncer`, `learner`, `inner_opt` or `service` that
  the configuration leaves unset (or None) is built by gin too (see `_DEFAULTED`).

  Args:
    fn_or_cls: a class or function of `_CONFIGURABLES` (e.g. `JobConfig`), or its gin name
      ("ddiloco.JobConfig", "JobConfig").

  Returns:
    A callable with the signature of `fn_or_cls`.

  Raises:
    ValueError: if no configurable has that name.
  """
  register()
  fn = gin.get_configurable(fn_or_cls)
  target = fn_or_cls
  if isinstance(fn_or_cls, str):  # gin has no public lookup of what a name registers.
    target = gin.config._REGISTRY.get_match(fn_or_cls.split("/")[-1]).wrapped
  selector = _TOP_LEVEL.get(target)
  if selector is None:
    return fn
  defaulted = {k: v for k, v in _DEFAULTED.items() if _has_parameter(target, k)}

  def call(*args: Any, **kwargs: Any) -> T:
    for name, cls in defaulted.items():
      if name not in kwargs and _unset(f"{selector}.{name}"):
        kwargs[name] = configured(cls)()
    return fn(*args, **kwargs)

  return call


def parse(files: Sequence[str], bindings: Sequence[str] = (), *, search_paths: Sequence[str] = ()):
  """Clears gin's configuration, registers, then parses `files` and `bindings` (in that order).

  Files are found as the command lines find them: as given, else among the shipped configs by
  name ("local_tiny.gin", launch/configs.py). Includes are searched in `search_paths`, then in each
  file's folder and its parent (gin_configs/runs/x.gin can include "models/tiny.gin"), then in the
  shipped configs' folder.

  Args:
    files: gin files.
    bindings: bindings applied after the files ("KEY = VALUE").
    search_paths: folders searched first for relative files and includes.
  """
  gin.clear_config()
  register()
  for path in search_paths:
    gin.add_config_file_search_path(path)
  files = [configs.resolve(f) for f in files]
  for path in files:
    folder = os.path.dirname(os.path.abspath(path))
    gin.add_config_file_search_path(folder)
    gin.add_config_file_search_path(os.path.dirname(folder))
  configs.add_search_path()  # Last: the shipped configs' includes, from any folder.
  gin.parse_config_files_and_bindings(files, list(bindings), finalize_config=False)


def clear() -> None:
  """Clears gin's configuration (the registrations stay)."""
  gin.clear_config()


def simulate_files(
  files: Sequence[str],
  bindings: Sequence[str] = (),
  *,
  search_paths: Sequence[str] = (),
  **kwargs: Any,
) -> dict[str, Any]:
  """One simulated run configured by `files` then `bindings`, parsed afresh; returns its summary.

  Args:
    files: gin files (see `parse`).
    bindings: bindings after the files.
    search_paths: folders searched for the files and their includes.
    **kwargs: `simulate`'s own arguments: `workdir`, and e.g. `progress`, `tensorboard=False`.

  Returns:
    `simulate`'s summary. gin's configuration is cleared afterwards.
  """
  parse(files, bindings, search_paths=search_paths)
  try:
    return configured(simulate)(**kwargs)
  finally:
    clear()


class _Resolved(Exception):
  """Stops `simulate` once its arguments are built (`resolved_config`)."""


def _stop() -> None:
  raise _Resolved


def resolved_config(
  files: Sequence[str], bindings: Sequence[str] = (), *, search_paths: Sequence[str] = ()
) -> str:
  """The configuration a simulated run of `files` then `bindings` resolves to, as gin text.

  Every parameter of every configurable the run builds, the library's defaults included (gin's
  operative configuration, taken once `simulate` has built and checked its arguments, before it
  trains), followed by every binding parsed (so that the parameters of configurables built later,
  such as an inner optimizer's, count too). Two runs with the same text are the same experiment
  on the same code: a study signs its stored results with it, so a changed default or gin file
  runs them again instead of reusing them.

  Args:
    files: gin files (see `parse`).
    bindings: bindings after the files.
    search_paths: folders searched for the files and their includes.

  Returns:
    The text; gin's configuration is cleared afterwards.

  Raises:
    ValueError: for a configuration `simulate` refuses (as a run of it would).
  """
  parse(files, bindings, search_paths=search_paths)
  try:
    with tempfile.TemporaryDirectory() as workdir:
      try:
        configured(simulate)(workdir=workdir, tensorboard=False, on_start=_stop)
      except _Resolved:
        pass
      else:  # on_start is simulate's contract; a run that never called it resolved nothing.
        raise RuntimeError("simulate returned without calling on_start.")
    return f"{gin.operative_config_str()}\n# Bindings parsed\n# {'=' * 78}\n{gin.config_str()}"
  finally:
    clear()


def _has_parameter(fn_or_cls: Callable[..., Any], name: str) -> bool:
  return name in inspect.signature(fn_or_cls).parameters


def _unset(binding: str) -> bool:
  """Whether the configuration leaves `binding` ("module.Name.param") unbound or None."""
  try:
    return gin.query_parameter(binding) is None
  except ValueError:  # Not bound.
    return True
