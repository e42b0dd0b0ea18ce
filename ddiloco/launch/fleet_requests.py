"""How a running `ddiloco-local` answers `ddiloco-fleet` requests (list, add, remove).

The command writes requests into the run's workdir (launch/fleet.py, the channel); the launcher's
`ControlServer` hands them to `LocalCluster.run`, whose loop calls `serve_request` for each. A
refused request changes nothing and is answered with the reason; a removal is answered by
`LearnerFleet.check` once the learner is gone (launch/elastic.py).
"""

from collections.abc import Callable
from typing import Any

from ddiloco.launch import elastic
from ddiloco.launch import fleet as fleet_lib


def fleet_status(fleet: elastic.LearnerFleet, client) -> dict[str, Any]:
  """What `ddiloco-fleet list` shows: the fleet, the syncer's membership, the events so far."""
  learners = []
  for i, m in sorted(fleet.members.items()):
    child = fleet.learners[i]
    child.poll_metrics()
    last = {"step": child.last.get("step"), "loss": child.last.get("loss")}
    learners.append({**m.to_json(), "pid": child.proc.pid, **last, "log": child.log_path})
  return {
    "learners": learners,
    "syncer_alive": elastic.syncer_alive(client),
    "membership": list(fleet.membership),
  }


def serve_request(
  request: fleet_lib.FleetRequest,
  *,
  control: fleet_lib.ControlServer,
  fleet: elastic.LearnerFleet,
  add_learner: Callable[..., int],
  client,
  progress: Callable[[str], None] | None,
) -> None:
  """Acts on one ddiloco-fleet request and answers it (a removal answers once it is done).

  Args:
    request: the request.
    control: the channel it came on, and its answer goes back on.
    fleet: the run's learners.
    add_learner: adds a learner, as `LocalCluster.add_learner` (which checks the syncer serves).
    client: the syncer's (for the membership it lists alive).
    progress: where the fleet's changes are said, if anywhere.
  """
  try:
    if request.action == "list":
      control.respond(request.id, ok=True, result=fleet_status(fleet, client))
    elif request.action == "add":
      i = add_learner(
        learner_id=request.learner_id,
        devices=request.devices,
        batch_size=request.batch_size,
        steps=request.steps,
        extra_args=[f"--gin_bindings={b}" for b in request.gin_bindings],
      )
      m = fleet.members[i]
      result = {
        "learner_id": i,
        "devices": m.devices,
        "batch_size": m.batch_size or fleet.job.run.learner_batch_size(),
        "steps": m.steps or fleet.job.run.steps_per_learner,
        "data_shard": i % fleet.job.run.the_data_slots(),  # LearnerFactory.make_data.
        "log": fleet.learners[i].log_path,
      }
      if progress is not None:
        progress(f"fleet: added {result}")
      control.respond(request.id, ok=True, result=result)
    else:
      timeout = request.timeout_s or fleet_lib.DEFAULT_REMOVE_TIMEOUT_S
      member = fleet.begin_remove(request.learner_id, timeout_s=timeout)
      member.request_id = request.id  # Answered by LearnerFleet.check once the learner is gone.
      if progress is not None:
        progress(f"fleet: removing learner {request.learner_id} (SIGTERM)")
  except (ValueError, OSError) as e:  # Refused (or could not start): nothing changed.
    control.respond(request.id, ok=False, error=str(e))
