"""The test tiers (ddiloco/testing/tiers.py): markers, and the fast tier's guard against real sockets
and processes.

These tests run in the fast tier, under the guard that tests/conftest.py installs; each one opens
its own guard inside it, which refuses first, so nothing real is opened and the outer guard never
sees a call. The plugin's hooks are checked in an in-process pytest run (`pytester`).
"""

import concurrent.futures
import fnmatch
import multiprocessing
import os
import socket
import subprocess
import sys

import grpc
import grpc._server
import pytest

from ddiloco.testing import tiers

HINT = "pytest.mark.integration"


def _refused(call, what: str) -> None:
  """`call` is refused at once, naming the markers; the guard lists the refusal."""
  with tiers.guard() as violations, pytest.raises(tiers.FastTierViolation, match=HINT) as info:
    call()
  assert what in str(info.value)
  assert "pytest.mark.e2e" in str(info.value)
  assert violations == [str(info.value)]


@pytest.mark.parametrize(
  ("family", "address"),
  [(socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_INET6, ("::1", 0))],
  ids=["inet", "inet6"],
)
@pytest.mark.parametrize("verb", ["bind", "connect", "connect_ex"])
def test_a_real_socket_is_refused(family, address, verb):
  with socket.socket(family, socket.SOCK_STREAM) as sock:
    what = "bound" if verb == "bind" else "connected"
    _refused(lambda: getattr(sock, verb)(address), f"{what} a real socket")


def test_a_unix_socket_is_refused(tmp_path):
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    _refused(lambda: sock.bind(str(tmp_path / "sock")), "bound a real socket")
  assert not (tmp_path / "sock").exists()


def test_a_socket_pair_stays_allowed():
  """No address, no network: asyncio's event loops wake themselves through one."""
  with tiers.guard() as violations:
    a, b = socket.socketpair()
    with a, b:
      a.sendall(b"x")
      assert b.recv(1) == b"x"
  assert violations == []


def test_a_grpc_server_port_is_refused():
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    server = grpc.server(pool)
    _refused(lambda: server.add_insecure_port("127.0.0.1:0"), "opened a gRPC port")
    server.stop(grace=None)


def test_a_grpc_channel_is_refused():
  _refused(lambda: grpc.insecure_channel("127.0.0.1:1"), "opened a gRPC channel")


@pytest.mark.parametrize(
  "start",
  [
    lambda: subprocess.run([sys.executable, "-c", "pass"], timeout=10, check=True),
    lambda: subprocess.Popen([sys.executable, "-c", "pass"]).wait(timeout=10),
    lambda: subprocess.check_output(["true"], timeout=10),
    lambda: os.system("true"),
    lambda: os.posix_spawn("/bin/true", ["true"], os.environ),
  ],
  ids=["run", "Popen", "check_output", "os.system", "posix_spawn"],
)
def test_a_subprocess_is_refused(start):
  _refused(start, "started a process")


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_multiprocessing_process_is_refused(method):
  context = multiprocessing.get_context(method)
  process = context.Process(target=print)
  # forkserver binds its server's unix socket before it starts it; either is refused.
  with tiers.guard() as violations, pytest.raises(tiers.FastTierViolation, match=HINT):
    process.start()
  assert len(violations) == 1
  assert "started a process" in violations[0] or "bound a real socket" in violations[0]


def test_the_guard_puts_everything_back():
  """Inside, each name is replaced; after, each is the very object it was."""
  names = [
    (socket.socket, "bind"),
    (subprocess.Popen, "_execute_child"),
    (os, "fork"),
    (grpc, "insecure_channel"),
    (grpc._server._Server, "add_insecure_port"),
  ]
  before = [vars(owner).get(name) for owner, name in names]
  with tiers.guard():
    inside = [vars(owner).get(name) for owner, name in names]
  assert all(a is not b for a, b in zip(inside, before))
  assert all(a is b for a, b in zip([vars(owner).get(name) for owner, name in names], before))


# -- the plugin, in a pytest run of its own ------------------------------------------------------

_INNER_TESTS = """
import socket
import threading

import pytest


def test_opens_a_socket():
  with socket.socket() as sock:
    try:
      sock.connect(("127.0.0.1", 9))
    except OSError:  # A retry loop's handler does not hide the refusal.
      pass


def test_a_thread_swallows_the_refusal():
  def connect():
    try:
      with socket.socket() as sock:
        sock.connect(("127.0.0.1", 9))
    except BaseException:
      pass

  thread = threading.Thread(target=connect)
  thread.start()
  thread.join(timeout=10)


def test_in_process():
  assert sum(range(4)) == 6


@pytest.mark.integration
def test_marked_integration():
  pass


@pytest.mark.e2e
def test_marked_e2e():
  pass
"""


def _run_inner(pytester, *args):
  pytester.makepyfile(inner_test=_INNER_TESTS)
  plugins = ("-p", "ddiloco.testing.tiers", "-p", "no:cacheprovider", "-p", "no:xdist")
  return pytester.runpytest_inprocess(*plugins, "--import-mode=importlib", *args)


def test_the_fast_tier_refuses_and_names_the_marker(pytester):
  result = _run_inner(pytester, "-m", "fast")
  result.assert_outcomes(passed=1, failed=2, deselected=2)
  result.stdout.fnmatch_lines(
    [
      "*FAILED inner_test.py::test_opens_a_socket*",
      "*FAILED inner_test.py::test_a_thread_swallows*",
    ]
  )
  refusal = (
    "E *.FastTierViolation: connected a real socket (('127.0.0.1', 9)): "
    "the fast tier runs in one process: mark the test *pytest.mark.integration*"
  )
  assert len([line for line in result.outlines if fnmatch.fnmatch(line, refusal)]) == 2


@pytest.mark.parametrize(
  ("tier", "test"), [("integration", "test_marked_integration"), ("e2e", "test_marked_e2e")]
)
def test_a_tier_marker_selects_its_tests(pytester, tier, test):
  result = _run_inner(pytester, "-m", tier, "-v")
  result.assert_outcomes(passed=1, deselected=4)
  result.stdout.fnmatch_lines([f"*inner_test.py::{test} PASSED*"])


def test_a_test_in_two_tiers_is_refused_at_collection(pytester):
  pytester.makepyfile(
    inner_test="""
import pytest

pytestmark = pytest.mark.integration


@pytest.mark.e2e
def test_both():
  pass
"""
  )
  result = pytester.runpytest_inprocess("-p", "ddiloco.testing.tiers", "-p", "no:xdist")
  assert result.ret == pytest.ExitCode.USAGE_ERROR
  result.stderr.fnmatch_lines(["*test_both is marked e2e and integration: one tier a test*"])
