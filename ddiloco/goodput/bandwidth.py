"""Bandwidth that data-parallel and Decoupled DiLoCo need between two sites (docs/algorithm.md §7).

Assumptions (docs/goodput.md, "Bandwidth model", derives each figure):

- Links are full duplex; a figure is the bandwidth of ONE direction of one site's link. Traffic
  is symmetric, so the other direction needs the same.
- Data-parallel all-reduces the full gradient every step with a ring between the sites (within a
  site the gradient is reduced first, on the fast fabric). Each site then sends
  2 (sites - 1) / sites gradients per step. The all-reduce overlaps with the backward pass, which
  is `overlap_fraction` = 2/3 of the step (backward costs twice the forward). Utilization is
  compute / (compute + exposed communication). The paper's 104 Gbit/s "for 90 % utilization"
  is the first-order criterion exposed <= (1 - 0.9) x step (`required_gbps`); exactly 90 %
  needs 102.9 Gbit/s (`exact_required_gbps`).
- Decoupled DiLoCo sends one fragment (1/P of the parameters) every H/P steps, upstream as an
  outer gradient and downstream as the merged update, each in its own direction. A learner never
  waits for the syncer (docs/algorithm.md §3): a fragment that arrives late is applied late. A fragment
  must therefore cross within its τ steps of overlap (the *deadline* figure, F / (τ·step)), and the
  link must keep up with one fragment every H/P steps (the *sustained* figure,
  F / (H/P · step)); the requirement is the larger of the two.
- Values are `bits_per_value` wide; quantized codecs add one `scale_bits` scale per `block_size`
  values (docs/algorithm.md §5).

With P = H = 24 and τ = 2 (docs/algorithm.md §2) the sustained figure is twice the deadline figure: one
fragment is due every step but each has two steps to arrive, so two share the link. The paper's
1.7 and 0.43 Gbit/s are the deadline figures, i.e. what is needed when a fragment is due every
τ steps (H = τ·P). gin_configs/goodput/bandwidth.gin reproduces them that way and prints the
P = H figures next to them.
"""

import dataclasses
import math

import numpy as np

