"""The interface a runtime implements to execute fault events."""

from collections.abc import Iterable
from typing import Protocol

from ddiloco.faults.events import FaultEvent


class FaultExecutor(Protocol):
  """Executes fault events on one runtime.

  Attributes:
    kinds: the fault kinds this runtime can execute.
  """

  kinds: frozenset[str]

  def execute(self, event: FaultEvent) -> bool:
    """Executes `event` now; False when it had nothing to act on (e.g. a kill of a learner that
    is down already or has finished), which runtimes treat alike."""
    ...


def check_supported(executor: FaultExecutor, events: Iterable[FaultEvent], what: str) -> None:
  """Refuses, before a run starts, a schedule with kinds `executor` cannot execute.

  Raises:
    ValueError: naming the kinds and the runtime (`what`).
  """
  missing = sorted({e.kind for e in events} - executor.kinds)
  if missing:
    raise ValueError(
      f"{what} cannot execute fault kinds {missing}; it can: {sorted(executor.kinds)}."
    )
