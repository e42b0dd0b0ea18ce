"""One fault vocabulary for every runtime: events, their text form, and the executor interface.

A fault is a `FaultEvent` of one of `KINDS`. The chaos planner (`ddiloco.faults.schedule`) draws
them for a real cluster, the text grammar (`parse_faults`, e.g. "crash:1@30+20") writes them in a
gin file for the simulator, and each runtime executes them through a `FaultExecutor`: the
simulator's on its virtual clock (`ddiloco.simulation.faults`), the process driver's with signals
and a proxy (`ddiloco.chaos.driver`).
"""

from ddiloco.faults.events import (
  COMPLETIONS,
  KINDS,
  LEARNER_KINDS,
  NETWORK_KINDS,
  SYNCER_KINDS,
  FaultEvent,
)
from ddiloco.faults.executor import FaultExecutor, check_supported
from ddiloco.faults.grammar import parse_fault, parse_faults

__all__ = [
  "COMPLETIONS",
  "KINDS",
  "LEARNER_KINDS",
  "NETWORK_KINDS",
  "SYNCER_KINDS",
  "FaultEvent",
  "FaultExecutor",
  "check_supported",
  "parse_fault",
  "parse_faults",
]
