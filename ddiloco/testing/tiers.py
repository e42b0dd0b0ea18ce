"""The test tiers, as a pytest plugin: markers, and the guard that keeps the fast tier in-process.

A test is in exactly one tier:
- `fast` (the default: every test not marked otherwise): in one process, no real socket, no
  subprocess, no simulation beyond a few steps. The default command runs it.
- `integration`: real sockets, gRPC servers, subprocesses, short multi-process and Ray runs of the
  launchers, and simulated runs of a fleet over many steps (`pytest -m integration`).
- `e2e`: whole jobs at length: chaos runs, multi-process learners, shard restarts, the notebook
  (`pytest -m e2e`, scripts/run_e2e_tests.sh).

Mark a module with `pytestmark = pytest.mark.integration` (or `e2e`), or a test with the decorator.
In the fast tier, binding or connecting a real socket (`AF_INET`, `AF_INET6`, `AF_UNIX`), opening a
gRPC server port, creating a gRPC channel, or starting a process (`subprocess`, `multiprocessing`,
`os.fork`, `os.posix_spawn`, `os.system`) raises `FastTierViolation` at once, naming the markers;
a violation that the code under test swallowed (in a thread, or a broad `except`) still fails the
test when its phase ends. A test marked with two tiers stops the run at collection.
tests/conftest.py loads this plugin.
"""

import _posixsubprocess
import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

FAST = "fast"
INTEGRATION = "integration"
E2E = "e2e"
TIERS = (FAST, INTEGRATION, E2E)

_HINT = (
  "the fast tier runs in one process: mark the test (or its module, `pytestmark = ...`) "
  "`pytest.mark.integration` (real sockets, gRPC servers, subprocesses, multi-process and Ray "
  "runs) or `pytest.mark.e2e` (whole jobs at length: chaos runs, the notebook, long runs)"
)
_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)
_MISSING = object()


class FastTierViolation(BaseException):
  """A fast-tier test opened a real socket or started a process.

  A BaseException, so that the code under test's `except Exception` or `except OSError` (a retry
  loop, a reconnecting client) cannot turn the refusal into a slow test.
  """


def _refuser(violations: list[str], what: Callable[..., str]) -> Callable[..., Any]:
  def refuse(*args, **kwargs):
    message = f"{what(*args, **kwargs)}: {_HINT}"
    violations.append(message)
    raise FastTierViolation(message)

  return refuse


def _socket_call(violations: list[str], verb: str, original: Callable[..., Any]):
  refuse = _refuser(violations, lambda sock, address: f"{verb} a real socket ({address!r})")

  def call(sock, address, *args):
    if sock.family in _FAMILIES:
      refuse(sock, address)
    return original(sock, address, *args)

  return call


def _patches(violations: list[str]) -> list[tuple[Any, str, Callable[..., Any]]]:
  """(owner, attribute, replacement) for every way a test could leave the process."""
  import grpc
  import grpc._server
  import grpc.aio._server

  def started(kind: str) -> Callable[..., Any]:
    return _refuser(violations, lambda *args, **kwargs: f"started a process ({kind})")

  grpc_port = _refuser(violations, lambda server, address, *a: f"opened a gRPC port ({address!r})")
  grpc_channel = _refuser(violations, lambda target, *a, **k: f"opened a gRPC channel ({target!r})")
  out = [
    (socket.socket, name, _socket_call(violations, verb, getattr(socket.socket, name)))
    for name, verb in (("bind", "bound"), ("connect", "connected"), ("connect_ex", "connected"))
  ]
  out += [
    (subprocess.Popen, "_execute_child", started("subprocess.Popen")),
    (_posixsubprocess, "fork_exec", started("a multiprocessing spawn")),
    (os, "fork", started("os.fork")),
    (os, "forkpty", started("os.forkpty")),
    (os, "posix_spawn", started("os.posix_spawn")),
    (os, "posix_spawnp", started("os.posix_spawnp")),
    (os, "system", started("os.system")),
    (grpc._server._Server, "add_insecure_port", grpc_port),
    (grpc._server._Server, "add_secure_port", grpc_port),
    (grpc.aio._server.Server, "add_insecure_port", grpc_port),
    (grpc.aio._server.Server, "add_secure_port", grpc_port),
    (grpc, "insecure_channel", grpc_channel),
    (grpc, "secure_channel", grpc_channel),
  ]
  return out


@contextlib.contextmanager
def guard() -> Iterator[list[str]]:
  """Refuses real sockets and processes while open; yields the list of refusals made."""
  violations: list[str] = []
  patches = _patches(violations)
  saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
  try:
    for owner, name, replacement in patches:
      setattr(owner, name, replacement)
    yield violations
  finally:
    for owner, name, original in reversed(saved):
      if original is _MISSING:
        delattr(owner, name)
      else:
        setattr(owner, name, original)


def tier(item: pytest.Item) -> str:
  """The tier of a collected test: the one it (or its module or class) is marked with, else fast."""
  named = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
  if len(named) > 1:
    raise pytest.UsageError(
      f"{item.nodeid} is marked {' and '.join(sorted(named))}: one tier a test"
    )
  return named.pop() if named else FAST


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Marks every test that names no tier `fast`, before `-m` selects (hence tryfirst)."""
  for item in items:
    if tier(item) == FAST:
      item.add_marker(FAST)


def _guarded(item: pytest.Item):
  if tier(item) != FAST:
    return (yield)
  with guard() as violations:
    try:
      result = yield
    except FastTierViolation:
      raise
    except BaseException as e:
      if violations:
        raise FastTierViolation(violations[0]) from e
      raise
  if violations:  # Refused in a thread or swallowed by the code under test.
    raise FastTierViolation(violations[0])
  return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
  return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
  return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
  return (yield from _guarded(item))
