"""The fleet control channel: `ddiloco-fleet` asks a running `ddiloco-local` to add/remove learners.

Elastic scavenging (docs/algorithm.md §6: "extra learners may join mid-run and leave again") needs a way to
reach a launcher that is already running. This is a spool folder, `<workdir>/control/`, chosen
over a socket because it needs no port, no auth beyond file permissions (the workdir is the job's)
and survives either side crashing:

  launcher.json        {"pid", "started"}: written by the launcher while it serves, removed at exit.
  requests/<id>.json   one request, written to a dot-file and renamed in (atomic on POSIX).
  claimed/<id>.json    the launcher claims a request by renaming it here (so exactly one serves it).
  responses/<id>.json  the answer, also renamed in atomically: {"id", "ok", "result", "error"}.

The client (`FleetClient`) refuses at once when no live launcher owns the folder, and on a
timeout withdraws its request if it was not claimed yet (nothing happens then). The launcher
(`ControlServer`) polls from its progress loop, validates every request (`FleetRequest`) and
answers malformed ones itself; the cluster answers the rest (unknown learner, id in use...) with an
error and changes nothing.
Request ids sort by creation time, so requests are served in order.
"""

import contextlib
import dataclasses
import json
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

ACTIONS = ("add", "remove", "list")
MAX_DEVICES = 4096  # Far above any one learner's slice; catches typos such as --devices=20000.
# A graceful leave: the current step, a checkpoint save, flushing queued pushes (bounded by 30 s in
# LearnerWorker.finish) and the Leave RPC.
DEFAULT_REMOVE_TIMEOUT_S = 60.0
_LAUNCHER = "launcher.json"


class FleetError(RuntimeError):
  """A request failed: the launcher refused it, or no launcher answered."""


def _check_int(name: str, value: Any, *, low: int, high: int | None = None) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name} must be an integer, got {value!r}.")
  if value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be {bound}, got {value}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetRequest:
  """One control request.

  Attributes:
    id: unique, sortable by creation time (`new_request_id`).
    action: "add", "remove" or "list".
    learner_id: add: the id (None: the launcher picks a new one); remove: required.
    devices: add: fake CPU devices of the new learner (None: the job's devices_per_learner).
    batch_size: add: its per-step batch (None: the job's).
    steps: add: inner steps before it leaves on its own (None: the job's steps_per_learner).
    gin_bindings: add: extra gin bindings "KEY=VALUE" for this learner only.
    timeout_s: remove: seconds to wait for a graceful exit before SIGKILL (None: the launcher's).
  """

  id: str
  action: str
  learner_id: int | None = None
  devices: int | None = None
  batch_size: int | None = None
  steps: int | None = None
  gin_bindings: tuple[str, ...] = ()
  timeout_s: float | None = None

  def __post_init__(self):
    if not self.id or not all(c.isalnum() or c in "-_" for c in self.id):
      raise ValueError(f"request id must be non-empty [A-Za-z0-9_-], got {self.id!r}.")
    if self.action not in ACTIONS:
      raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {self.action!r}.")
    if self.learner_id is not None:
      _check_int("learner_id", self.learner_id, low=0)
    if self.devices is not None:
      _check_int("devices", self.devices, low=1, high=MAX_DEVICES)
    if self.batch_size is not None:
      _check_int("batch_size", self.batch_size, low=1)
    if self.steps is not None:
      _check_int("steps", self.steps, low=1)
    for b in self.gin_bindings:
      if not isinstance(b, str) or "=" not in b or "\n" in b:
        raise ValueError(f"gin bindings must be one-line 'KEY=VALUE' strings, got {b!r}.")
    if self.timeout_s is not None and (
      isinstance(self.timeout_s, bool)
      or not isinstance(self.timeout_s, int | float)
      or not 0 < self.timeout_s < float("inf")
    ):
      raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}.")
    if self.action == "remove" and self.learner_id is None:
      raise ValueError("remove needs a learner_id.")
    add_only = {"devices": self.devices, "batch_size": self.batch_size, "steps": self.steps}
    if self.action != "add" and (
      any(v is not None for v in add_only.values()) or self.gin_bindings
    ):
      raise ValueError(f"{self.action} takes no devices, batch_size, steps or gin bindings.")
    if self.action == "list" and (self.learner_id is not None or self.timeout_s is not None):
      raise ValueError("list takes no learner_id or timeout_s.")

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["gin_bindings"] = list(self.gin_bindings)
    return out

  @classmethod
  def from_json(cls, data: Any) -> "FleetRequest":
    """Parses and validates a request object.

    Raises:
      ValueError: if it is not an object, has unknown fields or a bad value.
    """
    if not isinstance(data, dict):
      raise ValueError(f"a request must be a JSON object, got {type(data).__name__}.")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
      raise ValueError(f"unknown request fields: {', '.join(unknown)}.")
    if "id" not in data or "action" not in data:
      raise ValueError("a request needs an id and an action.")
    bindings = data.get("gin_bindings", [])
    if not isinstance(bindings, list):
      raise ValueError(f"gin_bindings must be a list, got {bindings!r}.")
    return cls(**{**data, "gin_bindings": tuple(bindings)})


