"""Waiting for a learner's step in flight while staying awake for round requests.

The training thread of a learner process (learner_process/training.py) dispatches a step and waits for
it. A round request that arrives meanwhile should be answered at once, with θ of the last step
(`Learner.start_step`), not after the step: on 2 shared cores a step took up to 1.2 s in the main
job, and answers that waited for it missed their rounds' grace windows. `StepWaiter` blocks on
the step's output in a thread of its own and wakes the training thread either when the step is
done or when `poke` says a request came.
"""

import threading
from collections.abc import Callable
from typing import Any

import jax


class StepWaiter:
  """Waits for dispatched steps in a background thread (see module docstring).

  `wait(array, on_poke)` returns once `array` is ready, calling `on_poke()` on the calling
  thread each time `poke()` was called meanwhile (and once more if pokes came while it ran).
  """

  def __init__(self, name: str = "step-waiter"):
    self._cond = threading.Condition()
    self._pending: Any = None  # The array to wait for, handed to the thread.
    self._ready = True
    self._poked = False
    self._closed = False
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while True:
      with self._cond:
        while self._pending is None and not self._closed:
          self._cond.wait()
        if self._closed:
          return
        array = self._pending
      error = None
      try:
        jax.block_until_ready(array)
      except BaseException as e:  # Re-raised on the training thread, which owns the step.
        error = e
      with self._cond:
        self._pending = None
        self._ready, self._error = True, error
        self._cond.notify_all()

  def poke(self) -> None:
    """Wakes a `wait` in progress so that it calls its `on_poke` (from any thread)."""
    with self._cond:
      self._poked = True
      self._cond.notify_all()

  def wait(self, array: Any, on_poke: Callable[[], None]) -> None:
    """Blocks until `array` is ready; runs `on_poke` for pokes that came meanwhile.

    Raises:
      RuntimeError: if the waiter was closed.
      Whatever waiting for the step raised (e.g. an XLA runtime error).
    """
    with self._cond:
      if self._closed:
        raise RuntimeError("StepWaiter is closed.")
      self._pending, self._ready, self._error = array, False, None
      self._cond.notify_all()
    while True:
      with self._cond:
        while not self._ready and not self._poked:
          self._cond.wait()
        poked, self._poked = self._poked, False
        ready, error = self._ready, self._error
      if poked:
        on_poke()
      if ready:
        if error is not None:
          raise error
        return

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    self._thread.join(timeout=5.0)
