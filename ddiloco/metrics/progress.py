"""The fields of the launchers' progress lines: a value not known yet shows as `-`, never `nan`.

Used by the simulated cluster (`ddiloco-simulate`), `LocalCluster` (`ddiloco-local`) and the chaos
driver (`ddiloco-chaos`).
"""

import math

UNKNOWN = "-"


def _known(value: float | None) -> bool:
  return value is not None and math.isfinite(value)


def number(value: float | None, spec: str = ".3f") -> str:
  """`value` formatted with `spec`, or `-` for None, nan and inf."""
  return format(value, spec) if _known(value) else UNKNOWN


def rate(value: float | None) -> str:
  """A per-second rate with 3 significant figures and a k/M suffix ("812", "12.3k"), or `-`."""
  if not _known(value) or value < 0:
    return UNKNOWN
  for scale, suffix in ((1e6, "M"), (1e3, "k")):
    if value >= scale:
      return f"{value / scale:.3g}{suffix}"
  return f"{value:.3g}"


def duration(seconds: float | None) -> str:
  """A duration as "45s", "3m07s" or "2h05m", or `-`."""
  if not _known(seconds) or seconds < 0:
    return UNKNOWN
  s = round(seconds)
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def throughput(steps_per_s: float | None, tokens_per_s: float | None, eta_s: float | None) -> str:
  """Steps/s, tokens/s and ETA: "3.2 steps/s 820 tok/s eta 1m05s" (`-` for each unknown)."""
  return f"{rate(steps_per_s)} steps/s {rate(tokens_per_s)} tok/s eta {duration(eta_s)}"


def learner(index: int, state: str, step: int | None, loss: float | None) -> str:
  """One learner's part: "L2:up step 40 loss 2.113" ("loss -" before its first logged loss)."""
  return f"L{index}:{state} step {UNKNOWN if step is None else step} loss {number(loss)}"