def new_request_id() -> str:
  """A unique id that sorts by creation time (nanoseconds, then pid and randomness)."""
  return f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"


def _write_atomic(path: str, obj: Any) -> None:
  folder, name = os.path.split(path)
  tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")  # Dot-files are never read.
  with open(tmp, "w") as f:
    json.dump(obj, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Someone else's process holds that pid: alive.
    return True
  return True


def control_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "control")


class ControlServer:
  """The launcher's side of the channel (see module docstring); one per workdir at a time.

  Args:
    workdir: the job's workdir (the channel lives in `<workdir>/control`).
  """

  def __init__(self, workdir: str):
    self.root = control_dir(workdir)
    self._pending: set[str] = set()  # Claimed, not yet answered.
    self._open = False

  def _path(self, sub: str, request_id: str = "") -> str:
    return os.path.join(self.root, sub, f"{request_id}.json" if request_id else "")

  def open(self) -> None:
    """Starts serving: creates the folders, announces this process, refuses leftover requests.

    Raises:
      RuntimeError: if another live launcher already serves this workdir.
    """
    for sub in ("requests", "claimed", "responses"):
      os.makedirs(self._path(sub), exist_ok=True)
    owner = read_launcher(self.root)
    if owner is not None and owner["pid"] != os.getpid() and _pid_alive(owner["pid"]):
      raise RuntimeError(f"launcher {owner['pid']} already serves {self.root}.")
    # Answers no client will read: their clients gave up when the previous launcher stopped.
    for name in os.listdir(self._path("responses")):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(self._path("responses"), name))
    # Requests claimed by a launcher that died, or queued while none ran, are stale: their clients
    # gave up (they refuse without a live launcher), so answer them rather than act on them late.
    for sub in ("claimed", "requests"):
      for name in sorted(os.listdir(self._path(sub))):
        if name.endswith(".json") and not name.startswith("."):
          rid = name[: -len(".json")]
          with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self._path(sub), name))
          self._write_response(rid, ok=False, error="stale request from before this launcher")
    _write_atomic(os.path.join(self.root, _LAUNCHER), {"pid": os.getpid(), "started": time.time()})
    self._open = True

  def poll(self) -> list[FleetRequest]:
    """Claims and returns the new valid requests, oldest first; answers invalid ones itself.

    Every returned request must be answered with `respond` (now or later).
    """
    if not self._open:
      raise RuntimeError("ControlServer.poll before open().")
    out = []
    names = sorted(os.listdir(self._path("requests")))
    for name in names:
      if not name.endswith(".json") or name.startswith("."):
        continue
      rid = name[: -len(".json")]
      claimed = self._path("claimed", rid)
      try:
        os.rename(os.path.join(self._path("requests"), name), claimed)
      except FileNotFoundError:  # Withdrawn by its client in the meantime.
        continue
      try:
        with open(claimed) as f:
          data = json.load(f)
        request = FleetRequest.from_json(data)
        if request.id != rid:
          raise ValueError(f"request id {request.id!r} does not match its file name {rid!r}.")
      except (ValueError, TypeError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError.
        self._pending.add(rid)
        self.respond(rid, ok=False, error=f"invalid request: {e}")
        continue
      self._pending.add(rid)
      out.append(request)
    return out

  def _write_response(
    self, request_id: str, *, ok: bool, result: Any = None, error: str = ""
  ) -> None:
    _write_atomic(
      self._path("responses", request_id),
      {"id": request_id, "ok": ok, "result": result, "error": error or None, "time": time.time()},
    )

  def respond(
    self, request_id: str, *, ok: bool, result: dict[str, Any] | None = None, error: str = ""
  ) -> None:
    """Answers a claimed request (`result` must be JSON-serialisable)."""
    self._write_response(request_id, ok=ok, result=result, error=error)
    self._pending.discard(request_id)
    with contextlib.suppress(FileNotFoundError):
      os.remove(self._path("claimed", request_id))

  @property
  def pending(self) -> frozenset[str]:
    return frozenset(self._pending)

  def close(self) -> None:
    """Answers pending and queued requests with an error, stops announcing this launcher.

    Idempotent.
    """
    for rid in sorted(self._pending):
      self.respond(rid, ok=False, error="the launcher stopped before it could finish this request")
    if self._open:
      for name in sorted(os.listdir(self._path("requests"))):
        if name.endswith(".json") and not name.startswith("."):
          with contextlib.suppress(FileNotFoundError):  # Withdrawn meanwhile.
            os.remove(os.path.join(self._path("requests"), name))
            self._write_response(
              name[: -len(".json")], ok=False, error="the launcher stopped (the job ended)"
            )
      owner = read_launcher(self.root)
      if owner is not None and owner["pid"] == os.getpid():
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(self.root, _LAUNCHER))
    self._open = False

  def __enter__(self) -> "ControlServer":
    self.open()
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_launcher(root: str) -> dict[str, Any] | None:
  """The launcher record in control folder `root`; None if there is none or it is unreadable."""
  try:
    with open(os.path.join(root, _LAUNCHER)) as f:
      data = json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None
  return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


