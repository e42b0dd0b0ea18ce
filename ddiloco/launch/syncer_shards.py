"""A sharded syncer's processes on one file system: where each shard writes, and the global model
its shards hold together (docs/architecture.md, "The sharded syncer").

Shard 0 writes to the syncer's workdir (`W/syncer` under `ddiloco-local`), shard i > 0 to the
sibling `W/syncer_<i>`, each with its own checkpoints, merge journal and summary. No shard holds the
whole model: at shutdown each shard i > 0 writes its fragments' final values (`FINAL_VALUES`), and
shard 0 joins them with its own to evaluate the final global model. On several hosts the folders must
be on a file system every shard mounts for that last evaluation; training does not need it.
"""

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ddiloco.checkpoint.syncer import WorkdirMismatch

FINAL_VALUES = "final_values.npz"
# Which shard of how many wrote a syncer workdir: a shard restarted on another's state (or with
# another shard count) would serve fragments it does not own, or refuse its checkpoint late.
SHARD_FILE = "syncer_shard.json"


def shard_workdir(syncer_workdir: str, shard: int) -> str:
  """Shard `shard`'s workdir, given shard 0's (`W/syncer` → `W/syncer_<shard>`)."""
  if shard == 0:
    return syncer_workdir
  return f"{syncer_workdir.rstrip('/')}_{shard}"


def check_workdir(workdir: str, shard: int, num_shards: int) -> bool:
  """Refuses a syncer workdir that another shard, or a syncer with another shard count, wrote
  (`record_workdir`); whether it says which wrote it (a fresh workdir, or one older than the
  record, does not: the restore's own checks are then what refuse another's state).

  Raises:
    WorkdirMismatch: naming the shard that wrote it and this one.
  """
  path = os.path.join(workdir, SHARD_FILE)
  mine = {"shard": shard, "num_shards": num_shards}
  try:
    with open(path) as f:
      theirs = json.load(f)
  except FileNotFoundError:
    return False
  except (OSError, ValueError) as e:
    raise WorkdirMismatch(f"{path} is unreadable ({e}): is {workdir} a syncer's workdir?") from e
  if theirs != mine:
    raise WorkdirMismatch(
      f"{workdir} holds the state of {_shard_name(theirs)}, not of {_shard_name(mine)}: start each "
      "shard on its own workdir with the shard count it was written with (--shard, "
      "JobConfig.syncer_shards), or on a fresh workdir."
    )
  return True


def record_workdir(workdir: str, shard: int, num_shards: int) -> None:
  """Records which shard of how many writes a syncer workdir (once its state is restored)."""
  path = os.path.join(workdir, SHARD_FILE)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump({"shard": shard, "num_shards": num_shards}, f)
  os.replace(tmp, path)


def _shard_name(record: Mapping[str, Any]) -> str:
  if record.get("num_shards") == 1:
    return "an unsharded syncer"
  return f"syncer shard {record.get('shard')} of {record.get('num_shards')}"


def parse_addresses(text: str, num_shards: int) -> tuple[str, ...]:
  """The comma-separated host:port list of `--shard_addresses`, checked against the shard count.

  Raises:
    ValueError: if the count differs from `num_shards` (S > 1) or an address is empty.
  """
  addresses = tuple(a.strip() for a in text.split(",")) if text else ()
  if num_shards == 1 and not addresses:
    return ()
  if len(addresses) != num_shards or not all(addresses):
    raise ValueError(
      f"JobConfig.syncer_shards={num_shards} needs --shard_addresses with {num_shards} "
      f"host:port entries, got {text!r}."
    )
  return addresses


def write_final_values(
  workdir: str, fragments: Mapping[int, Mapping[str, np.ndarray]], versions: Mapping[int, int]
) -> str:
  """Writes a shard's final fragment values (atomically); returns the file's path."""
  arrays = {f"{p}/{k}": np.asarray(v) for p, vals in fragments.items() for k, v in vals.items()}
  arrays.update({f"{p}/__version__": np.int64(v) for p, v in versions.items()})
  path = os.path.join(workdir, FINAL_VALUES)
  tmp = path + ".tmp.npz"
  np.savez(tmp, **arrays)
  os.replace(tmp, path)
  return path


