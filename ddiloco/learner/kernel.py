"""One learner's side of the round protocol (docs/algorithm.md §3) as pure state: numpy only.

The kernel decides; the devices do. It holds everything that steers the protocol, and no jax
array, thread, socket or clock: the step and the counters of every fragment, the versions held
(their one owner, learner/held.py) and the one applied of each (its anchor), the versions received
and not applied yet, the rounds asked and answered (learner/rounds.py), the token ledger
(learner/ledger.py) and, with the `carry` rule, the answers outstanding (learner/carry.py). Its
device-facing collaborator (learner/device.py) reads and writes θ on the learner's devices; the
`Learner` (learner/learner.py) composes the two, and `step_boundary` (learner/boundary.py) is what
both runtimes call between steps.

Decisions (docs/algorithm.md §3):
- The syncer paces the rounds; a learner answers every round it is asked for, once, tagged with
  the round's step, unless a version of p newer than the round's base arrived first (it merged).
  It answers once it holds the round's base and has trained p since its last apply.
- A received version is applied as soon as τ steps have passed since this learner answered p's
  round; a version of a round it did not answer is applied at once, and so is one a round of p
  asked for next is based on. The counters of p restart at every apply, whether or not the answer
  was merged: θ_p is overwritten either way.
- `blocking` (the synchronous baselines) answers a round once the learner's own schedule step has
  reached the round's step, and waits at answer + τ until the merge has arrived.
- α = 0 overwrites θ_p with Θ_p; α > 0 mixes, θ_p ← (1 − α)·Θ_p + α·θ_p; with `apply_rule =
  "carry"` an apply of a round this learner answered keeps the progress made since the answer,
  θ_p ← Θ_p + (θ_p − θ_p^answered), and the counters of p keep what it holds.
"""

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from ddiloco.fragments.layout import FragmentLayout
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.learner import carry
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.held import HeldVersions
from ddiloco.learner.ledger import TokenLedger, taken
from ddiloco.learner.rounds import RoundBook
from ddiloco.protocol import Answer, FragmentState, ReportResult, RoundRequest, Theta


