"""The sender threads of a learner process (learner_process/senders.py), against fake clients: which
answer goes out when, and what an answer that cannot be sent becomes."""

import collections
import contextlib
import queue
import threading
import time
import types

import grpc
import pytest

from ddiloco.learner_process.link import SyncerLink
from ddiloco.learner_process.senders import Senders
from ddiloco.learner_process.session import SyncerSession
from ddiloco.protocol import Answer, HostTheta, ReportResult

pytestmark = pytest.mark.timeout(120)  # Threads: a hang must fail the test.


def _senders(
  client, count: int, *, shards: int = 1, fragments: tuple[int, ...] = (0, 1)
) -> tuple[Senders, threading.Event, queue.Queue]:
  """Senders with no learner behind them: answers of `fragments` queued, the older first.
  Returns them, their stop event and their results queue."""
  link = SyncerLink(client, learner_id=0, layouts=[{}] * 4, layout_digest="")
  session = SyncerSession(
    learner=types.SimpleNamespace(), client=client, link=link, event=lambda *a, **k: None
  )
  stop, results = threading.Event(), queue.Queue()
  senders = Senders(
    learner_id=0,
    link=link,
    session=session,
    results=results,
    stop=stop,
    event=lambda *a, **k: None,
    count=count,
    shards=shards,
  )
  for p in fragments:
    assert senders.enqueue(_answer(p, step=p)) is None
  return senders, stop, results


@contextlib.contextmanager
def _running(sender, stop: threading.Event, release: threading.Event):
  """Runs every sender thread; at the end releases the hung push, stops and joins them."""
  threads = [threading.Thread(target=sender.run, args=(k,)) for k in range(sender.count)]
  for t in threads:
    t.start()
  try:
    yield threads
  finally:
    release.set()
    stop.set()
    sender.wake()
    for t in threads:
      t.join(10)


def _answer(p: int, *, step: int, steps: int = 1, new_tokens: int = 0) -> Answer:
  """An answer of fragment p with an empty θ and no anchor (sent as fp32 θ)."""
  return Answer(
    learner_id=0,
    fragment=p,
    round_step=-1,
    step=step,
    anchor_version=0,
    tokens=1,
    steps=steps,
    new_tokens=new_tokens,
    theta=HostTheta({}),
    anchor=None,
  )


@pytest.mark.parametrize("senders", [1, 2])
def test_a_slow_push_holds_back_other_fragments_only_with_one_sender(senders):
  """The sender threads: with two, fragment 1's answer goes out while fragment 0's push hangs;
  with one, it waits behind it (answers queued seconds behind slow pushes under load)."""
  release, pushed = threading.Event(), []

  class _Client:
    def push(self, report, codec, *, block_size, anchor_values):
      del codec, block_size, anchor_values
      if report.fragment == 0:
        release.wait(10)
      pushed.append(report.fragment)
      return ReportResult("accepted", "", 1.0)

  sender, stop, results = _senders(_Client(), senders)  # Fragment 0's answer is the older one.
  with _running(sender, stop, release) as threads:
    deadline = time.monotonic() + 10
    while senders == 2 and pushed != [1] and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.2)  # One sender: fragment 1 must still be waiting.
    assert pushed == ([1] if senders == 2 else [])
  assert sorted(pushed) == [0, 1] and not any(t.is_alive() for t in threads)
  assert results.qsize() == 2


def test_pushes_to_different_shards_go_out_side_by_side():
  """Two shards, one sender each: slices 0 and 1 of a group (shards 0 and 1) go out together
  while slice 0's push hangs; fragment 2 (shard 0 too) waits behind it though 3 is sent."""
  release, pushed, in_flight = threading.Event(), [], []

  class _Client:
    def push(self, report, codec, *, block_size, anchor_values):
      del codec, block_size, anchor_values
      in_flight.append(report.fragment)
      if report.fragment == 0:
        release.wait(10)
      pushed.append(report.fragment)
      return ReportResult("accepted", "", 1.0)

  sender, stop, results = _senders(_Client(), 1, shards=2, fragments=(0, 1, 2, 3))
  assert sender.count == 2  # One thread per shard.
  with _running(sender, stop, release) as threads:
    deadline = time.monotonic() + 10
    while pushed != [1, 3] and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.2)  # Fragment 2 must still be waiting for shard 0's one push.
    assert pushed == [1, 3] and sorted(in_flight) == [0, 1, 3]
  assert sorted(pushed) == [0, 1, 2, 3] and not any(t.is_alive() for t in threads)
  assert results.qsize() == 4
  with pytest.raises(ValueError, match="shards must be >= 1"):
    _senders(_Client(), 1, shards=0)


