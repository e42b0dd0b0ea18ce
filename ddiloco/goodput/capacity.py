"""How big a syncer must be: memory, ingest and cores per shard for a fleet (docs/goodput.md).

The syncer holds the global model and merges every fragment once per period from every learner.
This model turns a fleet (parameters, learners, schedule, step time, codecs) and per-core costs
measured on a machine (`SyncerCosts`; scripts/bench_merge.py and scripts/bench_wire.py measure
them) into what one of S syncer shards needs. Every fragment is cut into S slices, one per shard
(docs/architecture.md, "The sharded syncer"), so every per-shard figure is the fleet's divided by
S, and so is every round's work on each shard. Assumptions:

- Memory per shard: the `keep_versions` newest versions of its fragments in the parameters' own
  dtype, one float32 optimizer-state array per parameter per `state_arrays` (1 for Nesterov SGD),
  the decoded answers of the rounds open at once (each answer is a fragment in the parameters'
  dtype, from every learner), and the encoded downlink delta kept per fragment for a lossy
  downlink. Rounds open at once: a round stays open for its τ steps of overlap (then the grace
  window, bounded by the same budget), and a fragment is due every H / P steps, so
  ceil((τ + 1) · P / H) rounds are open fleet-wide, each shard holding its slice of each. Process overhead
  (Python, gRPC, buffers) is `base_bytes`.
- Ingest: every learner answers every round, P / H rounds per step fleet-wide, one fragment each,
  in the uplink's bits per value. Egress: every merged fragment goes to every learner in the
  downlink's bits. For P = H = 24, a 2B model with 8 learners at a 1 s step and a bf16 uplink:
  8 · 2e9 · 2 B / 24 s = 1.33 GB/s into the syncer.
- Cores per shard: the time per second spent decoding pushes, serving pulls, merging (reading
  every answer once, with the outer step) and adopting a lossy downlink, each at its measured
  per-core rate. A shard that needs more than one core must run those on several threads or
  processes; the figure is the work, not a promise that Python spreads it.
- Latency: a round's merge (M answers of one fragment, plus adoption) must finish within the
  grace budget, τ steps, or learners apply the round late. `merge_s` is one shard's slice of it
  on `merge_cores` cores: the S slices merge side by side, so shards shorten it.
"""

import dataclasses
import json
import math
import os
from collections.abc import Sequence

from ddiloco.goodput import bandwidth

_GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncerCosts:
  """What one syncer core does per second, measured on a machine (docs/goodput.md says where).

  Attributes:
    ingest_gbps: pushed bytes (on the wire) a core receives and decodes, GB/s.
    egress_gbps: pulled bytes a core serves, GB/s.
    merge_gbps: answer bytes (decoded, in the parameters' dtype) a core merges, outer step
      included, GB/s.
    adopt_gbps: fragment bytes a core adopts through a lossy downlink codec (encode the delta,
      decode it as a learner will), GB/s; unused for an exact downlink.
    source: where the figures come from.
  """

  ingest_gbps: float
  egress_gbps: float
  merge_gbps: float
  adopt_gbps: float
  source: str = ""

  def __post_init__(self):
    for name in ("ingest_gbps", "egress_gbps", "merge_gbps", "adopt_gbps"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncerLoad:
  """A fleet as the syncer sees it.

  Attributes:
    params: parameters of the model.
    learners: M, learners answering every round.
    fragments: P.
    period: H, inner steps between two rounds of one fragment.
    overlap: τ, steps a learner trains before it applies a round's merge.
    step_time_s: the learners' inner step time.
    param_bytes: bytes per parameter of the global model (4 for float32, 2 for bfloat16).
    uplink: the push codec (default bf16).
    downlink: the pull codec (default bf16).
    lossy_downlink: whether the downlink codec is lossy (the syncer adopts what learners decode
      and keeps the encoded delta of each fragment's newest version).
    keep_versions: versions kept per fragment, current included.
    state_arrays: float32 optimizer-state arrays per parameter (1: Nesterov momentum).
    shards: S, syncer processes; each merges one slice of every fragment.
    merge_cores: cores one shard's merge runs on (XLA's intra-op threads run the fused merge on
      several; it used 1.4 of 2 cores on the development VM).
    base_bytes: memory of a shard besides the model (interpreter, libraries, buffers).
  """

  params: float
  learners: int
  fragments: int = 24
  period: int = 24
  overlap: int = 2
  step_time_s: float = 1.0
  param_bytes: int = 4
  uplink: bandwidth.Wire = dataclasses.field(default_factory=bandwidth.Wire)
  downlink: bandwidth.Wire = dataclasses.field(default_factory=bandwidth.Wire)
  lossy_downlink: bool = False
  keep_versions: int = 4
  state_arrays: int = 1
  shards: int = 1
  merge_cores: int = 1
  base_bytes: float = 1e9

  def __post_init__(self):
    if not (math.isfinite(self.params) and self.params > 0):
      raise ValueError(f"params must be finite and > 0, got {self.params}.")
    names = ("learners", "fragments", "period", "overlap", "param_bytes", "keep_versions")
    for name in (*names, "merge_cores"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.shards < 1:
      raise ValueError(f"shards must be >= 1, got {self.shards}.")
    if self.state_arrays < 0 or self.base_bytes < 0:
      raise ValueError("state_arrays and base_bytes must be >= 0.")
    if not (math.isfinite(self.step_time_s) and self.step_time_s > 0):
      raise ValueError(f"step_time_s must be finite and > 0, got {self.step_time_s}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardSizing:
  """What one shard needs (every figure per shard; see the module docstring)."""

  shards: int
  ram_bytes: float
  ram_parts: dict[str, float]
  ingest_gbps: float
  egress_gbps: float
  cores: float
  merge_s: float
  grace_budget_s: float

  @property
  def in_budget(self) -> bool:
    """Whether a round's merge fits in its grace budget (τ steps)."""
    return self.merge_s <= self.grace_budget_s


def size_shard(load: SyncerLoad, costs: SyncerCosts) -> ShardSizing:
  """Memory, traffic, cores and merge latency of one of `load.shards` shards."""
  s, m = load.shards, load.learners
  shard_params = load.params / s
  fragment_params = load.params / load.fragments
  rounds_per_step = load.fragments / load.period  # Fleet-wide.
  open_rounds = math.ceil((load.overlap + 1) * rounds_per_step)
  slice_params = fragment_params / s  # A shard's slice of every fragment.
  parts = {
    "versions": load.keep_versions * shard_params * load.param_bytes,
    "optimizer": load.state_arrays * shard_params * 4,
    "answers": open_rounds * m * slice_params * load.param_bytes,
    "downlink": shard_params * load.downlink.bits / 8 if load.lossy_downlink else 0.0,
    "base": load.base_bytes,
  }
  steps_per_s = 1.0 / load.step_time_s
  # Per shard and second: rounds (its slice of each) merged, bytes pushed in and pulled out.
  rounds = rounds_per_step * steps_per_s
  ingest = rounds * m * slice_params * load.uplink.bits / 8 / _GB
  egress = rounds * m * slice_params * load.downlink.bits / 8 / _GB
  merge_bytes = m * slice_params * load.param_bytes
  merge_work = merge_bytes / (costs.merge_gbps * _GB)  # Core-seconds per round's slice.
  if load.lossy_downlink:
    merge_work += slice_params * load.param_bytes / (costs.adopt_gbps * _GB)
  cores = ingest / costs.ingest_gbps + egress / costs.egress_gbps + rounds * merge_work
  return ShardSizing(
    shards=s,
    ram_bytes=sum(parts.values()),
    ram_parts=parts,
    ingest_gbps=ingest,
    egress_gbps=egress,
    cores=cores,
    merge_s=merge_work / load.merge_cores,
    grace_budget_s=load.overlap * load.step_time_s,
  )


def fewest_shards(
  load: SyncerLoad,
  costs: SyncerCosts,
  *,
  max_cores: float,
  max_ram_bytes: float,
  max_shards: int = 256,
) -> ShardSizing | None:
  """The sizing with the fewest shards (1, 2, 3, ... up to `max_shards`) whose shards each need
  at most `max_cores` cores and `max_ram_bytes` of memory and merge within the grace budget, or
  None."""
  for s in range(1, max_shards + 1):
    sizing = size_shard(dataclasses.replace(load, shards=s), costs)
    if sizing.cores <= max_cores and sizing.ram_bytes <= max_ram_bytes and sizing.in_budget:
      return sizing
  return None


def format_sizing(rows: list[tuple[str, ShardSizing]]) -> str:
  """A table: one row per (label, sizing), figures per shard."""
  head = (
    f"{'fleet':34s} {'S':>3s} {'RAM GB':>8s} {'in GB/s':>8s} {'out GB/s':>8s} "
    f"{'cores':>6s} {'merge ms':>9s} {'budget ms':>9s}"
  )
  lines = [head]
  for label, z in rows:
    lines.append(
      f"{label:34s} {z.shards:3d} {z.ram_bytes / _GB:8.1f} {z.ingest_gbps:8.2f} "
      f"{z.egress_gbps:8.2f} {z.cores:6.2f} {1e3 * z.merge_s:9.1f} {1e3 * z.grace_budget_s:9.0f}"
      + ("" if z.in_budget else "  (over budget)")
    )
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredShard:
  """One shard's cost, measured end to end under a synthetic fleet (scripts/bench_capacity.py).

  Where `SyncerCosts` adds up the parts a shard does (wire, merge, adoption) measured apart, these
  figures come from a running shard, so they include everything it does per pushed byte.

  Attributes:
    ingest_gbps_per_core: wire bytes a shard takes in per CPU-second it uses, GB (receiving,
      decoding and filing pushes, merging, adopting, publishing, its streams and heartbeats).
    merge_gbps: decoded answer bytes (M answers of a fragment, float32) one round goes through
      per second from its quorum to its publication: a round's merge latency.
    rss_bytes_per_param: RSS a shard grows by per parameter it holds, at `keep_versions`, with a
      float32 global model and Nesterov momentum (the decoded answers of its open rounds included).
    rss_base_bytes: RSS of a shard holding nothing (the intercept of the same fit).
    keep_versions: the `keep_versions` the RSS was measured at.
    egress_gbps_per_core: pulled bytes a core serves per second, GB; None: the measured fleet did
      not pull, and egress is left out of the cores.
    source: the command and load the figures come from.
  """

  ingest_gbps_per_core: float
  merge_gbps: float
  rss_bytes_per_param: float
  rss_base_bytes: float
  keep_versions: int = 4
  egress_gbps_per_core: float | None = None
  source: str = ""

  def __post_init__(self):
    for name in ("ingest_gbps_per_core", "merge_gbps", "rss_bytes_per_param"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}.")
    egress = self.egress_gbps_per_core
    if egress is not None and not (math.isfinite(egress) and egress > 0):
      raise ValueError(f"egress_gbps_per_core must be finite and > 0 or None, got {egress}.")
    if not (math.isfinite(self.rss_base_bytes) and self.rss_base_bytes >= 0):
      raise ValueError(f"rss_base_bytes must be finite and >= 0, got {self.rss_base_bytes}.")
    if self.keep_versions < 1:
      raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardPlan:
  """How many shards a fleet needs, and what each needs (`plan_shards`).

  Attributes:
    shards: S.
    hosts: hosts of `cores_per_host` cores holding the S shards, each shard on `max_cores` cores.
    cores: CPU work of one shard, cores.
    ram_bytes: its RSS.
    ingest_gbps: the wire bytes it takes in per second, GB.
    merge_s: its part of one round's merge (quorum to publication).
    round_s: one round from its opening to its publication at the least: the 1/S of its M answers
      each shard takes in, received at one core's ingest rate, then merged; every shard does its
      slice of the round at once, so the round shortens with S.
    grace_budget_s: τ · step time.
    limited_by: what set S: "cores", "ram", "round" (its budget), or "one shard".
    fits: whether every limit holds at some S <= `max_shards` (False: none does; the figures are
      at S = `max_shards`).
  """

  shards: int
  hosts: int
  cores: float
  ram_bytes: float
  ingest_gbps: float
  merge_s: float
  round_s: float
  grace_budget_s: float
  limited_by: str
  fits: bool

  @property
  def in_budget(self) -> bool:
    """Whether a round can be received and merged within its grace budget (τ steps)."""
    return self.round_s <= self.grace_budget_s


def plan_shards(
  load: SyncerLoad,
  shard: MeasuredShard,
  *,
  max_cores: float = 1.0,
  max_ram_bytes: float = math.inf,
  cores_per_host: int = 16,
  max_shards: int = 256,
) -> ShardPlan:
  """The fewest shards whose every shard needs at most `max_cores` cores of work and
  `max_ram_bytes` of RSS, and whose rounds fit their grace budget, from measured figures;
  `load.shards` is ignored.

  Every fragment is cut into S byte-balanced slices and shard s owns slice s of each
  (docs/architecture.md, "The sharded syncer"), so each shard takes 1/S of the fleet's ingest and
  of every round: a round is S slices received and merged side by side, and its time falls as 1/S.
  (Slices balance within the layout's bound, the largest piece; the plan takes them as equal.) RSS
  per parameter is scaled to `load.keep_versions` by `load.param_bytes` per version kept more or
  less than measured. `max_cores` is 1 for a shard that is one Python process (its GIL); hosts
  hold floor(`cores_per_host` / `max_cores`) shards each.

  Raises:
    ValueError: if `max_shards` or `cores_per_host` is below 1, or `max_cores` is not > 0.
  """
  if max_shards < 1 or cores_per_host < 1 or not max_cores > 0:
    raise ValueError(
      f"Need max_shards >= 1, cores_per_host >= 1 and max_cores > 0, got {max_shards}, "
      f"{cores_per_host}, {max_cores}."
    )
  m, p = load.learners, load.fragments
  rounds_per_s = p / load.period / load.step_time_s  # Fleet-wide; one answer per learner each.
  fragment_params = load.params / p
  fleet_ingest = rounds_per_s * m * fragment_params * load.uplink.bits / 8 / _GB
  fleet_cores = fleet_ingest / shard.ingest_gbps_per_core
  if shard.egress_gbps_per_core is not None:
    fleet_egress = rounds_per_s * m * fragment_params * load.downlink.bits / 8 / _GB
    fleet_cores += fleet_egress / shard.egress_gbps_per_core
  per_param = shard.rss_bytes_per_param
  per_param += (load.keep_versions - shard.keep_versions) * load.param_bytes
  merge_s = m * fragment_params * 4 / (shard.merge_gbps * _GB)
  receive_s = m * fragment_params * load.uplink.bits / 8 / (shard.ingest_gbps_per_core * _GB)
  budget_s = load.overlap * load.step_time_s
  per_host = max(1, int(cores_per_host // max_cores))  # A shard wider than a host: one each.

  def at(s: int, limited_by: str = "", fits: bool = True) -> ShardPlan:
    return ShardPlan(
      shards=s,
      hosts=math.ceil(s / per_host),
      cores=fleet_cores / s,
      ram_bytes=shard.rss_base_bytes + load.params / s * per_param,
      ingest_gbps=fleet_ingest / s,
      merge_s=merge_s / s,
      round_s=(receive_s + merge_s) / s,
      grace_budget_s=budget_s,
      limited_by=limited_by,
      fits=fits,
    )

  def failed(z: ShardPlan) -> str:
    """The first limit `z` breaks ("" if none)."""
    if z.cores > max_cores:
      return "cores"
    if z.ram_bytes > max_ram_bytes:
      return "ram"
    return "round" if not z.in_budget else ""

  why = ""  # What S - 1 shards broke.
  for s in range(1, max_shards + 1):
    broken = failed(at(s))
    if not broken:
      return at(s, why or "one shard")
    why = broken
  return at(max_shards, why, False)


def format_plans(rows: list[tuple[str, ShardPlan]]) -> str:
  """A table: one row per (label, plan), figures per shard."""
  head = (
    f"{'fleet':34s} {'S':>3s} {'hosts':>5s} {'cores':>6s} {'RAM GB':>7s} {'in GB/s':>8s} "
    f"{'merge ms':>9s} {'round ms':>9s} {'budget ms':>9s}  limited by"
  )
  lines = [head]
  for label, z in rows:
    lines.append(
      f"{label:34s} {z.shards:3d} {z.hosts:5d} {z.cores:6.2f} {z.ram_bytes / _GB:7.1f} "
      f"{z.ingest_gbps:8.3f} {1e3 * z.merge_s:9.0f} {1e3 * z.round_s:9.0f} "
      f"{1e3 * z.grace_budget_s:9.0f}  {z.limited_by}"
      + ("" if z.fits else " (does not fit at any S)")
      + ("" if z.in_budget else " (round over budget)")
    )
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapacityStudy:
  """Fleets to size against one machine's measured costs (`ddiloco-goodput`).

  Attributes:
    fleets: (label, load) pairs; each is sized at its own `shards` and at the fewest shards
      that fit the limits below.
    costs: the per-core costs.
    max_cores: cores one shard may use.
    max_ram_gb: memory one shard may use, GB.
    measured: a shard's end-to-end measured figures; if given, every fleet is also planned from
      them (`plan_shards`, one core per shard: `measured_cores` cores of work at most).
    measured_cores: cores of work one shard may need in that plan.
    cores_per_host: cores of one syncer host in that plan (how many hosts the shards need).
  """

  fleets: Sequence[tuple[str, SyncerLoad]]
  costs: SyncerCosts
  max_cores: float = 8.0
  max_ram_gb: float = 128.0
  measured: MeasuredShard | None = None
  measured_cores: float = 1.0
  cores_per_host: int = 16

  def __post_init__(self):
    object.__setattr__(self, "fleets", tuple((str(n), f) for n, f in self.fleets))
    if not self.fleets:
      raise ValueError("A capacity study needs at least one fleet.")
    if not (self.max_cores > 0 and self.max_ram_gb > 0 and self.measured_cores > 0):
      raise ValueError("max_cores, max_ram_gb and measured_cores must be > 0.")


def run_capacity_study(study: CapacityStudy, workdir: str) -> dict[str, object]:
  """Sizes every fleet; writes capacity.json to `workdir` and prints the table.

  Returns:
    The figures written to capacity.json.
  """
  os.makedirs(workdir, exist_ok=True)
  rows, out = [], []
  for label, load in study.fleets:
    given = size_shard(load, study.costs)
    best = fewest_shards(
      load, study.costs, max_cores=study.max_cores, max_ram_bytes=study.max_ram_gb * _GB
    )
    rows.append((label, given))
    if best is not None and best.shards != given.shards:
      rows.append(("  fewest shards that fit", best))
    out.append(
      {
        "fleet": label,
        "load": dataclasses.asdict(load),
        "given": dataclasses.asdict(given),
        "fewest_shards": None if best is None else dataclasses.asdict(best),
      }
    )
  result = {
    "costs": dataclasses.asdict(study.costs),
    "max_cores": study.max_cores,
    "max_ram_gb": study.max_ram_gb,
    "fleets": out,
  }
  if study.measured is not None:
    plans = [
      (
        label,
        plan_shards(
          load,
          study.measured,
          max_cores=study.measured_cores,
          max_ram_bytes=study.max_ram_gb * _GB,
          cores_per_host=study.cores_per_host,
        ),
      )
      for label, load in study.fleets
    ]
    result["measured"] = dataclasses.asdict(study.measured)
    result["measured_plans"] = [{"fleet": n, **dataclasses.asdict(z)} for n, z in plans]
  with open(os.path.join(workdir, "capacity.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(format_sizing(rows))
  print(
    f"per shard; limits {study.max_cores:g} cores, {study.max_ram_gb:g} GB; costs: "
    f"{study.costs.source or 'unstated'}"
  )
  if study.measured is not None:
    print(f"\nFrom measured shards ({study.measured.source or 'source unstated'}):")
    print(format_plans(plans))
    print(
      f"per shard; limits {study.measured_cores:g} cores, {study.max_ram_gb:g} GB; hosts of "
      f"{study.cores_per_host} cores"
    )
  return result
