"""The progress line `ddiloco-local` prints every few seconds while a run goes on.

"t=  12.0s v_sum   14 merges    7 quorum 1.43 alive [0, 1] | 6 steps/s 3.07k tok/s eta 30s | L0:up
step 40 loss 2.500 L1:up step 80 loss 2.250": the syncer's status (or why it did not answer), the
fleet's pace once every running learner has logged a step time, and each learner's state, step and
loss from its own metrics.jsonl (process 0's for a multi-process learner). The fields are formatted
by ddiloco/metrics/progress.py, as in the other launchers' lines.
"""

import time
from collections.abc import Mapping

from ddiloco.launch import elastic, processes
from ddiloco.metrics import progress as progress_fields


def progress_line(
  client,
  t0: float,
  *,
  learners: Mapping[int, processes.Child],
  fleet: elastic.LearnerFleet,
) -> str:
  """One progress line (module docstring).

  Args:
    client: the syncer's.
    t0: time.time() at the run's start.
    learners: every learner child the launcher started, by id.
    fleet: their membership states, and the job (for the pace).
  """
  import grpc

  try:
    st = client.status()
    hist = list(st.quorum_histogram)
    merges = int(sum(hist))
    mean_q = sum(q * n for q, n in enumerate(hist)) / merges if merges else 0.0
    head = (
      f"t={time.time() - t0:6.1f}s v_sum {sum(st.versions):4d} merges {st.merges:4d} "
      f"quorum {mean_q:.2f} alive {list(st.alive)}"
    )
  except grpc.RpcError as e:
    head = f"t={time.time() - t0:6.1f}s syncer {e.code().name}"
  if hasattr(client, "shard_merges"):  # A sharded syncer: each shard's merges ("-": down).
    head += " shards " + "+".join("-" if m is None else str(m) for m in client.shard_merges())
  parts, paces = [], []
  for i, c in sorted(learners.items()):
    member = fleet.members.get(i)
    if member is not None and member.state in ("removed", "failed"):
      parts.append(f"L{i}:{member.state}")
      continue
    c.poll_metrics()
    rc = c.proc.poll()
    state = "up" if rc is None else ("done" if rc == 0 else "down")
    if member is not None and member.state == "removing":
      state = "leaving"
    if not c.last:
      parts.append(f"L{i}:{state} starting")
    else:
      parts.append(progress_fields.learner(i, state, c.last.get("step"), c.last.get("loss")))
    if rc is None:
      paces.append(_pace(c, member, fleet))
  if paces and None not in paces:
    steps_per_s = sum(p[0] for p in paces)
    rates = progress_fields.throughput(
      steps_per_s, sum(p[1] for p in paces), max(p[2] for p in paces)
    )
  else:  # A running learner is still compiling (or none runs): the fleet's pace is unknown.
    rates = progress_fields.throughput(None, None, None)
  return f"{head} | {rates} | " + " ".join(parts)


def _pace(
  child: processes.Child, member: elastic.FleetMember | None, fleet: elastic.LearnerFleet
) -> tuple[float, float, float] | None:
  """A running learner's (steps/s, tokens/s, seconds left), from the step time it logged over its
  last steps; None while that is unknown (no train event yet, or 0 while it compiles)."""
  step_time = child.last.get("step_time_s") or 0.0
  job = fleet.job
  if step_time <= 0 or job is None:
    return None
  target = (member.steps if member else None) or job.run.steps_per_learner
  batch = (member.batch_size if member else None) or job.run.batch_size
  left = max(0, target - child.last.get("step", 0)) * step_time
  return 1.0 / step_time, job.run.the_task().units_per_step(batch) / step_time, left
