"""`ProxyProcess`: the chaos `LoopbackProxy` in a child process, controlled over its stdin and stdout.

`ProxyProcess` runs the proxy of `ddiloco.chaos.proxy` in a child process of its own session, with
the same methods (sent over its stdin as JSON lines). The chaos driver uses it: the network must
not share a CPU share, a niceness or a GIL with the driver. Measured on 2 cores with the driver at autogroup nice 19
and the learners and syncer in their own sessions at nice 0, an in-driver proxy made a push take
0.43 s at the median instead of 0.03 s, and the merged fraction of a fault-free run fell from 0.80
to 0.27. The child exits when its stdin closes, so a killed driver leaves no proxy behind.

Run as `python -m ddiloco.chaos.proxy_process --upstream=HOST:PORT`, the module is that child.
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import select
import subprocess
import sys
import threading
import time
from typing import Any

from ddiloco.chaos.proxy import FaultProxy, LoopbackProxy, ProxyStats, parse_address

log = logging.getLogger(__name__)


class ProxyProcess(FaultProxy):
  """`LoopbackProxy` in a child process of its own session, with the same public methods.

  Control calls travel as JSON lines over the child's stdin and stdout, one at a time; the child
  exits when its stdin closes (`stop`, or the parent dying).

  Args:
    upstream: the syncer's 'host:port' (or a port on 127.0.0.1).
    listen_port: port to listen on (0: a free one, see `port` after `start`).
    control_timeout_s: how long a control call waits for the child's answer.
    log_path: where the child's stderr goes (None: this process's stderr).
    python: the interpreter that runs the child.
  """

  def __init__(
    self,
    upstream: str | int,
    *,
    listen_port: int = 0,
    control_timeout_s: float = 10.0,
    log_path: str | None = None,
    python: str = sys.executable,
  ):
    if control_timeout_s <= 0:
      raise ValueError("control_timeout_s must be > 0.")
    self._args = [
      python,
      "-m",
      __name__,
      "--upstream={}:{}".format(*parse_address(upstream)),
      f"--listen_port={listen_port}",
      f"--control_timeout_s={control_timeout_s}",
    ]
    self._timeout_s = control_timeout_s
    self._log_path = log_path
    self._proc: subprocess.Popen | None = None
    self._lock = threading.Lock()
    self.port = 0

  @property
  def pid(self) -> int | None:
    return None if self._proc is None else self._proc.pid

  def start(self) -> int:
    """Starts the child and waits until it listens; returns the port.

    Raises:
      RuntimeError: if already started, or if the child did not come up.
    """
    if self._proc is not None:
      raise RuntimeError("The proxy is already started.")
    with contextlib.ExitStack() as stack:
      log = stack.enter_context(open(self._log_path, "ab")) if self._log_path else None
      self._proc = subprocess.Popen(
        self._args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,  # Its own scheduling group, like the syncer and the learners.
        text=True,
        bufsize=1,
      )
    try:
      self.port = int(self._read()["port"])
    except BaseException:
      self._kill()
      raise
    return self.port

  def stop(self) -> None:
    """Resets every connection, ends the child and waits for it."""
    if self._proc is None:
      return
    try:
      with contextlib.suppress(OSError, ValueError):
        self._proc.stdin.close()  # The child stops on EOF.
      self._proc.wait(self._timeout_s)
    except subprocess.TimeoutExpired:
      self._kill()
    finally:
      self._proc = None

  def _kill(self) -> None:
    if self._proc is not None and self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait(self._timeout_s)

  def set_latency(self, seconds: float) -> None:
    """See `LoopbackProxy.set_latency`."""
    self._check_latency(seconds)
    self._call("set_latency", float(seconds))

  def drop(self) -> int:
    """See `LoopbackProxy.drop`."""
    return int(self._call("drop"))

  def partition(self, duration_s: float | None = None, *, mode: str = "hold") -> None:
    """See `LoopbackProxy.partition`."""
    self._check_partition(duration_s, mode)
    self._call("partition", duration_s, mode=mode)

  def heal(self) -> None:
    """See `LoopbackProxy.heal`."""
    self._call("heal")

  def set_upstream(self, upstream: str | int, *, reset: bool = True) -> None:
    """See `LoopbackProxy.set_upstream`."""
    self._call("set_upstream", "{}:{}".format(*parse_address(upstream)), reset=reset)

  def stats(self) -> ProxyStats:
    """A snapshot of the child's counters."""
    return ProxyStats(**self._call("stats"))

  @property
  def latency_s(self) -> float:
    return float(self._call("latency_s"))

  @property
  def partitioned(self) -> bool:
    return bool(self._call("partitioned"))

  @property
  def upstream(self) -> str:
    return str(self._call("upstream"))

  def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
    with self._lock:
      if self._proc is None:
        raise RuntimeError("The proxy is not started.")
      try:
        self._proc.stdin.write(json.dumps({"op": op, "args": args, "kwargs": kwargs}) + "\n")
        self._proc.stdin.flush()
      except (BrokenPipeError, ValueError) as e:
        raise RuntimeError(f"The proxy process has exited ({self._proc.poll()}).") from e
      answer = self._read()
    if "error" in answer:
      raise RuntimeError(f"The proxy refused {op}: {answer['error']}")
    return answer["result"]

  def _read(self) -> dict:
    """The child's next answer line, within the control timeout."""
    ready, _, _ = select.select([self._proc.stdout], [], [], self._timeout_s)
    line = self._proc.stdout.readline() if ready else ""
    if not line:
      code = self._proc.poll()
      raise RuntimeError(
        f"The proxy process did not answer within {self._timeout_s} s"
        + (f" (it exited with {code})." if code is not None else ".")
      )
    return json.loads(line)


_OPS = ("set_latency", "drop", "partition", "heal", "set_upstream")


def _serve_stdin(proxy: LoopbackProxy) -> None:
  """The child's side of `ProxyProcess`: one JSON answer line per command line, until EOF."""
  for line in sys.stdin:
    try:
      cmd = json.loads(line)
      op = cmd["op"]
      if op == "stats":
        result: Any = dataclasses.asdict(proxy.stats())
      elif op in ("latency_s", "partitioned", "upstream"):
        result = getattr(proxy, op)
      elif op in _OPS:
        result = getattr(proxy, op)(*cmd.get("args", ()), **cmd.get("kwargs", {}))
      else:
        raise ValueError(f"unknown operation {op!r}")
      answer = {"result": result}
    except Exception as e:  # Every failure goes back to the caller.
      answer = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
  """Runs one proxy (see `ProxyProcess`): prints {"port": N}, then serves commands until EOF."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--upstream", required=True)
  parser.add_argument("--listen_port", type=int, default=0)
  parser.add_argument("--control_timeout_s", type=float, default=10.0)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy: %(message)s")
  proxy = LoopbackProxy(
    args.upstream, listen_port=args.listen_port, control_timeout_s=args.control_timeout_s
  )
  proxy.start()
  t0 = time.monotonic()
  try:
    sys.stdout.write(json.dumps({"port": proxy.port}) + "\n")
    sys.stdout.flush()
    _serve_stdin(proxy)
  finally:
    proxy.stop()
    log.info("stopped after %.1f s: %s", time.monotonic() - t0, proxy.stats())


if __name__ == "__main__":
  main()
