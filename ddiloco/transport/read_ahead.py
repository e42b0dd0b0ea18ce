"""A helper thread that reads an iterator ahead into a small bounded queue.

Both ends of a stream use it: the bulk port's client encodes a push's next chunks (or reads a
pull's next frames) while it sends (or decodes) the previous ones (`bulk_wire.Prefetch`), and the
syncer reads a Recover's gRPC request stream in a helper thread so its handler can wait for each
item with a deadline (`service/door.PacedStream`).
"""

import contextlib
import queue
import threading
from collections.abc import Iterable

_END = object()


class ReadAhead:
  """Iterates `source` in a daemon thread, at most `depth` items ahead of the consumer.

  What `source` raises is handed to the consumer, which gets it from `get` where the item would
  have been. After `stop`, the thread hands over nothing more: it ends at its next item (or within
  0.1 s while the queue is full), closing `source` first if `close_source` (a generator's `finally`
  then runs at once, not when it is collected).

  Args:
    source: what to read.
    depth: items read ahead.
    name: the thread's name.
    close_source: call `source.close()` (if it has one) when stopped early.
  """

  def __init__(self, source: Iterable, *, depth: int, name: str, close_source: bool = False):
    self._items: queue.Queue = queue.Queue(maxsize=depth)
    self._stopped = threading.Event()
    self._close_source = close_source
    self._thread = threading.Thread(target=self._run, args=(source,), name=name, daemon=True)
    self._thread.start()

  def _run(self, source: Iterable) -> None:
    try:
      for item in source:
        if not self._put(item):
          close = getattr(source, "close", None) if self._close_source else None
          if close is not None:
            close()
          return
      self._put(_END)
    except BaseException as e:  # Handed to the consumer, which raises it.
      self._put(e)

  def _put(self, item) -> bool:
    while not self._stopped.is_set():
      try:
        self._items.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def get(self, timeout: float | None = None):
    """The next item.

    Raises:
      StopIteration: at the end of `source` (and on every later call), or after `wake`.
      queue.Empty: if no item came within `timeout` seconds.
      BaseException: what `source` raised.
    """
    item = self._items.get(timeout=timeout)
    if item is _END:
      self.wake()  # Getting again stays at the end.
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def wake(self) -> None:
    """Makes a waiting (or the next) `get` end as if `source` had ended, from any thread."""
    with contextlib.suppress(queue.Full):  # Items are waiting: the consumer checks its own flags.
      self._items.put_nowait(_END)

  def stop(self) -> None:
    """Stops handing items over (idempotent)."""
    self._stopped.set()

  def join(self, timeout_s: float) -> None:
    self._thread.join(timeout_s)
