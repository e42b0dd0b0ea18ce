"""What learners and the syncer exchange, whatever carries it (in-process or gRPC).

The syncer asks with a `RoundRequest`. A learner's kernel answers with an `Answer`: θ_p as it
trained it, and the anchor Θ_p^(anchor) the wire's outer gradient δ = Θ^(anchor) − θ is formed
against (`Uplink` says which of the two the wire carries). The learner's transport turns it into a
Push at its edge (learner_process/link.py); the syncer's door reads that Push as a `Report`, whose
values are what the wire carried (δ, or fp32 θ), and answers with a `ReportResult`. The syncer
publishes each merged fragment as a `FragmentState` (version, Θ_p, digest): always the full
values, since a learner's transport decodes a downlink delta against the base it holds before its
kernel sees it. Nothing here knows how any of them travels (`ddiloco.transport`).
"""

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Protocol

import ml_dtypes
import numpy as np

# An outer gradient the bf16 uplink sent may be kept as it was sent, a bfloat16 array standing for a
# float32 tensor (transport/fragment_reader.py, `as_sent`): its widening to float32 is exact, and the
# syncer widens it where it reads it (`holds_values_of`).
_AS_SENT = {(np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))}

# Bounds on the counters a learner sends. They are far above any real run (2^40 steps is ~35,000
# years at one step per second) and far below int64, so every sum the syncer forms of them (its
# ledger, its counters, its checkpoint) stays exact.
MAX_STEP = 2**40
MAX_TOKENS = 2**50


def counter_error(**counters: int) -> str | None:
  """Why learner-sent counters (steps, tokens, ...) are invalid, or None.

  Every counter must be an integer in [0, MAX_STEP] (names with "tokens": [0, MAX_TOKENS]).
  """
  for name, value in counters.items():
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
      return f"{name} must be an integer, got {value!r}"
    bound = MAX_TOKENS if "tokens" in name else MAX_STEP
    if value < 0:
      return f"negative counter: {name}={value}"
    if value > bound:
      return f"implausible counter: {name}={value} exceeds {bound}"
  return None


def step_time_error(step_time_s: float) -> str | None:
  """Why a learner's reported step time is invalid (it must be finite and >= 0), or None."""
  if not isinstance(step_time_s, int | float | np.floating) or not math.isfinite(step_time_s):
    return f"step_time_s must be finite and >= 0, got {step_time_s!r}"
  if step_time_s < 0:
    return f"step_time_s must be finite and >= 0, got {step_time_s!r}"
  return None


@dataclasses.dataclass(frozen=True)
class RoundRequest:
  """The syncer asks every live learner for fragment p: round (p, t) is open (syncer → learner).

  Attributes:
    fragment: p.
    round_step: t, the step of the syncer's schedule clock at which p was due; the round's id.
    base_version: the version of p the round was opened against; an answer anchored elsewhere
      weighs 0, and the merge moves Θ_p from this version.
  """

  fragment: int
  round_step: int
  base_version: int


class Uplink(enum.Enum):
  """What an answer's payload is on the wire (docs/algorithm.md §5)."""

  DELTA = "delta"  # δ = Θ^(anchor) − θ in the negotiated uplink codec, merged as decoded.
  THETA = "theta"  # θ itself, fp32: the learner holds no anchor of p (never received it).


@dataclasses.dataclass(frozen=True)
class EncodedDelta:
  """A fragment's outer gradient δ, already encoded: what a push sends as its payload.

  Attributes:
    codec: the codec's name.
    block_size: values per scale.
    entries: per layout key, (payload as uint8, float32 scales; empty for fp32 and bf16).
  """

  codec: str
  block_size: int
  entries: dict[str, tuple[np.ndarray, np.ndarray]]


class Theta(Protocol):
  """θ_p as an answer took it: a host copy, or a snapshot on the devices (learner/snapshot.py)."""

  def __call__(self) -> Mapping[str, np.ndarray]:
    """θ_p in host memory, keyed as the layout keys it."""

  def encode_delta(
    self, codec: str, anchor: Mapping[str, np.ndarray], block_size: int
  ) -> EncodedDelta | None:
    """δ = anchor − θ_p already encoded (on the devices: fragments/device_codec.py), or None:
    encode on the host."""


