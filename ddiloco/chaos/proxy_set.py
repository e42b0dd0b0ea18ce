"""`ProxySet`: chaos proxies in front of every port of every syncer shard, and network faults on one
shard's or on all.

Learners must reach every shard of a sharded syncer, on both of its ports, through a proxy, or a
network fault would spare the traffic that goes around it: the control plane (gRPC) and the data
plane (the bulk port, every push and pull) each get one. A chaos run therefore starts two proxies
per shard (S = 1 for an unsharded syncer), each forwarding to one port, and has every shard
advertise the proxies: the control proxies' addresses as the shard map and its data proxy's port as
its bulk port (`LocalCluster.shard_addresses`, `bulk_ports`). A learner given control
proxy 0's address then learns the others from shard 0 and every shard's data proxy at its
registration, and talks to every port through its proxy. A fault with `shard=None` hits every
proxy (one after the other, within milliseconds), like a fault of the learners' own network; one
with a shard hits both of that shard's proxies only.
"""

import contextlib
import os
from collections.abc import Callable, Sequence

from ddiloco.chaos.proxy import FaultProxy
from ddiloco.chaos.proxy_process import ProxyProcess


def proxy_name(shard: int, *, bulk: bool) -> str:
  """The name of a shard's proxy (its log is `<name>.log`): proxy, proxy_bulk, proxy_1, ..."""
  return ("proxy_bulk" if bulk else "proxy") + (f"_{shard}" if shard else "")


def _proxy_process(log_dir: str) -> Callable[[str | int, str], FaultProxy]:
  def make(upstream: str | int, name: str) -> FaultProxy:
    return ProxyProcess(upstream, log_path=os.path.join(log_dir, f"{name}.log"))

  return make


class ProxySet:
  """The proxies in front of a syncer's shards: shard i's control proxy at `proxies[i]`, its data
  proxy at `bulk[i]`.

  Args:
    upstreams: each shard's gRPC 'host:port' (or port on 127.0.0.1), in shard order.
    bulk_upstreams: each shard's bulk port (or 'host:port'), in shard order.
    log_dir: where each proxy process writes its log (`proxy_name(...)`.log).
    make: builds a proxy from its upstream and its name (default: a `ProxyProcess` logging to
      `log_dir`); any `FaultProxy`, e.g. an in-process `LoopbackProxy`.
  """

  def __init__(
    self,
    upstreams: Sequence[str | int],
    bulk_upstreams: Sequence[str | int],
    *,
    log_dir: str = ".",
    make: Callable[[str | int, str], FaultProxy] | None = None,
  ):
    if not upstreams:
      raise ValueError("A ProxySet needs at least one upstream.")
    if len(bulk_upstreams) != len(upstreams):
      raise ValueError(
        f"Every shard has a bulk port: {len(upstreams)} upstreams, {len(bulk_upstreams)} bulk."
      )
    make = make or _proxy_process(log_dir)
    self.proxies: list[FaultProxy] = [
      make(u, proxy_name(i, bulk=False)) for i, u in enumerate(upstreams)
    ]
    self.bulk: list[FaultProxy] = [
      make(u, proxy_name(i, bulk=True)) for i, u in enumerate(bulk_upstreams)
    ]

  def __len__(self) -> int:
    return len(self.proxies)

  def start(self) -> list[str]:
    """Starts every proxy; returns the control proxies' addresses. On a failure, stops those
    started and raises."""
    started = []
    try:
      for p in [*self.proxies, *self.bulk]:
        p.start()
        started.append(p)
    except BaseException:
      for p in started:
        with contextlib.suppress(Exception):
          p.stop()
      raise
    return self.addresses

  def stop(self) -> None:
    """Stops every proxy (each resets its connections); the first error is raised after all."""
    errors = []
    for p in [*self.proxies, *self.bulk]:
      try:
        p.stop()
      except Exception as e:  # Stop the others anyway.
        errors.append(e)
    if errors:
      raise errors[0]

  @property
  def addresses(self) -> list[str]:
    """Each shard's control proxy address ('127.0.0.1:<port>'), in shard order: the shard map
    to advertise."""
    return [p.address for p in self.proxies]

  @property
  def address(self) -> str:
    """Shard 0's control proxy: the address learners are given."""
    return self.proxies[0].address

  @property
  def bulk_ports(self) -> list[int]:
    """Each shard's data proxy port, in shard order: the bulk port each shard advertises (on the
    host learners reach the control proxies on)."""
    return [p.port for p in self.bulk]

  def targets(self, shard: int | None) -> list[FaultProxy]:
    """The proxies a fault on `shard` hits: both of that shard's, or every one for None.

    Raises:
      ValueError: for a shard the syncer does not have.
    """
    if shard is None:
      return [*self.proxies, *self.bulk]
    if not 0 <= shard < len(self.proxies):
      raise ValueError(f"No syncer shard {shard}: the syncer has {len(self.proxies)}.")
    return [self.proxies[shard], self.bulk[shard]]

  def set_latency(self, seconds: float, *, shard: int | None = None) -> None:
    """`LoopbackProxy.set_latency` on the targeted proxies."""
    for p in self.targets(shard):
      p.set_latency(seconds)

  def drop(self, *, shard: int | None = None) -> int:
    """`LoopbackProxy.drop` on the targeted proxies; returns the connections reset."""
    return sum(p.drop() for p in self.targets(shard))

  def partition(
    self, duration_s: float | None = None, *, mode: str = "hold", shard: int | None = None
  ) -> None:
    """`LoopbackProxy.partition` on the targeted proxies."""
    for p in self.targets(shard):
      p.partition(duration_s, mode=mode)

  def heal(self, *, shard: int | None = None) -> None:
    """`LoopbackProxy.heal` on the targeted proxies."""
    for p in self.targets(shard):
      p.heal()
