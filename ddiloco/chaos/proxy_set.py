"""`ProxySet`: one chaos proxy per syncer shard, and network faults on one shard's or on all.

Learners must reach every shard of a sharded syncer through a proxy, or a network fault would spare
the traffic to the shards without one. A chaos run therefore starts S proxies (one for an unsharded
syncer), each forwarding to one shard, and has every shard advertise the proxies' addresses at
Register (`LocalCluster.shard_addresses`): a learner given proxy 0's address then learns the others'
from shard 0 and talks to every shard through its proxy. A fault with `shard=None` hits every proxy
(one after the other, within milliseconds), like a fault of the learners' own network; one with a
shard hits the connections to that shard only.
"""

import contextlib
import os
from collections.abc import Callable, Sequence

from ddiloco.chaos.proxy import FaultProxy
from ddiloco.chaos.proxy_process import ProxyProcess


def _proxy_process(log_dir: str) -> Callable[[str | int, int], FaultProxy]:
  def make(upstream: str | int, shard: int) -> FaultProxy:
    name = "proxy.log" if shard == 0 else f"proxy_{shard}.log"
    return ProxyProcess(upstream, log_path=os.path.join(log_dir, name))

  return make


class ProxySet:
  """The proxies in front of a syncer's shards, shard i's at index i.

  Args:
    upstreams: each shard's 'host:port' (or port on 127.0.0.1), in shard order.
    log_dir: where each proxy process writes its log (`proxy.log`, `proxy_<i>.log`).
    make: builds shard i's proxy from its upstream and i (default: a `ProxyProcess` logging to
      `log_dir`); any `FaultProxy`, e.g. an in-process `LoopbackProxy`.
  """

  def __init__(
    self,
    upstreams: Sequence[str | int],
    *,
    log_dir: str = ".",
    make: Callable[[str | int, int], FaultProxy] | None = None,
  ):
    if not upstreams:
      raise ValueError("A ProxySet needs at least one upstream.")
    make = make or _proxy_process(log_dir)
    self.proxies: list[FaultProxy] = [make(u, i) for i, u in enumerate(upstreams)]

  def __len__(self) -> int:
    return len(self.proxies)

  def start(self) -> list[str]:
    """Starts every proxy; returns their addresses. On a failure, stops those started and raises."""
    started = []
    try:
      for p in self.proxies:
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
    for p in self.proxies:
      try:
        p.stop()
      except Exception as e:  # Stop the others anyway.
        errors.append(e)
    if errors:
      raise errors[0]

  @property
  def addresses(self) -> list[str]:
    """Each shard's proxy address ('127.0.0.1:<port>'), in shard order: the shard map to
    advertise."""
    return [p.address for p in self.proxies]

  @property
  def address(self) -> str:
    """Shard 0's proxy: the address learners are given."""
    return self.proxies[0].address

  def targets(self, shard: int | None) -> list[FaultProxy]:
    """The proxies a fault on `shard` hits: that shard's, or every one for None.

    Raises:
      ValueError: for a shard the syncer does not have.
    """
    if shard is None:
      return list(self.proxies)
    if not 0 <= shard < len(self.proxies):
      raise ValueError(f"No syncer shard {shard}: the syncer has {len(self.proxies)}.")
    return [self.proxies[shard]]

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
