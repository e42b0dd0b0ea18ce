"""The syncer's core: syncer-paced rounds, quorum, grace window, token-weighted merge, outer step.

Pure and clock-injected: no threads, no sleeping, no I/O, no wall clock. Time comes only from `clock`, so
the same object runs under a virtual clock (simulated cluster) and a wall clock (the gRPC service, which
wraps it with a lock). The protocol (docs/algorithm.md, "Rounds"):

- The syncer owns the schedule. It keeps a step clock at the fleet's cadence (`cadence_step`: it
  advances at the median inner-step rate of the alive learners, measured from their step counts).
  When the clock reaches step t, every fragment p due at t (`FragmentSchedule.due`) gets its round
  (p, t), opened against p's current version (the round's base). `tick` returns the opened rounds as
  `RoundRequest`s and the transport asks every live learner for them; each learner answers at its
  next step boundary with θ_p and its counters, tagged with the round's step.
- A fragment has at most one open round. A round that is still open when p is due again (its quorum
  K was not reached within a period) stays open and the due round is not opened ("overrun"). So
  every fragment merges at most once per period.
- An answer for a round that is already closed is "late": dropped and counted. It never opens a
  round of its own, and its progress is never applied on top of a merge that already covered the
  same steps. An answer for a round that was never opened is rejected.
- A learner weighs 0 for p until p was delivered to it since its last registration, and whenever its
  answer is not anchored at the round's base version; such answers are accepted but neither count
  toward the quorum nor touch the merge.
- Quorum: K weight>0 answers, timed from the round's opening (ξ_quorum). Then the round stays open for
  the grace window, or closes at once when every alive learner that has received p has answered.
  It never merges with fewer than K: K = M with a dead learner stalls, which is the synchronous
  baselines' cost, made visible.
- Merge: v_m = Θ^(base) − θ_m (the outer gradient against the round's base, which is Θ_p: nothing
  else merges p while its round is open), w_m = tokens²/steps, RDA or mean, then one optax state
  per fragment, float32 math, results cast back to each tensor's dtype. Each merge publishes
  version + 1 and the `values_digest` of the new values.

The value types live in `types.py` (re-exported here) and `state_dict` / `load_state_dict` in
`checkpoint.py` (inherited).
"""

import collections
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.fragments import buffers
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol import MAX_STEP, counter_error, step_time_error
from ddiloco.syncer import merge as merge_lib
from ddiloco.syncer.checkpoint import CheckpointMixin
from ddiloco.syncer.grace import GraceModel
from ddiloco.syncer.outer import OuterStep
from ddiloco.syncer.types import (
  COUNTERS,
  FragmentState,
  LearnerRecord,
  MergeEvent,
  Report,
  ReportResult,
  Round,
  RoundEntry,
  RoundRequest,
  SyncerConfig,
  readonly,
)

log = logging.getLogger(__name__)

__all__ = [
  "FragmentState",
  "MergeEvent",
  "Report",
  "ReportResult",
  "RoundRequest",
  "SyncerConfig",
  "SyncerCore",
]


_RECENT_ROUNDS = 16  # Round steps remembered per fragment (`late_reason`).
_RECENT_NORMS = 32  # Merged answers' outer-gradient norms remembered per fragment.
_ANSWERS_PER_FRAGMENT = 4  # Recent answers remembered per learner and fragment (retries).
_INT64_MAX = 2**63 - 1


def _checked_add(total: int, n: int) -> int:
  """total + n for a counter that is saved as int64: saturates at int64's maximum (never reached
  with the learners' counters bounded, `protocol.MAX_TOKENS`), so it can never break a save."""
  return min(int(total) + int(n), _INT64_MAX)


def _norm(values: Mapping[str, np.ndarray]) -> float:
  """‖values‖ over all tensors: float32 blocks (no full-size temporary), summed in float64."""
  sq = 0.0
  with np.errstate(over="ignore"):
    for v in values.values():
      flat = np.asarray(v).reshape(-1)
      for start in range(0, flat.size, merge_lib.BLOCK_VALUES):
        block = flat[start : start + merge_lib.BLOCK_VALUES].astype(np.float32, copy=False)
        sq += float(np.dot(block, block))
  return math.sqrt(sq)


def _value_limit(dtype: np.dtype) -> float:
  """The largest magnitude a merged value of `dtype` may take: a quarter of the dtype's range,
  so that casting it, and the downlink's Θ_new − Θ_old and its decoding, cannot overflow."""
  return float(jnp.finfo(dtype).max) / 4


def _fingerprint(r: Report) -> tuple:
  """What makes two answers to one round the same answer (a retry): their counters."""
  return (r.step, r.tokens, r.steps, r.new_tokens, r.anchor_version)


def _non_finite(key: str, v: np.ndarray) -> str:
  """The reason for refusing a tensor with NaN/Inf: counted on this failure path only."""
  bad = v.size - int(np.count_nonzero(np.isfinite(v)))
  return f"{key!r} has non-finite values ({bad} NaN/Inf of {v.size})"