class FleetClient:
  """`ddiloco-fleet`'s side of the channel.

  Args:
    workdir: the running job's workdir.
    timeout_s: how long to wait for an answer (a remove also waits `timeout_s` of its own on top).
    poll_s: seconds between looks at the response folder.
  """

  def __init__(self, workdir: str, *, timeout_s: float = 60.0, poll_s: float = 0.1):
    if timeout_s <= 0 or poll_s <= 0:
      raise ValueError("timeout_s and poll_s must be > 0.")
    self.root = control_dir(workdir)
    self.timeout_s = timeout_s
    self.poll_s = poll_s

  def _launcher_pid(self) -> int:
    owner = read_launcher(self.root)
    if owner is None or not _pid_alive(owner["pid"]):
      raise FleetError(
        f"no ddiloco-local launcher is running with this workdir ({os.path.dirname(self.root)})."
      )
    return owner["pid"]

  def _serving(self, pid: int) -> bool:
    """Whether launcher `pid` still serves (it may stop serving and live on: a library caller)."""
    owner = read_launcher(self.root)
    return owner is not None and owner["pid"] == pid and _pid_alive(pid)

  def request(self, action: str, **fields: Any) -> dict[str, Any]:
    """Sends one request and waits for its answer.

    Returns:
      The launcher's result object.

    Raises:
      ValueError: if the request is malformed (nothing is sent).
      FleetError: if no launcher runs, the launcher refused the request, or no answer came in time.
    """
    request = FleetRequest(id=new_request_id(), action=action, **fields)
    pid = self._launcher_pid()
    path = os.path.join(self.root, "requests", f"{request.id}.json")
    _write_atomic(path, request.to_json())
    response_path = os.path.join(self.root, "responses", f"{request.id}.json")
    wait_s = self.timeout_s + (request.timeout_s or 0.0)
    deadline = time.monotonic() + wait_s
    while True:
      if os.path.exists(response_path):
        with open(response_path) as f:
          response = json.load(f)
        os.remove(response_path)
        if not response["ok"]:
          raise FleetError(response["error"])
        return response["result"] or {}
      launcher_gone = not self._serving(pid)
      if launcher_gone or time.monotonic() > deadline:
        try:
          os.remove(path)  # Withdrawn: the launcher never saw it, so nothing happened.
        except FileNotFoundError:
          if not launcher_gone and os.path.exists(response_path):
            continue  # Answered just now.
          raise FleetError(
            f"the launcher took the {action} request but "
            + ("stopped before answering." if launcher_gone else f"did not answer in {wait_s} s.")
          ) from None
        why = "stopped" if launcher_gone else f"did not pick it up in {wait_s} s"
        raise FleetError(
          f"the launcher {why}; the {action} request was withdrawn, nothing changed."
        )
      time.sleep(self.poll_s)

  def add(
    self,
    *,
    learner_id: int | None = None,
    devices: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    gin_bindings: Sequence[str] = (),
  ) -> dict[str, Any]:
    """Adds a learner; returns {"learner_id", "devices", "batch_size", "steps", ...}."""
    return self.request(
      "add",
      learner_id=learner_id,
      devices=devices,
      batch_size=batch_size,
      steps=steps,
      gin_bindings=tuple(gin_bindings),
    )

  def remove(
    self, learner_id: int, *, timeout_s: float = DEFAULT_REMOVE_TIMEOUT_S
  ) -> dict[str, Any]:
    """Removes a learner gracefully; returns {"learner_id", "exit_code", "graceful", ...}."""
    return self.request("remove", learner_id=learner_id, timeout_s=timeout_s)

  def list(self) -> dict[str, Any]:
    """The fleet: {"learners": [...], "syncer_alive": [...] or None, "membership": [...]}."""
    return self.request("list")