def test_an_answer_that_cannot_be_encoded_is_rejected_and_the_sender_goes_on():
  """θ_p with NaN cannot be encoded: the answer is booked rejected (never retried) and the sender
  thread keeps pushing the other fragments' answers."""

  class _Client:
    def push(self, report, codec, *, block_size, anchor_values):
      del codec, block_size, anchor_values
      if report.fragment == 0:
        raise ValueError("1 NaN/Inf value in 'w'")
      return ReportResult("accepted", "", 1.0)

  senders, stop, results = _senders(_Client(), count=1)
  sender = threading.Thread(target=senders.run, args=(0,))
  sender.start()
  try:
    deadline = time.monotonic() + 10
    while results.qsize() < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    stop.set()
    senders.wake()
    sender.join(10)
  results = {p: r for p, _, r in (results.get() for _ in range(2))}
  assert results[0].status == "rejected" and "NaN" in results[0].reason
  assert results[1].status == "accepted"
  assert not senders._jobs  # Never queued again.


def test_a_newer_snapshot_replaces_an_unsent_one_and_carries_its_tokens():
  """`enqueue` folds an unsent older answer of the same fragment into the newer one (its ledger
  tokens ride along) and says which step it replaced."""
  sender, _, _ = _senders(types.SimpleNamespace(), count=1)  # Fragment 1's answer of step 1.
  for step, new_tokens, replaced in ((2, 4, 1), (3, 5, 2)):
    answer = _answer(1, step=step, steps=step, new_tokens=new_tokens)
    assert sender.enqueue(answer) == replaced
  job = sender._jobs[1]
  assert (job.answer.step, job.answer.new_tokens) == (3, 9)


class _Unavailable(grpc.RpcError):
  def code(self):
    return grpc.StatusCode.UNAVAILABLE

  def details(self):
    return "shard down"


def test_a_down_shard_backs_off_alone_and_the_others_answers_go_out_at_once():
  """Shard 1 is down: its pushes fail and its (older) answers wait out a backoff of its own,
  while shard 0's answers, queued every 50 ms, go out at once. A thread that slept in the
  backoff itself left every thread asleep after shard 1's failures, and shard 0's answers waited
  up to seconds."""
  attempts, latency, queued_at = collections.Counter(), [], {}

  class _Client:
    def push(self, report, codec, *, block_size, anchor_values):
      del codec, block_size, anchor_values
      attempts[report.fragment] += 1
      if report.fragment % 2:
        raise _Unavailable()
      latency.append(time.monotonic() - queued_at[report.step])
      return ReportResult("accepted", "", 1.0)

  sender, stop, results = _senders(_Client(), 2, shards=2, fragments=(1, 3))
  with _running(sender, stop, threading.Event()):
    for step in range(10, 70):  # 3 s of shard 0's answers, fragments 0 and 2 by turns.
      queued_at[step] = time.monotonic()
      sender.enqueue(_answer(2 * (step % 2), step=step))
      time.sleep(0.05)
    deadline = time.monotonic() + 10
    while results.qsize() < len(latency) and time.monotonic() < deadline:
      time.sleep(0.01)
  assert len(latency) >= 50  # Nearly every one pushed (a newer one may replace an unsent one).
  assert max(latency) < 0.4, sorted(latency)[-5:]
  # Shard 1 was tried again and again, but backing off: nowhere near once per 50 ms.
  assert 3 <= attempts[1] + attempts[3] <= 30, attempts