@dataclasses.dataclass(frozen=True)
class HostTheta:
  """θ_p copied to host memory when the answer was made (the simulator's answers)."""

  values: Mapping[str, np.ndarray]

  def __call__(self) -> Mapping[str, np.ndarray]:
    return self.values

  def encode_delta(self, codec: str, anchor: Mapping[str, np.ndarray], block_size: int) -> None:
    """None: the host encodes δ."""
    del codec, anchor, block_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Answer:
  """One learner's answer to round (p, t), as its kernel makes it (learner → its transport).

  Attributes:
    learner_id: the answering learner.
    fragment: p.
    round_step: t, the round it answers (`RoundRequest.round_step`); -1: no round (unsolicited).
    step: the learner's schedule step when it answered (orders a restarted learner's answers).
    anchor_version: the version of p the learner last applied; -1 if it never received p. The
      answer weighs more than 0 only if this is the round's base version.
    tokens: tokens since the learner last applied p.
    steps: inner steps since then.
    new_tokens: tokens trained since the learner's previous answer of p: each trained token is in
      exactly one answer, which the token ledger follows to its fate (learner/ledger.py).
    step_time_s: the learner's step time, feeds ξ_step; 0 = unknown.
    theta: θ_p as answered (a host copy, or a device snapshot read when the answer is sent).
    anchor: Θ_p^(anchor_version) as the learner holds it; None when it holds none (`Uplink.THETA`).
  """

  learner_id: int
  fragment: int
  round_step: int
  step: int
  anchor_version: int
  tokens: int
  steps: int
  new_tokens: int
  step_time_s: float = 0.0
  theta: Theta
  anchor: Mapping[str, np.ndarray] | None

  @property
  def uplink(self) -> Uplink:
    """δ against the anchor when the learner holds it, else θ."""
    return Uplink.THETA if self.anchor is None else Uplink.DELTA

  def as_report(self, theta: Mapping[str, np.ndarray]) -> "Report":
    """The Push header's fields with θ_p's host values (`theta`; empty when the devices encoded
    δ): what the learner's transport encodes, at its edge (learner_process/link.py)."""
    return Report(
      learner_id=self.learner_id,
      fragment=self.fragment,
      values=theta,
      tokens=self.tokens,
      steps=self.steps,
      anchor_version=self.anchor_version,
      step=self.step,
      step_time_s=self.step_time_s,
      new_tokens=self.new_tokens,
      round_step=self.round_step,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
  """One answer of one fragment as the wire carries it: the syncer's door reads a Push as a Report.

  A learner's kernel makes an `Answer`; its transport makes a Report of it only to encode the Push
  (θ, from which the encoder forms δ against the answer's anchor). What the door reads and the
  core files is a Report whose values are what was sent: δ (`outer_gradient`) or fp32 θ.

  Attributes:
    learner_id: the reporting learner.
    fragment: fragment index p.
    values: on the learner's side, θ_{m,p} to encode; on the syncer's, as read from the wire: the
      outer gradient δ = Θ^(anchor) − θ_{m,p} with `outer_gradient`, else θ_{m,p}. Each array
      has its tensor's shape and dtype, or (δ only) the dtype it was sent in where that widens
      exactly to the tensor's (bf16's bfloat16 for float32, `holds_values_of`); a reader widens
      it (`astype(np.float32)`, in XLA or numpy) and gets the decoded values bit for bit.
    tokens: tokens since the learner last applied p (it resets them at every apply).
    steps: inner steps since then.
    anchor_version: version of p the learner last applied; -1 if it never received p. It weighs
      more than 0 only if this is the round's base version.
    step: the learner's schedule step when it answered (orders a restarted learner's answers).
    step_time_s: the learner's step-time EMA, feeds ξ_step; 0 = unknown.
    new_tokens: tokens trained since the learner's previous report of p (not since it received p):
      each trained token is in exactly one report, which the token ledger follows to its fate.
    round_step: the round it answers, by the syncer's schedule step that opened it
      (`RoundRequest.round_step`).
    outer_gradient: whether `values` is δ = Θ^(anchor) − θ (encoded once by the learner and merged
      as decoded, docs/algorithm.md §5) rather than θ. Needs anchor_version >= 0.
    sq_norms: with `outer_gradient`, per key, ‖values[key]‖² summed as the syncer's door sums it
      (`syncer/merge.finite_sq_norm`: float32 dot products of blocks of `blockwise.BLOCK_VALUES`
      values, added in float64 in order), every block's finite: the syncer's receiving transport
      computes it from the values as they arrive, while they are in cache (transport/
      fragment_reader.py), and the door then takes it instead of a pass of its own over them. A
      key without one (or None) is checked and summed by the door. Never read off the wire.
  """

  learner_id: int
  fragment: int
  values: Mapping[str, np.ndarray]
  tokens: int
  steps: int
  anchor_version: int
  step: int
  step_time_s: float = 0.0
  new_tokens: int = 0
  round_step: int = -1
  outer_gradient: bool = False
  sq_norms: Mapping[str, float] | None = None


def holds_values_of(dtype: np.dtype, tensor_dtype: np.dtype, outer_gradient: bool) -> bool:
  """Whether a `Report`'s array of `dtype` may hold the values of a tensor of `tensor_dtype`: its
  own dtype, or for an outer gradient a dtype kept as sent that widens to it exactly (bfloat16 for
  float32)."""
  dtype, tensor_dtype = np.dtype(dtype), np.dtype(tensor_dtype)
  return dtype == tensor_dtype or (bool(outer_gradient) and (dtype, tensor_dtype) in _AS_SENT)


@dataclasses.dataclass(frozen=True)
class ReportResult:
  """What `SyncerCore.report` did: status is accepted | superseded | late | duplicate | rejected.

  `fleet_step` is the syncer's schedule clock when the report arrived (`RoundPacer.cadence_step`).
  `round_version` is the version the round that took the report will publish (-1 if none took it):
  once the fragment reaches it, the report was merged, or it was lost (the token ledger).
  """

  status: str
  reason: str
  weight: float
  fleet_step: int = -1
  round_version: int = -1

  @property
  def merged_weight(self) -> bool:
    """Whether the report joined its round with a weight > 0 (it will be merged)."""
    return self.status in ("accepted", "superseded") and self.weight > 0


@dataclasses.dataclass(frozen=True)
class FragmentState:
  """A version of a fragment's global values Θ_p; the arrays are read-only and shared."""

  fragment: int
  version: int
  values: dict[str, np.ndarray]
  digest: str