def _format_list(result: dict[str, Any]) -> str:
  lines = [f"{'id':>4} {'state':<9} {'devices':>7} {'batch':>5} {'steps':>7} {'step':>6}  loss"]
  for m in result["learners"]:
    loss = "-" if m["loss"] is None else f"{m['loss']:.3f}"
    lines.append(
      f"{m['learner_id']:>4} {m['state']:<9} {m['devices']:>7} {m['batch_size'] or 'job':>5} "
      f"{m['steps'] or 'job':>7} {m['step'] if m['step'] is not None else '-':>6}  {loss}"
      + ("  (added)" if m["elastic"] else "")
    )
  alive = result["syncer_alive"]
  lines.append(f"syncer alive: {'unreachable' if alive is None else alive}")
  for e in result["membership"]:
    extra = {k: v for k, v in e.items() if k not in ("t", "time", "event", "learner_id")}
    lines.append(f"  t={e['t']:8.1f}s {e['event']:<6} learner {e['learner_id']} {extra}")
  return "\n".join(lines)


def format_answer(action: str, result: dict[str, Any]) -> str:
  """A `FleetClient` answer as the lines `ddiloco-fleet` prints."""
  if action == "list":
    return _format_list(result)
  if action == "add":
    r = result
    return (
      f"added learner {r['learner_id']}: {r['devices']} device(s), batch {r['batch_size']}, "
      f"{r['steps']} steps, data shard {r['data_shard']}; log {r['log']}"
    )
  how = "left gracefully" if result["graceful"] else "did not leave gracefully"
  if result["forced"]:
    how += " (SIGKILLed after the timeout; the syncer drops it after its liveness timeout)"
  text = f"removed learner {result['learner_id']}: {how}, exit code {result['exit_code']}"
  if result["graceful"]:
    text += f", {result['steps']} steps, pushes {result['push_status']}"
  if "syncer_alive" in result:
    text += f"; the syncer lists alive: {result['syncer_alive']}"
  return text
