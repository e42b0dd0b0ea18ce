"""The ddiloco-fleet control channel (launch/fleet.py) and how LocalCluster serves its requests.

No process is started here: the launcher side is a `ControlServer` in this process (or a
`LocalCluster` whose syncer port is set by hand), the command side a `FleetClient` in a thread.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import pytest

from ddiloco.launch import elastic, fleet, local_cluster

pytestmark = pytest.mark.timeout(60)


def _rid(n: int = 0) -> str:
  return f"{n:020d}-1-abcd"


# -- requests --------------------------------------------------------------------------------------


def test_request_round_trips_through_json():
  r = fleet.FleetRequest(
    id=_rid(), action="add", devices=2, batch_size=4, steps=10, gin_bindings=("A.b = 1",)
  )
  assert fleet.FleetRequest.from_json(json.loads(json.dumps(r.to_json()))) == r


@pytest.mark.parametrize(
  ("fields", "match"),
  [
    ({"action": "grow"}, "action must be one of"),
    ({"action": "add", "devices": 0}, r"devices must be in \[1, 4096\], got 0"),
    ({"action": "add", "devices": True}, "devices must be an integer"),
    ({"action": "add", "batch_size": 2.5}, "batch_size must be an integer"),
    ({"action": "add", "steps": -1}, "steps must be >= 1"),
    ({"action": "add", "learner_id": -3}, "learner_id must be >= 0"),
    ({"action": "add", "gin_bindings": ("no equals sign",)}, "KEY=VALUE"),
    ({"action": "remove"}, "remove needs a learner_id"),
    ({"action": "remove", "learner_id": 1, "timeout_s": 0}, "timeout_s must be a positive"),
    ({"action": "remove", "learner_id": 1, "devices": 2}, "remove takes no devices"),
    ({"action": "list", "learner_id": 1}, "list takes no learner_id"),
    ({"action": "list", "id": "../evil"}, "request id must be"),
  ],
)
def test_bad_requests_are_refused(fields, match):
  with pytest.raises(ValueError, match=match):
    fleet.FleetRequest(**{"id": _rid(), **fields})


@pytest.mark.parametrize(
  ("data", "match"),
  [
    ([1, 2], "must be a JSON object"),
    ({"id": _rid(), "action": "list", "force": True}, "unknown request fields: force"),
    ({"action": "list"}, "needs an id and an action"),
    ({"id": _rid(), "action": "add", "gin_bindings": "A.b=1"}, "gin_bindings must be a list"),
  ],
)
def test_from_json_refuses_malformed_objects(data, match):
  with pytest.raises(ValueError, match=match):
    fleet.FleetRequest.from_json(data)


def test_request_ids_sort_by_creation_time():
  ids = [fleet.new_request_id() for _ in range(5)]
  assert ids == sorted(ids) and len(set(ids)) == 5


# -- client and server -----------------------------------------------------------------------------


def _files(root, sub):
  return sorted(os.listdir(os.path.join(root, sub)))


def test_client_fails_fast_without_a_launcher(tmp_path):
  client = fleet.FleetClient(str(tmp_path), timeout_s=30)
  t = time.monotonic()
  with pytest.raises(fleet.FleetError, match="no ddiloco-local launcher is running"):
    client.list()
  assert time.monotonic() - t < 5  # Not the 30 s timeout: it did not wait for an answer.
  assert not os.path.exists(os.path.join(tmp_path, "control", "requests"))


@pytest.mark.integration
def test_client_fails_fast_when_the_launcher_died(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  root = fleet.control_dir(str(tmp_path))
  os.makedirs(root)
  with open(os.path.join(root, "launcher.json"), "w") as f:
    json.dump({"pid": dead.pid, "started": 0.0}, f)
  with pytest.raises(fleet.FleetError, match="no ddiloco-local launcher is running"):
    fleet.FleetClient(str(tmp_path)).list()


def test_round_trip_add_and_error(tmp_path):
  client = fleet.FleetClient(str(tmp_path), timeout_s=20, poll_s=0.02)
  with fleet.ControlServer(str(tmp_path)) as server, concurrent.futures.ThreadPoolExecutor(2) as ex:
    added = ex.submit(client.add, devices=2, batch_size=4, steps=7, gin_bindings=["X.y = 3"])
    removed = ex.submit(client.remove, 9, timeout_s=5.0)
    requests = []
    deadline = time.monotonic() + 10
    while len(requests) < 2 and time.monotonic() < deadline:
      requests += server.poll()
      time.sleep(0.02)
    by_action = {r.action: r for r in requests}
    assert set(by_action) == {"add", "remove"}
    add = by_action["add"]
    assert (add.devices, add.batch_size, add.steps, add.learner_id) == (2, 4, 7, None)
    assert add.gin_bindings == ("X.y = 3",)
    assert by_action["remove"].learner_id == 9 and by_action["remove"].timeout_s == 5.0
    assert server.pending == {add.id, by_action["remove"].id}
    server.respond(add.id, ok=True, result={"learner_id": 4})
    server.respond(by_action["remove"].id, ok=False, error="learner 9 is not in the fleet")
    assert added.result(timeout=10) == {"learner_id": 4}
    with pytest.raises(fleet.FleetError, match="learner 9 is not in the fleet"):
      removed.result(timeout=10)
    assert server.pending == frozenset()
  root = fleet.control_dir(str(tmp_path))
  # Everything was consumed: no request, claim or response is left, and the launcher is gone.
  assert _files(root, "requests") == _files(root, "claimed") == _files(root, "responses") == []
  assert not os.path.exists(os.path.join(root, "launcher.json"))


def test_unanswered_request_is_withdrawn_on_timeout(tmp_path):
  with fleet.ControlServer(str(tmp_path)) as server:
    client = fleet.FleetClient(str(tmp_path), timeout_s=0.3, poll_s=0.02)
    with pytest.raises(fleet.FleetError, match="withdrawn, nothing changed"):
      client.list()
    assert server.poll() == []  # The launcher never sees it.
  assert _files(fleet.control_dir(str(tmp_path)), "requests") == []


def test_claimed_but_unanswered_request_times_out(tmp_path):
  with fleet.ControlServer(str(tmp_path)) as server, concurrent.futures.ThreadPoolExecutor(1) as ex:
    client = fleet.FleetClient(str(tmp_path), timeout_s=1.0, poll_s=0.02)
    pending = ex.submit(client.list)
    deadline = time.monotonic() + 10
    while not server.poll() and time.monotonic() < deadline:
      time.sleep(0.02)
    with pytest.raises(fleet.FleetError, match="took the list request but did not answer"):
      pending.result(timeout=10)


def _write_request(tmp_path, rid, body):
  path = os.path.join(fleet.control_dir(str(tmp_path)), "requests", f"{rid}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(body)


def _response(tmp_path, rid):
  with open(os.path.join(fleet.control_dir(str(tmp_path)), "responses", f"{rid}.json")) as f:
    return json.load(f)


def test_server_answers_invalid_files_itself_and_serves_in_order(tmp_path):
  with fleet.ControlServer(str(tmp_path)) as server:
    _write_request(tmp_path, _rid(3), json.dumps({"id": _rid(3), "action": "list"}))
    _write_request(tmp_path, _rid(1), "{not json")
    _write_request(tmp_path, _rid(2), json.dumps({"id": _rid(2), "action": "add", "steps": 0}))
    _write_request(tmp_path, _rid(4), json.dumps({"id": _rid(5), "action": "list"}))
    _write_request(tmp_path, _rid(0), json.dumps({"id": _rid(0), "action": "list"}))
    got = server.poll()
    assert [r.id for r in got] == [_rid(0), _rid(3)]  # Oldest first; the invalid ones answered.
    assert server.pending == {_rid(0), _rid(3)}
    for n, match in ((1, "invalid request"), (2, "steps must be >= 1"), (4, "does not match")):
      response = _response(tmp_path, _rid(n))
      assert response["ok"] is False and match in response["error"], response
    server.close()  # Still-pending requests get an answer rather than hanging their clients.
    for n in (0, 3):
      assert "launcher stopped" in _response(tmp_path, _rid(n))["error"]


@pytest.mark.integration
def test_open_refuses_leftover_requests_and_a_second_launcher(tmp_path):
  _write_request(tmp_path, _rid(7), json.dumps({"id": _rid(7), "action": "list"}))
  root = fleet.control_dir(str(tmp_path))
  os.makedirs(os.path.join(root, "responses"))
  with open(os.path.join(root, "responses", f"{_rid(6)}.json"), "w") as f:
    f.write("{}")  # An answer nobody read: removed.
  with fleet.ControlServer(str(tmp_path)) as server:
    assert server.poll() == []
    assert "stale request" in _response(tmp_path, _rid(7))["error"]
    assert _files(root, "responses") == [f"{_rid(7)}.json"]
  other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    with open(os.path.join(root, "launcher.json"), "w") as f:
      json.dump({"pid": other.pid, "started": 0.0}, f)
    with pytest.raises(RuntimeError, match=f"launcher {other.pid} already serves"):
      fleet.ControlServer(str(tmp_path)).open()
  finally:
    other.kill()
    other.wait()


# -- LocalCluster serving requests (no process is started) -----------------------------------------


class _FakeStatus:
  alive = (0, 1)


class _FakeClient:
  def status(self):
    return _FakeStatus()


def _cluster(tmp_path):
  cluster = local_cluster.LocalCluster(
    workdir=str(tmp_path), gin_args=[], num_learners=2, devices_per_learner=1
  )
  cluster.port = 1  # As if the syncer served: add_learner's first check passes.
  return cluster


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"devices": 2, "batch_size": 3}, "batch_size 3 does not split over 2 devices"),
    ({"devices": 0}, "devices must be an integer >= 1"),
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"learner_id": -1}, "learner_id must be an integer >= 0"),
    ({"learner_id": 1}, r"learner 1 is already in the fleet \(running\)"),
  ],
)
def test_add_learner_refuses_bad_requests_and_starts_nothing(tmp_path, kwargs, match):
  cluster = _cluster(tmp_path)
  cluster.fleet.members[1] = elastic.FleetMember(
    learner_id=1, devices=1, batch_size=None, steps=None, elastic=False, started=0.0
  )
  with pytest.raises(ValueError, match=match):
    cluster.add_learner(**kwargs)
  assert cluster.learners == {} and cluster.fleet.membership == []


def test_add_learner_needs_a_syncer(tmp_path):
  cluster = _cluster(tmp_path)
  cluster.port = None
  with pytest.raises(RuntimeError, match="Start the syncer"):
    cluster.add_learner()


def test_next_learner_id_skips_used_ids_and_folders(tmp_path):
  cluster = _cluster(tmp_path)
  assert cluster.fleet.next_learner_id() == 2  # M = 2: ids 0 and 1 are the job's.
  os.makedirs(os.path.join(tmp_path, "learner_2"))  # Another learner's checkpoints live there.
  assert cluster.fleet.next_learner_id() == 3
  cluster.fleet.members[5] = elastic.FleetMember(
    learner_id=5, devices=1, batch_size=None, steps=None, elastic=True, started=0.0
  )
  assert cluster.fleet.next_learner_id() == 6


def test_cluster_answers_requests_through_the_channel(tmp_path):
  cluster = _cluster(tmp_path)
  client = fleet.FleetClient(str(tmp_path), timeout_s=20, poll_s=0.02)
  with fleet.ControlServer(str(tmp_path)) as server, concurrent.futures.ThreadPoolExecutor(1) as ex:
    cluster.control = server

    def serve(call):
      future = ex.submit(call)
      deadline = time.monotonic() + 10
      while not future.done() and time.monotonic() < deadline:
        for request in server.poll():
          cluster._serve_request(request, _FakeClient(), progress=None)
        time.sleep(0.02)
      return future.result(timeout=1)

    listed = serve(client.list)
    assert listed == {"learners": [], "syncer_alive": [0, 1], "membership": []}
    with pytest.raises(fleet.FleetError, match="learner 4 is not in the fleet"):
      serve(lambda: client.remove(4))
    with pytest.raises(fleet.FleetError, match="does not split over 2 devices"):
      serve(lambda: client.add(devices=2, batch_size=5))
  assert cluster.learners == {} and cluster.fleet.membership == []  # Nothing was started.


def test_close_answers_queued_requests_and_clients_stop_waiting(tmp_path):
  server = fleet.ControlServer(str(tmp_path))
  server.open()
  _write_request(tmp_path, _rid(8), json.dumps({"id": _rid(8), "action": "list"}))
  server.close()  # Never polled: answered anyway.
  assert _response(tmp_path, _rid(8))["error"] == "the launcher stopped (the job ended)"
  # A launcher that stopped serving but lives on (a library caller of LocalCluster.run): refused.
  with pytest.raises(fleet.FleetError, match="no ddiloco-local launcher is running"):
    fleet.FleetClient(str(tmp_path), timeout_s=30).list()


def test_fleet_main_formats_answers():
  listed = {
    "learners": [
      {"learner_id": 0, "state": "running", "devices": 1, "batch_size": None, "steps": None,
       "step": 16, "loss": 2.5, "elastic": False},
      {"learner_id": 2, "state": "removed", "devices": 2, "batch_size": 4, "steps": 900,
       "step": None, "loss": None, "elastic": True},
    ],
    "syncer_alive": [0],
    "membership": [{"t": 1.5, "time": 0.0, "event": "join", "learner_id": 2, "devices": 2}],
  }  # fmt: skip
  lines = fleet.format_answer("list", listed).splitlines()
  assert lines[1].split() == ["0", "running", "1", "job", "job", "16", "2.500"]
  assert lines[2].split() == ["2", "removed", "2", "4", "900", "-", "-", "(added)"]
  assert lines[3] == "syncer alive: [0]"
  assert lines[4].split()[:4] == ["t=", "1.5s", "join", "learner"]
  removed = {
    "learner_id": 2,
    "exit_code": -9,
    "graceful": False,
    "forced": True,
    "syncer_alive": [0, 2],
  }
  text = fleet.format_answer("remove", removed)
  assert "SIGKILLed after the timeout" in text and "exit code -9" in text and "[0, 2]" in text