_GIGA = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wire:
  """Encoding of values on the wire (docs/algorithm.md §5).

  Attributes:
    bits_per_value: bits of each value (16 for bf16, 4 for int4).
    block_size: values sharing one scale (0: no scales, e.g. bf16).
    scale_bits: bits of each scale.
  """

  bits_per_value: float = 16.0
  block_size: int = 0
  scale_bits: float = 16.0

  def __post_init__(self):
    if not self.bits_per_value > 0:
      raise ValueError(f"bits_per_value must be positive, got {self.bits_per_value}.")
    if self.block_size < 0:
      raise ValueError(f"block_size must be >= 0, got {self.block_size}.")
    if self.scale_bits < 0:
      raise ValueError(f"scale_bits must be >= 0, got {self.scale_bits}.")

  @property
  def bits(self) -> float:
    """Bits per value including the scales' share."""
    if self.block_size == 0:
      return self.bits_per_value
    return self.bits_per_value + self.scale_bits / self.block_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataParallelLink:
  """Data-parallel across sites: a ring all-reduce of the gradient every step.

  Attributes:
    params: trainable parameters.
    step_time_s: compute time of one step.
    sites: sites joined by the ring.
    overlap_fraction: share of the step the all-reduce can hide behind (the backward pass).
    wire: encoding of the gradient.
  """

  params: float
  step_time_s: float = 1.0
  sites: int = 2
  overlap_fraction: float = 2.0 / 3.0
  wire: Wire = Wire()

  def __post_init__(self):
    if not (self.params > 0 and self.step_time_s > 0):
      raise ValueError("params and step_time_s must be positive.")
    if self.sites < 2:
      raise ValueError(f"sites must be >= 2, got {self.sites}.")
    if not 0 <= self.overlap_fraction <= 1:
      raise ValueError(f"overlap_fraction must be in [0, 1], got {self.overlap_fraction}.")

  @property
  def bits_per_step(self) -> float:
    """Bits each site sends per step (reduce-scatter plus all-gather of a ring)."""
    return 2.0 * (self.sites - 1) / self.sites * self.params * self.wire.bits

  def required_gbps(self, utilization: float) -> float:
    """Bandwidth per direction that leaves at most (1 - utilization) of the step exposed.

    This first-order criterion is the one the paper's figure implies (docs/goodput.md).

    Raises:
      ValueError: if utilization is not in (0, 1].
    """
    _check_utilization(utilization)
    return self._gbps_for_exposed((1.0 - utilization) * self.step_time_s)

  def exact_required_gbps(self, utilization: float) -> float:
    """Bandwidth per direction at which compute / (compute + exposed) equals `utilization`.

    Raises:
      ValueError: if utilization is not in (0, 1].
    """
    _check_utilization(utilization)
    return self._gbps_for_exposed((1.0 / utilization - 1.0) * self.step_time_s)

  def _gbps_for_exposed(self, exposed_s: float) -> float:
    return self.bits_per_step / (self.overlap_fraction * self.step_time_s + exposed_s) / _GIGA

  def utilization(self, gbps: np.ndarray | float) -> np.ndarray:
    """compute / (compute + exposed communication) with the given Gbit/s per direction."""
    comm_s = self.bits_per_step / (np.asarray(gbps, dtype=np.float64) * _GIGA)
    exposed = np.maximum(0.0, comm_s - self.overlap_fraction * self.step_time_s)
    return self.step_time_s / (self.step_time_s + exposed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiLoCoLink:
  """Decoupled DiLoCo: one fragment per H/P steps, each with τ steps to cross.

  Attributes:
    params: trainable parameters.
    step_time_s: compute time of one inner step.
    fragments: P.
    inner_steps: H, steps between two syncs of the same fragment.
    overlap_steps: τ.
    wire: encoding of outer gradients and merged updates.
  """

  params: float
  step_time_s: float = 1.0
  fragments: int = 24
  inner_steps: int = 24
  overlap_steps: int = 2
  wire: Wire = Wire()

  def __post_init__(self):
    if not (self.params > 0 and self.step_time_s > 0):
      raise ValueError("params and step_time_s must be positive.")
    if self.fragments < 1 or self.inner_steps < self.fragments:
      raise ValueError("Need 1 <= fragments <= inner_steps (at most one fragment due per step).")
    if self.overlap_steps < 1:
      raise ValueError(f"overlap_steps must be >= 1, got {self.overlap_steps}.")

  @property
  def fragment_bits(self) -> float:
    """Bits of one fragment on the wire."""
    return self.params / self.fragments * self.wire.bits

  @property
  def deadline_gbps(self) -> float:
    """Bandwidth at which one fragment crosses within its τ steps of overlap."""
    return self.fragment_bits / (self.overlap_steps * self.step_time_s) / _GIGA

  @property
  def sustained_gbps(self) -> float:
    """Bandwidth that keeps up with one fragment every H/P steps."""
    period_s = self.inner_steps / self.fragments * self.step_time_s
    return self.fragment_bits / period_s / _GIGA

  def required_gbps(self) -> float:
    """Bandwidth per direction at which every fragment arrives on time (100 % utilization)."""
    return max(self.deadline_gbps, self.sustained_gbps)

  def link_load(self, gbps: np.ndarray | float) -> np.ndarray:
    """ρ: the bandwidth the schedule needs over the bandwidth given (`required_gbps() / gbps`);
    above 1 the link cannot carry every fragment in time."""
    return self.required_gbps() / np.asarray(gbps, dtype=np.float64)

  def learner_utilization(self, gbps: np.ndarray | float) -> np.ndarray:
    """Compute utilization of a Decoupled DiLoCo learner: 1 at any bandwidth.

    It never waits for the link (docs/algorithm.md §3): its senders push in the background, and a
    newer answer of a fragment replaces one not yet sent. What a slow link costs it is answers
    that miss their rounds or weigh nothing (the merged fraction, measured by
    scripts/bench_links.py; not predicted here), not steps. `utilization` is the learner that
    waits.
    """
    return np.ones_like(np.asarray(gbps, dtype=np.float64))

  def utilization(self, gbps: np.ndarray | float) -> np.ndarray:
    """Utilization of a learner that waits for late fragments (Streaming DiLoCo's behaviour).

    Below the required bandwidth the link, not the chips, sets the pace of fragments and so of
    steps. Decoupled DiLoCo itself never waits: there the shortfall shows up as staleness.
    """
    return np.minimum(1.0, np.asarray(gbps, dtype=np.float64) / self.required_gbps())


def _check_utilization(utilization: float) -> None:
  if not (0 < utilization <= 1 and math.isfinite(utilization)):
    raise ValueError(f"utilization must be in (0, 1], got {utilization}.")


def reduction_factor(data_parallel_gbps: float, diloco_gbps: float) -> float:
  """How many times less bandwidth Decoupled DiLoCo needs."""
  return data_parallel_gbps / diloco_gbps