class SyncerCore(CheckpointMixin):
  """Global fragments, their rounds and outer optimizer states, driven by reports and an injected clock.

  Not thread-safe: the service wraps it with a lock.
  """

  def __init__(
    self,
    *,
    fragment_keys: Sequence[Sequence[str]],
    init_values: Mapping[str, np.ndarray],
    config: SyncerConfig,
    clock: Callable[[], float],
    embedding_keys: Collection[str] = (),
    outer_optimizer: optax.GradientTransformation | None = None,
    adopt: Callable[[int, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], dict] | None = None,
    schedule: FragmentSchedule | None = None,
  ):
    """Creates the syncer at version 0 of every fragment.

    Args:
      fragment_keys: per fragment, the parameter keys it holds (e.g. `FragmentLayout.fragments`).
      init_values: initial value of every key (floating dtypes); copied.
      config: syncer settings.
      clock: returns the current time in seconds (wall or virtual).
      embedding_keys: keys merged with the weighted mean (docs/algorithm.md §4.5); others may be absent.
      outer_optimizer: overrides `config.outer_optimizer()`.
      adopt: maps (fragment, merged values, previous version's values) to the values published.
        A lossy downlink codec passes "what a learner holding the previous version decodes" here, so
        the syncer adopts the dequantized values and every copy stays bit-identical (docs/algorithm.md §5).
      schedule: when each fragment is due on the syncer's step clock, and τ (the overlap the grace
        window spends): the run's one `FragmentSchedule`, which the learners follow too.
        Default: P = H = the number of fragments (at least 3), τ = 2.

    Raises:
      ValueError: if fragments are empty or overlap, keys and init_values disagree, a value is not
        a floating array, or the schedule does not fit.
    """
    self._keys = tuple(tuple(ks) for ks in fragment_keys)
    if not self._keys or any(not ks for ks in self._keys):
      raise ValueError("Need at least one fragment, and every fragment needs at least one key.")
    all_keys = [k for ks in self._keys for k in ks]
    if len(set(all_keys)) != len(all_keys):
      raise ValueError("A key appears in more than one fragment (or twice in one).")
    if set(all_keys) != set(init_values):
      missing = sorted(set(all_keys) - set(init_values))[:3]
      extra = sorted(set(init_values) - set(all_keys))[:3]
      raise ValueError(f"fragment_keys and init_values disagree: missing {missing}, extra {extra}.")
    self._config = config
    if schedule is None:
      num = len(self._keys)
      schedule = FragmentSchedule(num_fragments=num, period=max(num, 3), overlap=2)
    if schedule.num_fragments != len(self._keys):
      raise ValueError(
        f"The schedule has P={schedule.num_fragments} fragments, this syncer {len(self._keys)}."
      )
    self._schedule = schedule
    self._clock = clock
    self._embedding_keys = frozenset(embedding_keys)
    self._adopt = adopt
    self._opt = outer_optimizer if outer_optimizer is not None else config.outer_optimizer()
    # Nothing is donated to the outer step (`outer.py`): float32 params go in as views of the
    # global values (`_params32`), and the old optimizer state stays valid until the step
    # succeeded. Measured on 16 MiB: 8.5 ms against 12.1 ms for a donated copy of the params and a
    # donated state gated by `where` (a third pass over the state to undo a failed step).
    self._merge_out = merge_lib.OutputBuffer()  # The merged outer gradients, every merge's.
    self._grace = GraceModel(
      gamma=config.grace_gamma,
      grace_max_s=config.grace_max_s,
      overlap=schedule.overlap,
      decay=config.ema_decay,
      spread_cover=config.grace_spread,
    )
    # Per fragment, (round step, first answer's time) of its last closed round: a late answer to it
    # still tells the grace window how long answers take (`GraceModel.observe_answer_delay`).
    self._closed_first: list[tuple[int, float] | None] = [None] * len(self._keys)
    self._global: list[dict[str, np.ndarray]] = []
    for ks in self._keys:
      vals = {}
      for k in ks:
        a = np.array(init_values[k], copy=True)
        if not jnp.issubdtype(a.dtype, jnp.floating):
          raise ValueError(f"{k!r} has dtype {a.dtype}; only floating parameters can be synced.")
        vals[k] = readonly(a)
      self._global.append(vals)
    limits = {k: _value_limit(v.dtype) for vals in self._global for k, v in vals.items()}
    self._outer = OuterStep(self._opt, limits)
    # Fragments whose merge is fused with the outer step (`outer.py`): the large ones.
    self._fused = [
      sum(v.size for v in vals.values()) * 4 >= config.fused_merge_bytes for vals in self._global
    ]
    num = len(self._keys)
    self._version = [0] * num
    self._digest = [values_digest(v) for v in self._global]
    # ‖Θ_p‖ of each current version, and the outer-gradient norms of recent merged answers: the
    # scales of the plausibility bound (`_implausible`). Not saved: a restored syncer starts the
    # recent norms afresh.
    self._theta_norm = [_norm(v) for v in self._global]
    self._recent_norms = [collections.deque(maxlen=_RECENT_NORMS) for _ in range(num)]
    self._history: list[dict[int, dict[str, np.ndarray]]] = [{0: v} for v in self._global]
    self._opt_state = [self._outer.init(self._params32(p)) for p in range(num)]
    self._rounds = [Round() for _ in range(num)]
    self._last_round_step = [-1] * num  # Step of each fragment's newest round, open or closed.
    # Steps of each fragment's recent rounds: an answer to one of them (closed) is late, one to any
    # other step was never asked for. Steps up to `_rounds_known_after` are too old to tell (or
    # from before a restore) and count as closed. Not saved.
    self._recent_rounds = [collections.deque(maxlen=_RECENT_ROUNDS) for _ in range(num)]
    self._rounds_known_after = [-1] * num
    # Set by a restore (`load_state_dict`): the restored syncer's first tick closes every round
    # step before it (`tick`).
    self._restored = False
    self._next_round_step: int | None = None  # First clock step `tick` has not yet processed.
    self._frozen: set[int] = set()  # Fragments `tick` opens no round for (`freeze`).
    self._learners: dict[int, LearnerRecord] = {}
    self._counters = dict.fromkeys(COUNTERS, 0)
    self._fleet_step_time: float | None = None  # When the report that set fleet_step arrived.
    self._cadence: float | None = None  # See cadence_step.
    self._cadence_time = 0.0
    # Merges per quorum size (index = number of weight>0 contributors): bounded, unlike a list.
    self._quorum_hist = np.zeros(1, np.int64)

  # -- membership and delivery (docs/algorithm.md §3, §6) -------------------------------------------------------

  @property
  def num_fragments(self) -> int:
    return len(self._keys)

  @property
  def config(self) -> SyncerConfig:
    return self._config

  def register(self, learner_id: int) -> dict[int, int]:
    """Marks a learner alive and returns {fragment: current version} (its "vector clock", docs/algorithm.md §6).

    Re-registering (after a crash) forgets what was delivered to it: until it fetches p again its
    reports of p weigh 0 (docs/algorithm.md §3). Its reports already in open rounds stay there.

    Raises:
      ValueError: if learner_id is negative.
    """
    if learner_id < 0:
      raise ValueError(f"learner_id must be >= 0, got {learner_id}.")
    learner = self._learners.get(learner_id)
    if learner is None:
      self._learners[learner_id] = LearnerRecord()
    else:
      learner.alive, learner.epoch, learner.delivered = True, learner.epoch + 1, {}
      learner.progress, learner.steps_seen, learner.rate = None, None, 0.0
      learner.position = -1
    return dict(enumerate(self._version))

  @property
  def schedule(self) -> FragmentSchedule:
    return self._schedule

  def fleet_step(self) -> int:
    """The fleet's step on the syncer's schedule clock: a (re)joining learner aligns to it.

    `cadence_step` once the clock runs; before that, the largest schedule step reported.
    """
    step = self.cadence_step()
    return step if step >= 0 else self._counters["fleet_step"]

  def cadence_step(self) -> int:
    """The syncer's step clock now: the schedule step at which rounds are due.

    A clock, not a vote: it starts at the largest step an alive learner reported (heartbeats,
    `observe_steps`; or a report) and advances at the median rate (inner steps per second) of the
    alive learners, measured from their own step counts. Learners never change their pace for it,
    so there is no feedback: each answers the rounds at its own next step boundary, and a slower
    learner contributes fewer steps (and weighs less) per round. -1 before anything was observed.
    Not checkpointed; a restored syncer restarts it past every round it had opened.
    """
    now = self._clock()
    if self._config.clock == "slowest":
      positions = [lr.position for lr in self._learners.values() if lr.alive and lr.position >= 0]
      if positions:
        self._cadence = float(max(min(positions), self._cadence or 0.0))
      self._cadence_time = now
      return -1 if self._cadence is None else int(self._cadence)
    if self._cadence is None:
      seen = [
        max(
          lr.progress[0] if lr.progress is not None else -1,
          lr.steps_seen[0] if lr.steps_seen is not None else -1,
        )
        for lr in self._learners.values()
        if lr.alive
      ]
      seen = [s for s in seen if s >= 0]
      if not seen:
        return -1
      # The median learner's step (the larger middle one): a single learner claiming a far-off
      # step cannot move the clock of a fleet, and none moves it past a round already opened.
      start = sorted(seen)[len(seen) // 2]
      self._cadence = float(max(start, *self._last_round_step))
    else:
      rate = self._fleet_rate()
      if rate:
        self._cadence = min(self._cadence + (now - self._cadence_time) * rate, float(MAX_STEP))
    self._cadence_time = now
    return int(self._cadence + 1e-9)  # A tick at the computed time lands on its step.

  def _fleet_rate(self) -> float:
    """The median inner-step rate of the alive learners heard from lately (0: none).

    A learner silent for 4 of its steps (at least 2 s: paused, crashed, partitioned) does not pace
    the clock until it is heard again; the liveness timeout that declares it dead is much longer.
    """
    now = self._clock()
    rates = [
      lr.rate
      for lr in self._learners.values()
      if lr.alive
      and lr.rate > 0
      and lr.heard is not None
      and now - lr.heard <= max(2.0, 4.0 / lr.rate)
    ]
    return float(np.median(rates)) if rates else 0.0

  def tick(self) -> list[RoundRequest]:
    """Opens every round that came due on the step clock since the last tick (see module doc).

    Returns:
      The rounds opened, in due order: the transport asks every live learner for each.
    """
    now_step = self.cadence_step()
    if now_step < 0:
      return []
    if self._next_round_step is None:
      self._next_round_step = max(now_step, max(self._last_round_step) + 1)
      if self._restored:
        # Rounds the lost incarnation opened after its checkpoint are unknown here; the learners
        # may still answer them. They are closed (their answers late: dropped and counted), not
        # "never opened" (refused as invalid): every step before this first tick's.
        self._restored = False
        before = self._next_round_step - 1
        for p in range(self.num_fragments):
          self._last_round_step[p] = max(self._last_round_step[p], before)
          self._rounds_known_after[p] = max(self._rounds_known_after[p], before)
    # After a long stall (no alive learner) the clock may have moved by more than a period: each
    # fragment is due at most once in any H steps, so only the last period's steps matter.
    first = max(self._next_round_step, now_step - self._schedule.period + 1)
    opened = []
    for t in range(first, now_step + 1):
      if t < 1:
        continue
      for p in self._schedule.due(t):
        if t <= self._last_round_step[p] or p in self._frozen:
          continue  # Opened already (`open_round` called directly, or a restored round); frozen.
        request = self.open_round(p, t)
        if request is not None:
          opened.append(request)
    self._next_round_step = max(self._next_round_step, now_step + 1)
    return opened

  def next_tick_time(self) -> float | None:
    """Clock time at which the step clock reaches the next unprocessed step; None if not running."""
    step = self.cadence_step()
    if self._config.clock == "slowest":  # Moves only when a learner reports its step.
      nxt = self._next_round_step
      return self._clock() if step >= 0 and (nxt is None or step >= nxt) else None
    rate = self._fleet_rate()
    if step < 0 or not rate:
      return None
    nxt = self._next_round_step if self._next_round_step is not None else int(self._cadence) + 1
    return self._cadence_time + max(nxt - self._cadence, 0.0) / rate

  def open_round(self, p: int, step: int) -> RoundRequest | None:
    """Opens round (p, step) against p's current version; None if p's previous round is still open.

    `tick` calls this for every due fragment; tests and tools may call it directly.

    Raises:
      ValueError: on an unknown fragment, or a step not after p's newest round.
    """
    self._check_fragment(p)
    if step <= self._last_round_step[p]:
      raise ValueError(
        f"Round step {step} of fragment {p} is not after its newest round ({self._last_round_step[p]})."
      )
    if self._rounds[p].step >= 0:
      self._count("overrun_rounds")
      return None
    self._rounds[p] = Round(step=step, base_version=self._version[p], open_time=self._clock())
    self._last_round_step[p] = step
    recent = self._recent_rounds[p]
    if len(recent) == recent.maxlen:
      self._rounds_known_after[p] = recent[0]
    recent.append(step)
    self._count("rounds_opened")
    return RoundRequest(p, step, self._version[p])

  def open_rounds(self) -> list[RoundRequest]:
    """The rounds open now (a learner that (re)joins is asked for them too)."""
    return [
      RoundRequest(p, rnd.step, rnd.base_version)
      for p, rnd in enumerate(self._rounds)
      if rnd.step >= 0
    ]

  def observe_progress(self, learner_id: int, step: int, step_time_s: float) -> None:
    """Records an alive learner's schedule step and step time now (from its reports)."""
    learner = self._learners.get(learner_id)
    if learner is None or not learner.alive or not 0 <= step <= MAX_STEP:
      return
    if not math.isfinite(step_time_s) or step_time_s < 0:
      step_time_s = 0.0
    if learner.progress is None or step >= learner.progress[0]:
      learner.progress = (int(step), self._clock(), float(step_time_s))

  def observe_steps(
    self,
    learner_id: int,
    inner_step: int,
    *,
    step_time_s: float = 0.0,
    min_interval_s: float = 1.0,
  ) -> None:
    """Samples an alive learner's schedule step (heartbeats) for its rate (cadence_step).

    `step_time_s`, the learner's own measure of its step time, sets its rate until two samples
    `min_interval_s` apart have measured it: the clock then starts with the first heartbeats
    instead of a second later.
    """
    learner = self._learners.get(learner_id)
    if learner is None or not learner.alive or not 0 <= inner_step <= MAX_STEP:
      return
    now = self._clock()
    learner.position, learner.heard = int(inner_step), now
    max_rate = self._config.max_step_rate
    if learner.rate == 0 and math.isfinite(step_time_s) and step_time_s > 0:
      learner.rate = min(1.0 / step_time_s, max_rate)
    if learner.steps_seen is None or inner_step < learner.steps_seen[0]:
      learner.steps_seen = (int(inner_step), now)
      return
    step0, t0 = learner.steps_seen
    if now - t0 < min_interval_s:
      return
    rate = min((inner_step - step0) / (now - t0), max_rate)
    # Half-weight samples: the first ones include compilation, and a slow EMA kept the cadence
    # behind a lone learner for dozens of steps (measured: 40 holds in 128 steps).
    learner.rate = rate if learner.rate == 0 else 0.5 * learner.rate + 0.5 * rate
    learner.steps_seen = (int(inner_step), now)

  def leave(self, learner_id: int) -> None:
    """Marks a learner not alive (crash detected or scale-down); idempotent.

    Its reports already in open rounds stay there; it no longer holds up an early close.

    Raises:
      ValueError: if the learner never registered.
    """
    self._learner(learner_id).alive = False

  def delivered(self, learner_id: int) -> frozenset[int]:
    """Fragments delivered to a learner since its last registration (its reports of them weigh > 0)."""
    learner = self._learners.get(learner_id)
    return frozenset(learner.delivered) if learner is not None else frozenset()

  def alive(self) -> frozenset[int]:
    """Ids of the learners currently alive."""
    return frozenset(i for i, lr in self._learners.items() if lr.alive)

  def fetch(self, learner_id: int, fragment: int) -> FragmentState:
    """Returns the current Θ_p and records that `learner_id` has received this version.

    Raises:
      ValueError: if the learner is not alive or the fragment is unknown.
    """
    state = self.state(fragment)
    self.mark_delivered(learner_id, fragment, state.version)
    return state

  def mark_delivered(self, learner_id: int, fragment: int, version: int) -> None:
    """Records that a transport delivered `version` of `fragment` to `learner_id` (a push).

    Raises:
      ValueError: if the learner is not alive, the fragment is unknown or the version never existed.
    """
    self._check_fragment(fragment)
    learner = self._learner(learner_id)
    if not learner.alive:
      raise ValueError(f"Learner {learner_id} is not alive; it must register again.")
    if not 0 <= version <= self._version[fragment]:
      raise ValueError(
        f"Version {version} of fragment {fragment} does not exist (current {self._version[fragment]})."
      )
    learner.delivered[fragment] = max(version, learner.delivered.get(fragment, -1))

  # -- reports ------------------------------------------------------------------------------------

  def report(self, r: Report, *, copy: bool = True) -> ReportResult:
    """Validates a learner's answer to a round and files it (see module docstring).

    The answer carries the syncer's step clock (`fleet_step`), whatever the status. With
    `copy=False` the core keeps the report's arrays instead of copying them: for callers that hand
    over freshly decoded arrays nobody else holds (the service; a 64 MiB copy cost ~40 ms).

    Args:
      r: the report; its arrays are copied if it joins a round.

    Returns:
      "rejected" (invalid, or for a round never opened; the state is untouched), "accepted" (weight
      may be 0), "superseded" (a restarted learner's answer replaced its older one in the round),
      "late" (its round is closed: dropped and counted) or "duplicate" (this learner already
      answered the round).
    """
    return dataclasses.replace(self._file_report(r, copy), fleet_step=self.cadence_step())

  def _file_report(self, r: Report, copy: bool = True) -> ReportResult:
    reason = self._invalid_header(r)
    if reason is not None:
      self._count("rejected")
      return ReportResult("rejected", reason, 0.0)
    replay = self.replayed(r.learner_id, r.fragment, r.round_step, _fingerprint(r))
    if replay is not None:
      return replay
    reason, sq_norms = self._invalid_values(r)
    if reason is None and sq_norms is not None:
      reason = self._implausible(r.fragment, sq_norms)
      if reason is not None:
        self._count("implausible")
    if reason is not None:
      self._count("rejected")
      return ReportResult("rejected", reason, 0.0)
    result = self._file_valid(r, sq_norms, copy)
    if result.status != "duplicate":
      self._remember(r, result)
    return result

  def replayed(
    self, learner_id: int, fragment: int, round_step: int, fingerprint: tuple
  ) -> ReportResult | None:
    """The result a learner's earlier, identical answer to this round got, or None.

    A learner that lost the reply to an answer (a timeout, a dropped connection) sends it again:
    the retry gets the first answer's result and is neither filed, merged nor booked twice
    (counted as "replayed"). Identical means the same registration, round and counters
    (`fingerprint`: step, tokens, steps, new tokens, anchor version), with nothing delivered to
    the learner since (a weight-0 answer may be answered again once the learner holds the
    fragment); a different second answer to the same round is a duplicate. A transport may ask
    before decoding a push.
    """
    learner = self._learners.get(learner_id)
    if learner is None:
      return None
    seen = learner.answers.get((fragment, round_step))
    now = (learner.epoch, tuple(fingerprint), learner.delivered.get(fragment))
    if seen is None or seen[:3] != now:
      return None
    self._count("replayed")
    return dataclasses.replace(seen[3], fleet_step=self.cadence_step())

  def _remember(self, r: Report, result: ReportResult) -> None:
    learner = self._learners[r.learner_id]
    answers = learner.answers
    key = (r.fragment, r.round_step)
    answers[key] = (learner.epoch, _fingerprint(r), learner.delivered.get(r.fragment), result)
    answers.move_to_end(key)
    while len(answers) > _ANSWERS_PER_FRAGMENT * self.num_fragments:
      answers.popitem(last=False)

  def _implausible(self, p: int, sq_norms: Mapping[str, float]) -> str | None:
    """Why an answer's outer gradient is out of scale (`SyncerConfig.max_update_ratio`), or None."""
    norm = math.sqrt(sum(sq_norms.values()))
    if not math.isfinite(norm):
      return f"the outer gradient of fragment {p} overflows (its norm is not finite)"
    ratio = self._config.max_update_ratio
    recent = self._recent_norms[p]
    scale = max(self._theta_norm[p], float(np.median(recent)) if recent else 0.0)
    if ratio > 0 and scale > 0 and norm > ratio * scale:
      return (
        f"implausible outer gradient: its norm {norm:.4g} exceeds {ratio:g} x {scale:.4g}, the "
        f"larger of the norm of fragment {p} and the median norm of its recent merged answers"
      )
    return None

  def _file_valid(
    self, r: Report, sq_norms: Mapping[str, float] | None, copy: bool
  ) -> ReportResult:
    if r.step_time_s > 0:
      self._grace.observe_step_time(r.step_time_s)
    self.observe_progress(r.learner_id, r.step, r.step_time_s)
    p, learner = r.fragment, self._learners[r.learner_id]
    late = self.late_reason(p, r.round_step)
    if late is not None:
      return self.drop_late(
        r.tokens,
        late,
        learner_id=r.learner_id,
        new_tokens=r.new_tokens,
        fragment=p,
        round_step=r.round_step,
      )
    rnd = self._rounds[p]
    if p not in learner.delivered or r.anchor_version < 0:
      return self._zero_weight(
        r, f"learner has not received fragment {p} since registering (docs/algorithm.md §3)"
      )
    if r.anchor_version != rnd.base_version:
      return self._zero_weight(
        r,
        f"answered against version {r.anchor_version}; round ({p}, {rnd.step}) is based on "
        f"version {rnd.base_version}",
      )
    weight = merge_lib.token_weight(r.tokens, r.steps)
    if weight == 0:
      return self._zero_weight(
        r, "no tokens or steps since the last receipt (docs/algorithm.md §4.4)"
      )
    prev = rnd.entries.get(r.learner_id)
    status = "accepted"
    new_tokens = r.new_tokens
    if prev is not None:
      # One answer per learner and round; a restarted learner (a newer registration) may answer
      # again, and its answer replaces the lost process's.
      if prev.epoch == learner.epoch:
        self._count("duplicate")
        self._ledger_in(r.learner_id, r.new_tokens, dropped=True)
        return ReportResult(
          "duplicate", f"learner {r.learner_id} already answered round ({p}, {rnd.step})", 0.0
        )
      status = "superseded"
      # The newer θ_p holds the older report's progress too: its ledger tokens ride along.
      new_tokens += prev.report.new_tokens
    self._ledger_in(r.learner_id, r.new_tokens, dropped=False)
    # Aligned: the outer step reads them through XLA without a copy (fragments/buffers.py).
    values = {k: buffers.aligned_copy(v) if copy else v for k, v in r.values.items()}
    rda_norms = None
    if sq_norms is not None and self._config.merge_method == "rda":
      rda_norms = {k: sq for k, sq in sq_norms.items() if k not in self._embedding_keys}
    rnd.entries[r.learner_id] = RoundEntry(
      dataclasses.replace(r, values=values, new_tokens=new_tokens),
      weight,
      learner.epoch,
      sq_norms=rda_norms,
      norm=None if sq_norms is None else math.sqrt(sum(sq_norms.values())),
    )
    self._count(status)
    now = self._clock()
    if r.step >= self._counters["fleet_step"]:
      self._counters["fleet_step"], self._fleet_step_time = r.step, now
    if rnd.first_time is None:
      rnd.first_time = now
    else:
      self._grace.observe_answer_delay(max(now - rnd.first_time, 0.0))
    if rnd.quorum_time is None and len(rnd.entries) >= self._config.min_quorum:
      # docs/algorithm.md §4.1-4.2: the grace window starts at the quorum and is fixed then. ξ_quorum is the
      # wait from the round's first answer to its quorum (0 for K = 1), not from its opening: the
      # learner that answered first started its τ steps when it answered, so the time before its
      # answer arrived is not slack it has spent (docs/algorithm.md, "grace window").
      rnd.quorum_time = now
      self._grace.observe_quorum_wait(max(now - rnd.first_time, 0.0))
      rnd.grace_s = self._grace.window() if self._config.use_grace else 0.0
      rnd.deadline = now + rnd.grace_s
    return ReportResult(status, "", weight, round_version=self._version[p] + 1)

  def late_reason(self, fragment: int, round_step: int) -> str | None:
    """Why an answer to round (fragment, round_step) comes too late, or None (see module doc).

    A transport asks before decoding a push: a closed round's answer is dropped unread.
    """
    if self._round_status(fragment, round_step) == "closed":
      return f"round ({fragment}, {round_step}) is closed"
    return None  # Open, or never opened (`_invalid_header` rejects that).

  def _round_status(self, p: int, round_step: int) -> str:
    """ "open", "closed" or "never" (opened) for round (p, round_step)."""
    rnd = self._rounds[p]
    if round_step < 0 or round_step > MAX_STEP:
      return "never"
    if round_step > self._last_round_step[p]:
      # Restored and not ticked yet: such a round can only be the lost incarnation's.
      return "closed" if self._restored else "never"
    if rnd.step >= 0 and round_step == rnd.step:
      return "open"
    if round_step in self._recent_rounds[p] or round_step <= self._rounds_known_after[p]:
      return "closed"  # Or too old to tell (then it cannot be open either).
    return "never"

  def drop_late(
    self,
    tokens: int,
    reason: str,
    *,
    learner_id: int | None = None,
    new_tokens: int = 0,
    fragment: int | None = None,
    round_step: int | None = None,
  ) -> ReportResult:
    """Counts a late report and its tokens as dropped (docs/algorithm.md §4); the state is otherwise untouched.

    `learner_id` and `new_tokens` book the report in the token ledger (a registered learner's).
    `fragment` and `round_step` name its round: if that is p's last closed round, the answer's
    delay after the round's first answer feeds the grace window's spread (syncer/grace.py), which
    would otherwise only ever see the answers that made it.
    """
    closed = self._closed_first[fragment] if fragment in range(self.num_fragments) else None
    if closed is not None and closed[0] == round_step:
      self._grace.observe_answer_delay(max(self._clock() - closed[1], 0.0))
    self._count("late")
    self._count("dropped_tokens", int(tokens))
    if learner_id in self._learners:
      self._ledger_in(learner_id, max(int(new_tokens), 0), dropped=True)
    return ReportResult("late", reason, 0.0, self.cadence_step())

  def _zero_weight(self, r: Report, reason: str) -> ReportResult:
    self._count("accepted")
    self._count("zero_weight_reports")
    self._count("zero_weight_tokens", r.tokens)
    # Weight 0 never touches the merge, so its ledger tokens are dropped (docs/algorithm.md §3).
    self._ledger_in(r.learner_id, r.new_tokens, dropped=True)
    return ReportResult("accepted", f"weight 0: {reason}", 0.0)

  def _ledger_in(self, learner_id: int, new_tokens: int, *, dropped: bool) -> None:
    """Books a report's ledger tokens as received, and as dropped at once if it joins no round."""
    ledger = self._learners[learner_id].ledger
    ledger["received"] = _checked_add(ledger["received"], new_tokens)
    self._count("ledger_received", new_tokens)
    if dropped:
      ledger["dropped"] = _checked_add(ledger["dropped"], new_tokens)
      self._count("ledger_dropped", new_tokens)

  def _invalid_values(self, r: Report) -> tuple[str | None, dict[str, float] | None]:
    """Validates a valid-header report's values at the door.

    Returns:
      (why it must be rejected, or None; every tensor's squared outer-gradient norm if it will
      join a round (`_joins`), else None).
    """
    expected = self._global[r.fragment]
    missing = sorted(set(expected) - set(r.values))
    extra = sorted(set(r.values) - set(expected))
    if missing or extra:
      return (
        f"keys differ from fragment {r.fragment}: missing {missing[:3]}, extra {extra[:3]}",
        None,
      )
    # The finiteness check is the door's one pass over the values. For a report that will join a
    # round it also sums ‖Θ^(anchor) − θ_m‖² per tensor: the plausibility bound needs them, and
    # RDA's tensors' norms spare the merge its first pass over the contributions (the anchor is
    # fixed once filed).
    joins = self._joins(r)
    # An outer gradient as sent (δ) is its own v_m; for θ, v_m = Θ^(anchor) − θ.
    anchor = None if not joins or r.outer_gradient else self._history[r.fragment][r.anchor_version]
    sq_norms = {} if joins else None
    for k, ref in expected.items():
      v = np.asarray(r.values[k])
      if v.shape != ref.shape or v.dtype != ref.dtype:
        return f"{k!r} is {v.dtype}{list(v.shape)}, expected {ref.dtype}{list(ref.shape)}", None
      if sq_norms is not None:
        sq = merge_lib.finite_sq_norm(None if anchor is None else anchor[k], v)  # None: NaN/Inf.
        if sq is None:
          return _non_finite(k, v), None
        sq_norms[k] = sq
      elif not merge_lib.all_finite(v):  # Blockwise: no full-size bool temporary.
        return _non_finite(k, v), None
    return None, sq_norms

  def _invalid_header(self, r: Report) -> str | None:
    """Why a report's fragment, learner, counters or anchor version are invalid, or None."""
    if not isinstance(r.fragment, int | np.integer) or not 0 <= r.fragment < self.num_fragments:
      return f"unknown fragment {r.fragment!r}; this syncer holds 0..{self.num_fragments - 1}"
    learner = self._learners.get(r.learner_id)
    if learner is None:
      return f"learner {r.learner_id} is not registered"
    if not learner.alive:
      return f"learner {r.learner_id} is not alive; it must register again"
    for name in ("anchor_version", "round_step"):
      value = getattr(r, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return f"{name} must be an integer, got {value!r}"
    reason = counter_error(
      tokens=r.tokens, steps=r.steps, step=r.step, new_tokens=r.new_tokens
    ) or step_time_error(r.step_time_s)
    if reason is not None:
      return reason
    per_step = self._config.max_tokens_per_step
    if per_step is not None and r.tokens > r.steps * per_step:
      return (
        f"{r.tokens} tokens in {r.steps} steps: more than the {per_step} tokens per step a "
        "learner's batch can hold"
      )
    if not isinstance(r.outer_gradient, bool | np.bool_):
      return f"outer_gradient must be a bool, got {r.outer_gradient!r}"
    if r.outer_gradient and r.anchor_version < 0:
      return "an outer gradient needs the anchor version it was taken against (got -1)"
    cur = self._version[r.fragment]
    if r.anchor_version < -1 or r.anchor_version > cur:
      return (
        f"anchor_version {r.anchor_version} outside [-1, {cur}] (current version of {r.fragment})"
      )
    if self._round_status(r.fragment, r.round_step) == "never":
      return f"round ({r.fragment}, {r.round_step}) was never opened"
    return None

  def _joins(self, r: Report) -> bool:
    """Whether `_file_report` will put a valid-header report in a round with a weight above 0.

    Only then are its norms needed; otherwise (weight 0, late) the door only checks finiteness.
    """
    p, learner = r.fragment, self._learners[r.learner_id]
    if p not in learner.delivered:
      return False
    if self.late_reason(p, r.round_step) is not None:
      return False
    if r.anchor_version != self._rounds[p].base_version:
      return False
    return merge_lib.token_weight(r.tokens, r.steps) > 0

  # -- merging ------------------------------------------------------------------------------------

  def poll(self) -> list[MergeEvent]:
    """Performs every merge whose time has come at clock(), earliest due first, and returns them.

    A round whose merge fails (`_merge`) is closed without a merge and is not returned.
    """
    now = self._clock()
    due = []
    for p in range(self.num_fragments):
      t = self._due_time(p, now)
      if t is not None and t <= now:
        due.append((t, p))
    return [e for _, p in sorted(due) if (e := self._merge(p)) is not None]

  def flush(self) -> list[MergeEvent]:
    """Merges every round that has its quorum now, grace windows or not (shutdown, end of run)."""
    now = self._clock()
    due = [p for p in range(self.num_fragments) if self._due_time(p, now) is not None]
    return [e for p in due if (e := self._merge(p)) is not None]

  def next_deadline(self) -> float | None:
    """Earliest clock time at which poll() would merge something; None if no round has its quorum.

    A round that may close early (everyone has reported) is due now, i.e. at clock().
    """
    now = self._clock()
    times = [t for p in range(self.num_fragments) if (t := self._due_time(p, now)) is not None]
    return min(times) if times else None

  def _due_time(self, p: int, now: float) -> float | None:
    rnd = self._rounds[p]
    if rnd.quorum_time is None or len(rnd.entries) < self._config.min_quorum:
      return None
    if self._everyone_reported(p):
      return min(rnd.deadline, now)
    return rnd.deadline

  def _everyone_reported(self, p: int) -> bool:
    """Whether every alive learner that has received p has a weight>0 report in p's round.

    Learners that never received p weigh 0 (docs/algorithm.md §3), so waiting for them gains nothing.
    """
    entries = self._rounds[p].entries
    return all(i in entries for i, lr in self._learners.items() if lr.alive and p in lr.delivered)

  def _merge(self, p: int) -> MergeEvent | None:
    """Merges p's round into Θ_p (docs/algorithm.md §4.3-4.6), publishes version + 1 and closes the round.

    All or nothing: if the merge raises, or the outer step would produce a non-finite or
    out-of-range value (`_outer_step`), nothing is updated, the round closes without a merge, its
    answers are dropped and counted (`failed_merges`), and None is returned.
    """
    t0 = self._clock()
    rnd = self._rounds[p]
    contributors = tuple(sorted(rnd.entries))
    entries = [rnd.entries[i] for i in contributors]
    theta = self._global[p]
    weights = tuple(e.weight for e in entries)
    try:
      # v_m = Θ^(base) − θ_m in float32; the base is Θ_p itself (only this round merges p).
      # An answer sent as δ is merged as decoded; one sent as θ against the base.
      base = self._history[p][rnd.base_version]
      if self._fused[p]:
        new32, new_state, ok = self._merge_and_step(p, entries, weights, base)
      else:
        new32, new_state, ok = self._merge_then_step(p, entries, weights, base)
      if not bool(ok):
        raise FloatingPointError("the outer step produced a non-finite or out-of-range value")
      # A view of XLA's output for float32 (no copy); other dtypes are cast. Within the limits
      # checked by the step, the cast is finite.
      new = {k: np.asarray(new32[k], dtype=theta[k].dtype) for k in theta}
      if self._adopt is not None:
        new = self._adopt(p, new, theta)
        new = {k: np.asarray(new[k], dtype=theta[k].dtype) for k in theta}
        bad = [k for k, v in new.items() if not merge_lib.all_finite(v)]
        if bad:
          raise FloatingPointError(f"the published values of {bad[:3]} are not finite")
      new = {k: readonly(v) for k, v in new.items()}
    except Exception as e:  # Any failure leaves Θ_p and its optimizer state as they were.
      self._fail_round(p, e)
      return None
    self._opt_state[p] = new_state
    self._global[p] = new
    self._theta_norm[p] = _norm(new)
    self._recent_norms[p].extend(e.norm for e in entries if e.norm is not None)
    self._version[p] += 1
    self._digest[p] = values_digest(new)
    self._history[p][self._version[p]] = new
    for v in sorted(self._history[p])[: -self._config.keep_versions]:
      del self._history[p][v]
    tokens = sum(e.report.tokens for e in entries)
    self._count("merges")
    self._count("merged_tokens", tokens)
    for i, e in zip(contributors, entries):
      # The ledger: the report's new tokens reached Θ_p. Learners hear merged_step in heartbeats.
      self._count("ledger_merged", e.report.new_tokens)
      record = self._learners.get(i)
      if record is not None:
        record.ledger["merged"] = _checked_add(record.ledger["merged"], e.report.new_tokens)
        record.merged_step[p] = max(e.report.step, record.merged_step.get(p, -1))
    if len(entries) >= len(self._quorum_hist):
      self._quorum_hist = np.pad(self._quorum_hist, (0, len(entries) + 1 - len(self._quorum_hist)))
    self._quorum_hist[len(entries)] += 1
    self._close(p)  # Answers to it are late from now on.
    t1 = self._clock()
    self._grace.observe_sync_time(max(t1 - t0, 0.0))
    return MergeEvent(
      fragment=p,
      version=self._version[p],
      time=t1,
      contributors=contributors,
      weights=weights,
      tokens=tokens,
      open_time=rnd.open_time,
      quorum_time=rnd.quorum_time,
      grace_s=rnd.grace_s,
      digest=self._digest[p],
    )

  def _merge_then_step(
    self, p: int, entries: list[RoundEntry], weights: tuple[float, ...], base: dict
  ) -> tuple:
    """The merge in numpy, then the outer step: (new params, new state, ok)."""
    # merge_reports forms each v_m block by block as it merges (no outer gradient is held whole)
    # and returns 64-byte-aligned arrays, which device_put hands to XLA without a copy.
    scales: dict[str, float] = {}
    merged = merge_lib.merge_reports(
      [None if e.report.outer_gradient else base for e in entries],
      [e.report.values for e in entries],
      weights,
      method=self._config.merge_method,
      embedding_keys=self._embedding_keys,
      sq_norms=[e.sq_norms for e in entries],  # From filing: RDA's first pass is done.
      out=self._merge_out,  # Reused: the outer step below is done with it when _merge returns.
      scales=scales,  # RDA's final scaling is done by the outer step, as it reads them.
    )
    return self._outer.step(self._params32(p), merged, scales, self._opt_state[p])

  def _merge_and_step(
    self, p: int, entries: list[RoundEntry], weights: tuple[float, ...], base: dict
  ) -> tuple:
    """The merge and the outer step in one program (`outer.py`): (new params, new state, ok)."""
    coefs, radius = {}, {}
    for k, v in base.items():
      if k in self._embedding_keys or self._config.merge_method == "mean":
        coefs[k], radius[k] = merge_lib.mean_coefficients(weights), None
        continue
      sq = {}
      for m, e in enumerate(entries):
        known = e.sq_norms.get(k) if e.sq_norms is not None else None
        if known is None:  # Not kept (a restored round): computed as filing does.
          anchor = None if e.report.outer_gradient else v
          known = merge_lib.finite_sq_norm(anchor, np.asarray(e.report.values[k]))
          if known is None:
            raise FloatingPointError(f"answer {m} to fragment {p} has a non-finite {k!r}")
        sq[m] = known
      coefs[k], radius[k] = merge_lib.rda_coefficients(weights, sq, merge_lib.EPS)
    return self._outer.merge_and_step(
      self._params32(p),
      base=base,
      answers=[e.report.values for e in entries],
      deltas=[e.report.outer_gradient for e in entries],
      coefs=coefs,
      radius=radius,
      opt_state=self._opt_state[p],
    )

  def _fail_round(self, p: int, error: Exception) -> None:
    """Closes p's round without a merge: its answers are dropped and counted; Θ_p is untouched."""
    rnd = self._rounds[p]
    log.error(
      "merge of fragment %d (round step %d, %d answers) failed, nothing was updated and its "
      "answers are dropped: %s",
      p,
      rnd.step,
      len(rnd.entries),
      error,
    )
    self._count("failed_merges")
    self._drop_round(p)

  def republish(self, p: int, version: int) -> None:
    """Publishes Θ_p's current values again as `version` (a restore, docs/resilience.md).

    A syncer restored from a checkpoint older than versions it had published before a kill moves
    past them, so that versions stay monotonic for every learner: a learner holding a lost version
    sees a newer one and pulls it. Kept versions stay (reports anchored at them still decode); the
    outer optimizer state and the open round are those of the checkpoint.

    Raises:
      ValueError: if `version` is not greater than the current version.
    """
    self._check_fragment(p)
    if version <= self._version[p]:
      raise ValueError(
        f"Republishing fragment {p} as version {version} needs a version > {self._version[p]}."
      )
    self._version[p] = version
    self._history[p][version] = self._global[p]
    for v in sorted(self._history[p])[: -self._config.keep_versions]:
      del self._history[p][v]
    # An open round moves to the republished version: the same values, which the learners now
    # fetch and answer against. Left at the old base, every answer would weigh 0 and p would never
    # merge again. Answers already in the round were made against these values too.
    if self._rounds[p].step >= 0:
      self._rounds[p].base_version = version

  def freeze(self, p: int) -> None:
    """Opens no more rounds of p until `unfreeze(p)`; an open round of p is closed, its answers
    dropped and counted (a restored syncer waiting to take a lost version back from a learner)."""
    self._check_fragment(p)
    self._frozen.add(p)
    if self._rounds[p].step >= 0:
      self._drop_round(p)

  def unfreeze(self, p: int) -> None:
    """Lets `tick` open rounds of p again (from its next due step)."""
    self._check_fragment(p)
    self._frozen.discard(p)

  def frozen(self) -> frozenset[int]:
    return frozenset(self._frozen)

  def recover(self, p: int, version: int, values: Mapping[str, np.ndarray], digest: str) -> None:
    """Takes `values` back as `version` of p: a version this syncer published, then lost in a kill.

    A restored syncer holds p at an older version than it had published (its checkpoint predates
    the newest merges); a learner still holds the newest, bit-identical, and the merge journal has
    its digest. If `values` have that digest, they become Θ_p at `version`: no merge is lost. The
    outer optimizer state stays the checkpoint's (the lost merges' momentum is not recovered). An
    open round of p is closed without a merge (its base moved).

    Raises:
      ValueError: if `version` is not newer than p's, the keys, shapes or dtypes differ, a value is
        not finite, or the values' digest is not `digest`. Nothing changes then.
    """
    self._check_fragment(p)
    if version <= self._version[p]:
      raise ValueError(f"Fragment {p} is at version {self._version[p]}; {version} is not newer.")
    expected = self._global[p]
    if set(values) != set(expected):
      raise ValueError(f"The keys of the recovered fragment {p} differ from the layout's.")
    copies = {}
    for k, ref in expected.items():
      v = np.asarray(values[k])
      if v.shape != ref.shape or v.dtype != ref.dtype:
        raise ValueError(
          f"{k!r} is {v.dtype}{list(v.shape)}, expected {ref.dtype}{list(ref.shape)}"
        )
      if not merge_lib.all_finite(v):
        raise ValueError(_non_finite(k, v))
      copies[k] = readonly(np.array(v, copy=True))
    got = values_digest(copies)
    if got != digest:
      raise ValueError(
        f"The recovered values of fragment {p} have digest {got}, not version {version}'s {digest}."
      )
    if self._rounds[p].step >= 0:
      self._drop_round(p)
    self._global[p] = copies
    self._version[p] = version
    self._digest[p] = digest
    self._theta_norm[p] = _norm(copies)
    self._history[p][version] = copies
    for v in sorted(self._history[p])[: -self._config.keep_versions]:
      del self._history[p][v]

  def _drop_round(self, p: int) -> None:
    """Closes p's open round without a merge; its answers' tokens are dropped."""
    for i, e in self._rounds[p].entries.items():
      self._count("dropped_tokens", e.report.tokens)
      self._count("ledger_dropped", e.report.new_tokens)
      record = self._learners.get(i)
      if record is not None:
        record.ledger["dropped"] = _checked_add(record.ledger["dropped"], e.report.new_tokens)
    self._close(p)

  def _close(self, p: int) -> None:
    rnd = self._rounds[p]
    if rnd.first_time is not None:
      self._closed_first[p] = (rnd.step, rnd.first_time)
    self._rounds[p] = Round()

  def kept(self, p: int, version: int) -> bool:
    """Whether `version` of fragment p is kept (`keep_versions`)."""
    self._check_fragment(p)
    return version in self._history[p]

  def observe_sync_time(self, seconds: float) -> None:
    """A transport reports how long delivering a merge took (feeds ξ_sync, docs/algorithm.md §4.2)."""
    self._grace.observe_sync_time(seconds)

  # -- reading state ------------------------------------------------------------------------------

  def version(self, p: int) -> int:
    """Current version of fragment p."""
    self._check_fragment(p)
    return self._version[p]

  def state(self, p: int) -> FragmentState:
    """Current Θ_p with its version and digest (read-only arrays)."""
    self._check_fragment(p)
    return FragmentState(p, self._version[p], dict(self._global[p]), self._digest[p])

  def state_at(self, p: int, version: int) -> FragmentState:
    """A recent version of Θ_p (the last `keep_versions`), for re-anchoring deltas (docs/algorithm.md §4.3).

    Raises:
      KeyError: if that version is no longer (or not yet) kept.
    """
    self._check_fragment(p)
    if version not in self._history[p]:
      raise KeyError(f"Version {version} of fragment {p} is not kept ({sorted(self._history[p])}).")
    values = self._history[p][version]
    digest = self._digest[p] if version == self._version[p] else values_digest(values)
    return FragmentState(p, version, dict(values), digest)

  def values_at(self, p: int, version: int) -> dict[str, np.ndarray]:
    """Like `state_at(p, version).values` without hashing them (the service's delta anchors).

    Raises:
      KeyError: if that version is no longer (or not yet) kept.
    """
    self._check_fragment(p)
    if version not in self._history[p]:
      raise KeyError(f"Version {version} of fragment {p} is not kept ({sorted(self._history[p])}).")
    return dict(self._history[p][version])

  def merged_steps(self, learner_id: int) -> list[int]:
    """Per fragment, the step of `learner_id`'s newest report merged into it (-1: none yet).

    With `version(p)` read at the same time it settles a learner's ledger: a report of p at step s
    that a round took for version r was merged iff merged_steps[p] >= s once version(p) >= r.
    """
    record = self._learner(learner_id)
    return [record.merged_step.get(p, -1) for p in range(self.num_fragments)]

  def ledger(self) -> dict:
    """The token ledger: totals, the tokens pending in open rounds, and per learner.

    Totals balance by construction of each path: received = merged + dropped + pending.
    """
    pending = {i: 0 for i in self._learners}
    for rnd in self._rounds:
      for i, e in rnd.entries.items():
        pending[i] = pending.get(i, 0) + e.report.new_tokens
    return {
      "received": self._counters["ledger_received"],
      "merged": self._counters["ledger_merged"],
      "dropped": self._counters["ledger_dropped"],
      "pending": sum(pending.values()),
      "learners": {
        i: {**lr.ledger, "pending": pending.get(i, 0)} for i, lr in sorted(self._learners.items())
      },
    }

  def grace_window(self) -> float:
    """The grace window a round reaching its quorum now would get (docs/algorithm.md §4.2)."""
    return self._grace.window() if self._config.use_grace else 0.0

  def stats(self) -> dict:
    """Counters (see `COUNTERS`), merges per quorum size and their mean, open rounds, versions."""
    out: dict = dict(self._counters)
    hist = self._quorum_hist
    out["quorum_size_counts"] = {n: int(c) for n, c in enumerate(hist) if c}
    merges = int(hist.sum())
    out["mean_quorum_size"] = float(np.arange(len(hist)) @ hist / merges) if merges else 0.0
    out["open_rounds"] = sum(1 for r in self._rounds if r.step >= 0)
    out["versions"] = list(self._version)
    return out

  # -- helpers ------------------------------------------------------------------------------------

  def _count(self, name: str, n: int = 1) -> None:
    self._counters[name] = _checked_add(self._counters[name], n)

  def warm_up(self, p: int, answers: int = 1) -> None:
    """Compiles fragment p's outer step now, so that its first merge does not.

    A merge runs under the service's lock: a first merge that compiles holds every push, pull and
    heartbeat for the compile's time (0.1 s idle, seconds beside starting learners, for each of the
    P fragments). For a fragment merged inside its outer step (`SyncerConfig.fused_merge_bytes`)
    the program depends on the number of answers: `answers` δ answers are compiled for (the
    fleet's size is the common case; other counts compile at their first merge). The step runs
    once on the current values and zero outer gradients, and its results are discarded (nothing
    is donated): nothing changes. Safe to call from several threads for different fragments.
    """
    self._check_fragment(p)
    if answers < 1:
      raise ValueError(f"answers must be >= 1, got {answers}.")
    params = self._params32(p)
    zeros = {k: jnp.zeros(v.shape, jnp.float32) for k, v in params.items()}
    if not self._fused[p]:
      ones = {k: 1.0 for k in params}
      jax.block_until_ready(self._outer.step(params, zeros, ones, self._opt_state[p]))
      return
    values = {k: np.zeros(v.shape, v.dtype) for k, v in self._global[p].items()}
    out = self._outer.merge_and_step(
      params,
      base=None,
      answers=[values] * answers,
      deltas=[True] * answers,
      coefs={k: {} for k in params},
      radius={
        k: None if k in self._embedding_keys or self._config.merge_method == "mean" else 0.0
        for k in params
      },
      opt_state=self._opt_state[p],
    )
    jax.block_until_ready(out)

  def _params32(self, p: int) -> dict[str, jax.Array]:
    """Θ_p in float32 for the outer step: float32 values as they are (`device_put` hands an
    aligned array to XLA without a copy; nothing is donated, so XLA never writes into them);
    other dtypes cast."""
    return {
      k: jax.device_put(v) if v.dtype == np.float32 else jnp.asarray(v, jnp.float32)
      for k, v in self._global[p].items()
    }

  def _check_fragment(self, p: int) -> None:
    if not 0 <= p < self.num_fragments:
      raise ValueError(f"Unknown fragment {p}; this syncer holds 0..{self.num_fragments - 1}.")

  def _learner(self, learner_id: int) -> LearnerRecord:
    learner = self._learners.get(learner_id)
    if learner is None:
      raise ValueError(f"Learner {learner_id} never registered.")
    return learner
