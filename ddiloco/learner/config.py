"""A learner's protocol knobs (`LearnerConfig`) and their check against the syncer's pacing."""

import dataclasses
from typing import TYPE_CHECKING

from ddiloco.learner.carry import APPLY_RULES

if TYPE_CHECKING:  # The learner's kernel imports this module, and must not import optax (jax).
  from ddiloco.syncer.types import SyncerConfig

DEVICE_ENCODE = ("auto", "always", "never")  # `LearnerConfig.device_encode`.


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Learner-side protocol knobs.

  Attributes:
    mixing_alpha: θ_p ← (1 − α)·Θ_p + α·θ_p on apply (docs/algorithm.md §3); 0 overwrites.
    apply_rule: what an apply with α = 0 does to the progress made since this learner's answer:
      "overwrite" (Decoupled DiLoCo, the default) drops it; "carry" keeps it, θ_p ← Θ_p + (θ_p −
      θ_p^answered), when Θ_p is the merge of a round this learner answered (learner/carry.py).
    blocking: answer a round when this learner's own step reaches the round's step, and wait at
      answer + τ until the merge has arrived. True only for the synchronous baselines (DiLoCo,
      Streaming DiLoCo, K = M); Decoupled DiLoCo never waits.
    step_in_flight: the learner process keeps the next step dispatched while it does the step
      boundary's work (draining, applying, answering, logging), which hides that host work behind
      the step. A round request that arrives meanwhile is then answered after that step too: about
      1.5 steps after it arrived on average instead of 0.5, which can miss the round's grace window.
    device_encode: where answers' δ is encoded in the uplink's codec by a program on the learner's
      devices, only the encoded bytes coming back to the host (learner/snapshot.py,
      fragments/device_codec.py): "auto" (the default) on accelerators; "always" on any device,
      XLA's CPU backend included, where the numpy codec is cheaper (tests, comparisons); "never".
      A multi-process learner always encodes on its leader's host. The bytes may differ from the
      host codec's by an ulp of a block scale (on an H200, about half the blocks): the syncer
      decodes what it receives, so any valid encoding is right (scripts/check_device_codec.py).
  """

  mixing_alpha: float = 0.0
  apply_rule: str = "overwrite"
  blocking: bool = False
  step_in_flight: bool = False
  device_encode: str = "auto"

  def __post_init__(self):
    if not 0.0 <= self.mixing_alpha < 1.0:
      raise ValueError(f"mixing_alpha must be in [0, 1), got {self.mixing_alpha}.")
    if self.device_encode not in DEVICE_ENCODE:
      raise ValueError(f"device_encode must be one of {DEVICE_ENCODE}, got {self.device_encode!r}.")
    if self.apply_rule not in APPLY_RULES:
      raise ValueError(f"apply_rule must be one of {APPLY_RULES}, got {self.apply_rule!r}.")
    if self.apply_rule == "carry" and self.mixing_alpha > 0:
      raise ValueError(
        f"apply_rule = 'carry' needs mixing_alpha = 0 (got {self.mixing_alpha}): both decide what "
        "an apply keeps of the learner's own θ_p, and together they are not defined."
      )


def check_pacing(learner: LearnerConfig, syncer: "SyncerConfig") -> None:
  """Blocking learners wait at each due step for its round: only the lock-step clock opens it.

  Raises:
    ValueError: if `learner.blocking` without `syncer.clock == "slowest"`.
  """
  if learner.blocking and syncer.clock != "slowest":
    raise ValueError(
      "LearnerConfig.blocking = True needs SyncerConfig.clock = 'slowest' (lock-step rounds): "
      f"with clock = {syncer.clock!r} a round a blocking learner waits for may never open."
    )
