"""`ddiloco-fleet`: add learners to a running `ddiloco-local` job, remove them, list the fleet.

  ddiloco-fleet --workdir=W add [--devices=2] [--batch_size=4] [--steps=N] [--learner_id=I]
  ddiloco-fleet --workdir=W remove --learner_id=4 [--timeout_s=60]
  ddiloco-fleet --workdir=W list

Elastic scavenging (docs/algorithm.md §6): spare compute joins the job as extra learners, with their own device
count, batch size and step count, and leaves again. The command talks to the launcher through the
workdir's control folder (launch/fleet.py); it fails at once when no launcher runs there, and the
launcher refuses bad requests (unknown learner, id in use, a batch that does not split over the
devices) without changing anything. `remove` waits until the learner saved, left and exited.
See docs/resilience.md "Elastic scavenging (real processes)".
"""

import json
import sys

from absl import app, flags

from ddiloco.launch import cli, fleet

_WORKDIR = flags.DEFINE_string("workdir", None, "the running job's workdir", required=True)
_LEARNER_ID = flags.DEFINE_integer("learner_id", None, "add: its id (default: a new one); remove")
_DEVICES = flags.DEFINE_integer("devices", None, "add: fake CPU devices (default: the job's)")
_BATCH = flags.DEFINE_integer("batch_size", None, "add: examples per step (default: the job's)")
_STEPS = flags.DEFINE_integer("steps", None, "add: inner steps before it leaves (default: job's)")
_GIN = flags.DEFINE_multi_string("learner_gin", [], "add: gin binding KEY=VALUE for it only")
_TIMEOUT = flags.DEFINE_float(
  "timeout_s", fleet.DEFAULT_REMOVE_TIMEOUT_S, "remove: graceful wait before SIGKILL"
)
_WAIT = flags.DEFINE_float(
  "wait_s", 60.0, "how long to wait for the launcher's answer", lower_bound=0.0
)
_JSON = flags.DEFINE_bool("json", False, "print the launcher's answer as JSON")


def main(argv: list[str]) -> None:
  if len(argv) != 2 or argv[1] not in fleet.ACTIONS:
    raise app.UsageError(f"Give exactly one command: {' | '.join(fleet.ACTIONS)}.")
  action = argv[1]
  try:
    client = fleet.FleetClient(_WORKDIR.value, timeout_s=_WAIT.value)
    if action == "add":
      result = client.add(
        learner_id=_LEARNER_ID.value,
        devices=_DEVICES.value,
        batch_size=_BATCH.value,
        steps=_STEPS.value,
        gin_bindings=_GIN.value,
      )
    elif action == "remove":
      if _LEARNER_ID.value is None:
        raise app.UsageError("remove needs --learner_id.")
      result = client.remove(_LEARNER_ID.value, timeout_s=_TIMEOUT.value)
    else:
      result = client.list()
  except ValueError as e:  # A bad request, refused before it was sent.
    raise app.UsageError(f"{action}: {e}") from e
  except fleet.FleetError as e:  # Refused by the launcher, or no launcher answered.
    print(f"ddiloco-fleet {action}: {e}", file=sys.stderr)
    sys.exit(1)
  print(json.dumps(result, indent=1) if _JSON.value else fleet.format_answer(action, result))


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-fleet", module=__name__, gin=False)


if __name__ == "__main__":
  run()
