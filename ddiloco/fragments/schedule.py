"""When each fragment is sent, and when the merged result is applied (docs/algorithm.md §2, §3).

Steps count *completed* inner steps: after the learner's first optimizer update t = 1. Fragment p has
offset t_p = floor(p·H/P) and is due after step t when t >= 1 and (t − t_p) mod H == 0. So fragment 0
(offset 0) is first due at t = H, and fragment p > 0 first at t = t_p. With P = H every step has exactly
one fragment due; with P < H some steps have none; with P > H several fragments share a step (their
offsets coincide), which is allowed. A fragment sent after step s is applied once the learner has
completed step s + τ (the overlap), so τ < H keeps the merge of one round landing before the next
round of the same fragment is sent.

Slices (docs/architecture.md, "The sharded syncer"). With `slices` = S > 1 each of the P fragments
(a "group") is cut into S slices, and the layout's fragment ids run over [0, P·S): fragment f is
slice f mod S of group f // S, and is due exactly when its group would be (offset t_{f // S}), so
the S slices of a group are sent together and merged, each by its own syncer shard, in parallel.
Each slice is a fragment of its own in every other respect (round, quorum, version, digest). S = 1
is the plain schedule.
"""

import dataclasses

from ddiloco.types import check_int_fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class FragmentSchedule:
  """The streaming schedule: P fragments, period H, overlap τ (docs/algorithm.md §2 defaults P = H = 24, τ = 2).

  Attributes:
    num_fragments: P >= 1, the groups of the schedule (the fragments when `slices` = 1).
    period: H >= 1 inner steps between two sends of the same fragment.
    overlap: τ in [0, H): steps between sending a fragment and applying its merge. τ = 0 applies the
      merge before the next step (synchronous configurations, e.g. DiLoCo or identity tests).
    slices: S >= 1 slices per group (module docstring): fragment ids run over [0, P·S). Set by
      the launchers from `JobConfig.syncer_shards`, not by hand.
  """

  num_fragments: int = 24
  period: int = 24
  overlap: int = 2
  slices: int = 1

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    if self.num_fragments < 1:
      raise ValueError(f"num_fragments must be >= 1, got {self.num_fragments}.")
    if self.slices < 1:
      raise ValueError(f"slices must be >= 1, got {self.slices}.")
    if self.period < 1:
      raise ValueError(f"period must be >= 1, got {self.period}.")
    if not 0 <= self.overlap < self.period:
      raise ValueError(f"overlap must be in [0, period={self.period}), got {self.overlap}.")

  @property
  def total_fragments(self) -> int:
    """The fragment ids' count, P·S: the layout's fragments."""
    return self.num_fragments * self.slices

  def group(self, p: int) -> int:
    """The group of fragment `p` (p // S; p itself when S = 1).

    Raises:
      ValueError: if `p` is not in [0, P·S).
    """
    self._check_fragment(p)
    return p // self.slices

  def _check_fragment(self, p: int) -> None:
    if not 0 <= p < self.total_fragments:
      raise ValueError(f"Fragment {p} out of range [0, {self.total_fragments}).")

  def offset(self, p: int) -> int:
    """Returns t_p = floor(g·H/P) for fragment `p` of group g, its phase within the period.

    Raises:
      ValueError: if `p` is not in [0, P·S).
    """
    return self.group(p) * self.period // self.num_fragments

  def is_due(self, p: int, t: int) -> bool:
    """Whether fragment `p` is sent after completed step `t`."""
    return t >= 1 and (t - self.offset(p)) % self.period == 0

  def due(self, t: int) -> tuple[int, ...]:
    """Returns the fragments due after completed step `t`, in increasing order.

    Raises:
      ValueError: if `t` is negative.
    """
    if t < 0:
      raise ValueError(f"Step must be >= 0, got {t}.")
    return tuple(p for p in range(self.total_fragments) if self.is_due(p, t))

  def apply_step(self, send_step: int) -> int:
    """Returns the step after which a fragment sent after `send_step` is applied (send_step + τ)."""
    return send_step + self.overlap

  def next_due(self, p: int, t: int) -> int:
    """Returns the first step strictly after `t` at which fragment `p` is due.

    Raises:
      ValueError: if `p` is not in [0, P·S).
    """
    first = max(t + 1, 1)
    return first + (self.offset(p) - first) % self.period
