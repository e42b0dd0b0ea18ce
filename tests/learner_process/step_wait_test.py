"""Tests for `StepWaiter`: the training thread waits for its step, woken by round requests."""

import threading
import time

import jax.numpy as jnp
import pytest

from ddiloco.learner_process.step_wait import StepWaiter

pytestmark = pytest.mark.timeout(30)  # Threads: a hang must fail the test.


class _Step:
  """Stands in for a step's output: ready when `done` is set (or raises `error` then)."""

  def __init__(self, error: BaseException | None = None):
    self.done = threading.Event()
    self.error = error

  def block_until_ready(self):
    self.done.wait(20)
    if self.error is not None:
      raise self.error
    return self


def _wait_in_thread(waiter, step, on_poke):
  out = {}

  def run():
    try:
      waiter.wait(step, on_poke)
      out["returned"] = time.monotonic()
    except BaseException as e:  # Checked by the test.
      out["error"] = e

  t = threading.Thread(target=run)
  t.start()
  return t, out


def test_a_poke_runs_on_the_waiting_thread_before_the_step_is_done():
  waiter, step, calls = StepWaiter(), _Step(), []
  waiting_thread = []
  t, out = _wait_in_thread(
    waiter,
    step,
    lambda: (calls.append(time.monotonic()), waiting_thread.append(threading.get_ident())),
  )
  waiter.poke()
  deadline = time.monotonic() + 10
  while not calls and time.monotonic() < deadline:
    time.sleep(0.005)
  assert len(calls) == 1 and "returned" not in out  # Answered while the step runs.
  assert waiting_thread == [t.ident]
  step.done.set()
  t.join(10)
  assert out["returned"] > calls[0]
  waiter.close()


def test_a_ready_step_returns_without_pokes_and_errors_reach_the_waiter():
  waiter, calls = StepWaiter(), []
  waiter.wait(jnp.ones(3), lambda: calls.append(1))
  assert calls == []
  failing = _Step(error=RuntimeError("XLA runtime error"))
  t, out = _wait_in_thread(waiter, failing, lambda: None)
  failing.done.set()
  t.join(10)
  assert isinstance(out["error"], RuntimeError) and "XLA" in str(out["error"])
  waiter.wait(jnp.ones(3), lambda: None)  # Still usable after a failed step.
  waiter.close()
  with pytest.raises(RuntimeError, match="closed"):
    waiter.wait(jnp.ones(3), lambda: None)
