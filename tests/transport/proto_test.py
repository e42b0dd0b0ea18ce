"""The committed generated code matches syncer.proto, and the protocol has the agreed shape."""

import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_REL = pathlib.Path("ddiloco/transport/proto")
_GENERATED = ("syncer_pb2.py", "syncer_pb2_grpc.py")


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_generated_code_is_up_to_date(tmp_path):
  pytest.importorskip("grpc_tools")
  env = dict(os.environ, PYTHON=sys.executable)
  subprocess.run(
    ["bash", str(_ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
    check=True,
    env=env,
    capture_output=True,
  )
  generated = sorted(p.name for p in (tmp_path / _REL).iterdir())
  assert generated == sorted(_GENERATED)
  for name in _GENERATED:
    fresh = (tmp_path / _REL / name).read_bytes()
    committed = (_ROOT / _REL / name).read_bytes()
    assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh and commit the result."


def test_grpc_module_imports_messages_relatively():
  from ddiloco.transport.proto import syncer_pb2, syncer_pb2_grpc

  text = (_ROOT / _REL / "syncer_pb2_grpc.py").read_text()
  assert "from . import syncer_pb2 as " in text
  assert syncer_pb2_grpc.SyncerStub is not None
  service = syncer_pb2.DESCRIPTOR.services_by_name["Syncer"]
  assert service.full_name == "ddiloco.v1.Syncer"
  methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
  # The control plane; pushes and pulls go over the bulk port (transport/bulk_wire.py).
  assert methods == {
    "Register": (False, False),
    "Heartbeat": (False, False),
    "Leave": (False, False),
    "Status": (False, False),
    "Rounds": (False, True),
    "Recover": (True, False),
  }


def test_messages_carry_the_agreed_fields():
  from ddiloco.transport.proto import syncer_pb2

  def fields(msg):
    return set(msg.DESCRIPTOR.fields_by_name)

  assert {"learner_id", "layout_digest", "num_devices", "batch_size"} <= fields(
    syncer_pb2.RegisterRequest
  )
  assert {"learner_id", "versions", "fleet_step"} <= fields(syncer_pb2.RegisterResponse)
  assert syncer_pb2.RegisterResponse.DESCRIPTOR.fields_by_name["versions"].is_repeated
  assert {
    "learner_id",
    "fragment",
    "anchor_version",
    "tokens",
    "steps",
    "step",
    "step_time_s",
    "codec",
    "total_bytes",
    "num_chunks",
    "new_tokens",
    "round_step",
  } <= fields(syncer_pb2.PushHeader)
  assert syncer_pb2.PushHeader.DESCRIPTOR.fields_by_name["round_step"].number == 13
  assert fields(syncer_pb2.PushChunk) == {"header", "index", "data"}
  assert fields(syncer_pb2.PushResponse) == {
    "status",
    "reason",
    "weight",
    "fleet_step",
    "round_version",
  }
  assert "merged_steps" in fields(syncer_pb2.HeartbeatResponse)
  assert syncer_pb2.HeartbeatResponse.DESCRIPTOR.fields_by_name["merged_steps"].is_repeated
  assert fields(syncer_pb2.PullRequest) == {"learner_id", "fragment", "known_version"}
  assert {"fragment", "version", "digest", "codec", "total_bytes", "num_chunks"} <= fields(
    syncer_pb2.FragmentHeader
  )
  assert fields(syncer_pb2.FragmentChunk) == {"header", "index", "data"}
  # A header round-trips through the binary protobuf encoding.
  chunk = syncer_pb2.PushChunk(header=syncer_pb2.PushHeader(fragment=3, tokens=7), index=0)
  back = syncer_pb2.PushChunk.FromString(chunk.SerializeToString())
  assert back.HasField("header") and back.header.fragment == 3 and back.header.tokens == 7
  assert not syncer_pb2.PushChunk(index=1).HasField("header")
  # The Rounds stream: a subscription by learner, then round requests or version announcements.
  assert fields(syncer_pb2.RoundsRequest) == {"learner_id"}
  assert fields(syncer_pb2.RoundOpen) == {"fragment", "round_step", "base_version"}
  assert fields(syncer_pb2.Published) == {"fragment", "version"}
  oneof = syncer_pb2.SyncerEvent.DESCRIPTOR.oneofs_by_name["event"]
  assert {f.name for f in oneof.fields} == {"round", "published"}
  event = syncer_pb2.SyncerEvent(
    round=syncer_pb2.RoundOpen(fragment=2, round_step=9, base_version=4)
  )
  back = syncer_pb2.SyncerEvent.FromString(event.SerializeToString())
  assert back.WhichOneof("event") == "round"
  assert (back.round.fragment, back.round.round_step, back.round.base_version) == (2, 9, 4)