def read_final_values(
  syncer_workdir: str,
  shards: Sequence[int],
  *,
  newer_than: float,
  timeout_s: float,
  poll_s: float = 0.25,
) -> dict[int, dict[str, np.ndarray]] | None:
  """{fragment: values} from the final-values files of `shards`, waiting up to `timeout_s` for
  files written after `newer_than` (a wall time); None if one did not come."""
  deadline = time.monotonic() + timeout_s
  paths = [os.path.join(shard_workdir(syncer_workdir, s), FINAL_VALUES) for s in shards]
  while True:
    fresh = [os.path.exists(p) and os.path.getmtime(p) >= newer_than for p in paths]
    if all(fresh):
      break
    if time.monotonic() >= deadline:
      return None
    time.sleep(poll_s)
  out: dict[int, dict[str, np.ndarray]] = {}
  for path in paths:
    with np.load(path) as f:
      for name in f.files:
        p, key = name.split("/", 1)
        if key != "__version__":
          out.setdefault(int(p), {})[key] = f[name]
  return out


def gather(
  workdir: str, core, shard: int, num_shards: int, *, started: float, timeout_s: float = 120.0
) -> dict[int, dict[str, np.ndarray]] | None:
  """At shutdown (the service stopped): shard i > 0 writes its final values and returns
  None; shard 0 returns the others' final values, written after `started`, or None if one did not
  come within `timeout_s`."""
  if shard != 0:
    write_final_values(
      workdir,
      {p: core.state(p).values for p in core.owned},
      {p: core.version(p) for p in core.owned},
    )
    return None
  return read_final_values(workdir, range(1, num_shards), newer_than=started, timeout_s=timeout_s)


def status_client(addresses: Sequence[str], connect: Callable[[str], Any]) -> Any:
  """The launcher's status client: the syncer's own, or a `ShardsStatus` over every shard's."""
  clients = [connect(a) for a in addresses]
  return clients[0] if len(clients) == 1 else ShardsStatus(clients)


class ShardsStatus:
  """The `Status` of every shard as one syncer's, for the launcher's progress lines and fleet
  requests: each fragment's version from its owner, merges, counters and refusals summed, the
  alive learners of any shard. `status_line` adds the merges of each shard.

  Args:
    clients: one client per shard (`status()`), in shard order.
  """

  def __init__(self, clients: Sequence):
    self._clients = list(clients)

  def close(self) -> None:
    for c in self._clients:
      c.close()

  def status(self):
    """The merged StatusResponse of the shards that answer (a shard that is down counts its
    fragments at version 0); raises a shard's error if none answers."""
    import grpc

    from ddiloco.transport.proto import syncer_pb2

    answers, error = [], None
    for c in self._clients:
      try:
        answers.append(c.status())
      except grpc.RpcError as e:  # A shard that is down: the others still answer.
        answers.append(None)
        error = error or e
    if all(a is None for a in answers):
      raise error
    num = len(answers)
    first = next(a for a in answers if a is not None)
    versions = [
      answers[p % num].versions[p] if answers[p % num] is not None else 0
      for p in range(len(first.versions))
    ]
    answers = [a for a in answers if a is not None]
    merged = syncer_pb2.StatusResponse()
    merged.CopyFrom(answers[0])
    merged.versions[:] = versions
    merged.merges = sum(a.merges for a in answers)
    merged.alive[:] = sorted({i for a in answers for i in a.alive})
    for a in answers[1:]:
      for k, v in a.counters.items():
        merged.counters[k] = merged.counters.get(k, 0) + v
      for k, v in a.refused.items():
        merged.refused[k] = merged.refused.get(k, 0) + v
      hist = list(merged.quorum_histogram)
      hist += [0] * (len(a.quorum_histogram) - len(hist))
      for q, n in enumerate(a.quorum_histogram):
        hist[q] += n
      merged.quorum_histogram[:] = hist
      merged.bytes_up += a.bytes_up
      merged.bytes_down += a.bytes_down
    merged.num_shards = num
    return merged

  def shard_merges(self) -> list[int | None]:
    """Each shard's merges (None for a shard that does not answer)."""
    import grpc

    out = []
    for c in self._clients:
      try:
        out.append(int(c.status().merges))
      except grpc.RpcError:
        out.append(None)
    return out