@dataclasses.dataclass(frozen=True)
class Apply:
  """An apply the kernel decided: write Θ_p, then, with a carry or a mix, the learner's blend.

  Attributes:
    state: the version applied (Θ_p, its version and the syncer's digest of it).
    carried: with "carry", the answer whose merge this is (its progress since is kept).
    alpha: `mixing_alpha`.
  """

  state: FragmentState
  carried: Answer | None
  alpha: float

  @property
  def fragment(self) -> int:
    return self.state.fragment

  @property
  def version(self) -> int:
    return self.state.version

  @property
  def reads_own(self) -> bool:
    """Whether the blend needs θ_p as the learner holds it before Θ_p is written."""
    return self.carried is not None or self.alpha > 0

  def blend(self, own: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """What is written over Θ_p after its digest is read back, or None (a plain overwrite).

    Args:
      own: θ_p before the apply, on the host (needed when `reads_own`).
    """
    if self.carried is not None:
      return carry.carried(self.state.values, own, self.carried.theta())
    if self.alpha > 0:
      return carry.mixed(self.state.values, own, self.alpha)
    return None


class LearnerKernel:
  """The protocol state of one learner and its decisions (see module docstring).

  Args:
    learner_id: this learner's id at the syncer.
    layout: the fragment layout (identical on every learner and the syncer).
    schedule: when each fragment is due, and τ.
    config: protocol knobs.
  """

  def __init__(
    self,
    *,
    learner_id: int,
    layout: FragmentLayout,
    schedule: FragmentSchedule,
    config: LearnerConfig | None = None,
  ):
    if schedule.total_fragments != layout.num_fragments:
      raise ValueError(
        f"schedule has {schedule.total_fragments} fragments (P={schedule.num_fragments} x "
        f"{schedule.slices} slices) but the layout has {layout.num_fragments}."
      )
    self.learner_id = learner_id
    self.layout = layout
    self.schedule = schedule
    self.config = config or LearnerConfig()
    num = layout.num_fragments
    self.step = 0  # Inner steps this learner made (a restore sets it).
    self.phase = 0  # Schedule offset: this learner's step on the fleet's clock (align_phase).
    self.tokens = np.zeros(num, np.int64)  # docs/algorithm.md §3 counters[p].tokens
    self.step_counts = np.zeros(num, np.int64)  # docs/algorithm.md §3 counters[p].steps
    self.anchor = np.full(num, -1, np.int64)  # Version of p last applied; -1 = never received.
    self.held = HeldVersions(num)  # Versions held: bases and anchors (held.py).
    self.ledger = TokenLedger(num)  # Where each trained token went (ledger.py).
    self.answers = carry.AnswerBook()  # θ_p^answered of outstanding answers; "carry" only.
    self._received: dict[int, FragmentState] = {}  # The newest version of p received, not applied.
    self._rounds = RoundBook(num)  # Asked for, answered, awaiting their merge (rounds.py).

  # -- training -------------------------------------------------------------------------------

  @property
  def schedule_step(self) -> int:
    """The step on the fleet's schedule: this learner's step plus its phase offset."""
    return self.step + self.phase

  def trained(self, tokens: int) -> None:
    """A step on `tokens` tokens became this learner's: it trained every fragment on them."""
    self.step += 1
    self.tokens += tokens
    self.step_counts += 1
    self.ledger.train(tokens)

  def align_phase(self, fleet_step: int) -> None:
    """Puts this learner's schedule step at the fleet's step (the syncer's clock) at (re)join.

    Only `blocking` learners read it (they answer a round when their schedule step reaches the
    round's); the step count (and the inner learning-rate schedule) are the learner's own.
    """
    self.phase = max(fleet_step, 0) - self.step
    # Rounds due up to here were the fleet's before this learner (re)joined: none to wait for.
    self._rounds.answered_up_to(self.schedule_step)

  # -- what arrives ---------------------------------------------------------------------------

  def ask(self, request: RoundRequest) -> None:
    """Records that the syncer asked for fragment p in round (p, t).

    Ignored if this learner already holds (or has received) a version newer than the round's base:
    that round has merged. A newer round of p replaces an unanswered older one.

    Raises:
      ValueError: for a fragment the layout does not have.
    """
    p = request.fragment
    if not 0 <= p < self.layout.num_fragments:
      raise ValueError(f"Round request for unknown fragment {p}.")
    received = self._received.get(p)
    newest = max(int(self.anchor[p]), received.version if received is not None else -1)
    self._rounds.ask(request, newest)

  def receive(self, state: FragmentState) -> None:
    """A version of p reached the learner; the newest wins, and it is applied when `ready`.

    An unanswered request of an older base is dropped: its round has merged.
    """
    p = state.fragment
    received = self._received.get(p)
    if state.version > self.anchor[p] and (received is None or state.version > received.version):
      self._received[p] = state
      self._rounds.received(p, state.version)

  def on_result(self, p: int, result: ReportResult, *, step: int | None = None) -> None:
    """Books the syncer's answer to the answer of p made at `step` (default: the last one)."""
    if step is None:
      step = self._rounds.sent_step(p)
    self.ledger.answered(p, step, result.status, result.weight, result.round_version)
    self.answers.result(p, step, taken(result.status, result.weight, result.round_version))

  def pending_rounds(self) -> dict[int, RoundRequest]:
    """The rounds asked for and not answered yet, by fragment."""
    return self._rounds.pending()

  # -- answering ------------------------------------------------------------------------------

  def due(self, readable: Callable[[int], bool] = lambda p: True) -> tuple[int, ...]:
    """Fragments whose round this learner answers now.

    Every pending request whose base version this learner has applied (until the base arrives, an
    answer would weigh 0), once it has trained p since its last apply (a learner that has just
    joined has nothing to contribute yet) and θ_p can be read (`readable`: while a step runs, the
    devices may hold only some fragments of the last boundary); a `blocking` learner answers only
    rounds whose step its own schedule step has reached.
    """
    s = self.schedule_step
    return tuple(
      sorted(
        p
        for p, req in self._rounds.pending().items()
        if req.base_version <= self.anchor[p]
        and self.step_counts[p] > 0
        and (not self.config.blocking or req.round_step <= s)
        and readable(p)
      )
    )

  def answer(self, p: int, theta: Theta, *, step_time_s: float = 0.0) -> Answer:
    """Answers p's pending round with `theta` (without one: an unsolicited answer, no round).

    The answer carries the counters of p, the tokens trained since the last answer (booked as
    awaiting the syncer's word in the ledger) and its anchor Θ_p^(anchor) from the held versions.
    """
    now = self.schedule_step
    anchor = int(self.anchor[p])
    answer = Answer(
      learner_id=self.learner_id,
      fragment=p,
      round_step=self._rounds.answer(p, now, self.schedule.apply_step(now)),
      step=now,  # On the fleet's schedule (== self.step unless realigned at a rejoin).
      anchor_version=anchor,
      tokens=int(self.tokens[p]),
      steps=int(self.step_counts[p]),
      new_tokens=self.ledger.send(p, now),
      step_time_s=step_time_s,
      theta=theta,
      anchor=self.held.get(p, anchor),
    )
    if self.config.apply_rule == "carry":
      self.answers.record(p, answer)
    return answer

  # -- applying -------------------------------------------------------------------------------

  def blocked(self) -> bool:
    """`blocking` only: whether this learner must wait before its next step.

    It waits at a step where a fragment is due until it has answered that round (the syncer opens
    it when the fleet has reached the step), and at answer + τ until the round's merge has arrived.
    """
    if not self.config.blocking:
      return False
    s = self.schedule_step
    if s >= 1 and self._rounds.unanswered(self.schedule.due(s), s):
      return True
    return self._rounds.awaiting_merge(s, self._received)

  def ready(self) -> list[Apply]:
    """The received versions to apply now, in fragment order; each is the caller's to write
    (the learner's devices), then to book with `applied`.

    A version is ready τ steps after this learner answered p's round, at once if it has no
    answer of p outstanding, and at once too if a round of p already asked for is based on it.
    """
    out = []
    for p in sorted(self._received):
      apply_step = self._rounds.apply_step(p)
      request = self._rounds.request(p)
      if (
        apply_step is not None
        and self.schedule_step < apply_step
        and (request is None or request.base_version > self._received[p].version)
      ):
        continue  # Not before τ steps, unless a round of p based on it already waits for us.
      state = self._received.pop(p)
      # Not None: "carry", and the syncer took this learner's answer (or has not said yet).
      out.append(Apply(state, self.answers.take(p), self.config.mixing_alpha))
    return out

  def applied(self, apply: Apply) -> None:
    """Books an apply the devices made: p's anchor, counters, ledger and rounds, and the versions
    held (older ones are never a base or an anchor again)."""
    p = apply.fragment
    self.anchor[p] = apply.version
    kept = (0, 0)  # θ_p was overwritten, merged or not: its counters restart...
    if apply.carried is not None:  # ... but for the progress since the answer, carried over.
      kept = (self.tokens[p] - apply.carried.tokens, self.step_counts[p] - apply.carried.steps)
    if apply.alpha == 0:  # α > 0 keeps part of the unsent progress: not dropped.
      self.ledger.overwritten(p, keep=int(kept[0]))
    self.tokens[p], self.step_counts[p] = kept
    self._rounds.applied(p)
    self.held.forget_before(p, apply.version)

  def loaded(self, states: Iterable[FragmentState]) -> None:
    """Books a load of the syncer's global values the devices made (start, rejoin:
    docs/algorithm.md §6): counters restart, nothing is outstanding, and each fragment's anchor
    becomes the loaded version."""
    for state in states:
      p = state.fragment
      self.ledger.overwritten(p)
      self.anchor[p] = state.version
      self.tokens[p] = 0
      self.step_counts[p] = 0
      self._received.pop(p, None)
      self.held.forget_before(p, state.version)
    self._rounds.clear()
    self.answers.clear()
