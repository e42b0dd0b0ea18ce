"""The protocol's small messages and their protobuf forms: a push's answer and the Rounds events.

One encoder and one decoder per object, used by both ends: the service encodes (streams.py,
subscriptions), the client and the simulated cluster decode, and a multi-process learner's leader
forwards them to its other processes in the same forms (`process_share`).
"""

from ddiloco.protocol import ReportResult, RoundRequest
from ddiloco.transport.proto import syncer_pb2


def push_response(result: ReportResult) -> syncer_pb2.PushResponse:
  """The PushResponse of a report's result."""
  return syncer_pb2.PushResponse(
    status=result.status,
    reason=result.reason,
    weight=result.weight,
    fleet_step=result.fleet_step,
    round_version=result.round_version,
  )


def report_result(resp: syncer_pb2.PushResponse) -> ReportResult:
  """The `ReportResult` a PushResponse carries."""
  return ReportResult(
    resp.status, resp.reason, resp.weight, int(resp.fleet_step), int(resp.round_version)
  )


def round_event(request: RoundRequest) -> syncer_pb2.SyncerEvent:
  """The Rounds event that opens round (fragment, round_step)."""
  return syncer_pb2.SyncerEvent(
    round=syncer_pb2.RoundOpen(
      fragment=request.fragment,
      round_step=request.round_step,
      base_version=request.base_version,
    )
  )


def published_event(fragment: int, version: int) -> syncer_pb2.SyncerEvent:
  """The Rounds event that announces a published version."""
  return syncer_pb2.SyncerEvent(published=syncer_pb2.Published(fragment=fragment, version=version))


def syncer_event(event: syncer_pb2.SyncerEvent) -> RoundRequest | tuple[int, int] | None:
  """A `Rounds` event as the learner reads it: a `RoundRequest`, a (fragment, version)
  announcement, or None for an event of a kind this client does not know."""
  kind = event.WhichOneof("event")
  if kind == "round":
    r = event.round
    return RoundRequest(int(r.fragment), int(r.round_step), int(r.base_version))
  if kind == "published":
    return (int(event.published.fragment), int(event.published.version))
  return None
