"""Which syncer shard owns which fragment (docs/architecture.md, "The sharded syncer").

With S syncer shards, fragment p belongs to shard p mod S. The layout then cuts each of the
schedule's fragments into S byte-balanced slices, slice s of group g being fragment g·S + s
(`make_layout(slices=S)`), so shard s owns slice s of every group: about 1/S of the bytes, and a
share of every round, which all shards merge in parallel. Fragment ids stay global everywhere (on the wire, in checkpoints,
in digests); a shard holds values, versions and outer states only for its own fragments.
"""

# What a shard's refusal (OUT_OF_RANGE) of a fragment it does not own says: a learner reading it
# knows its shard map is stale.
NOT_OWNED = "belongs to another syncer shard"


def check_shards(num_shards: int, num_fragments: int) -> None:
  """Raises ValueError unless 1 <= num_shards <= num_fragments (every shard owns a fragment)."""
  if num_shards < 1:
    raise ValueError(f"syncer_shards must be >= 1, got {num_shards}.")
  if num_shards > num_fragments:
    raise ValueError(
      f"syncer_shards={num_shards} exceeds the {num_fragments} fragments: a shard would own none."
    )


def shard_of(fragment: int, num_shards: int) -> int:
  """The shard that owns `fragment` (p mod S).

  Raises:
    ValueError: on a negative fragment or fewer than one shard.
  """
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
  if fragment < 0:
    raise ValueError(f"Fragment ids are >= 0, got {fragment}.")
  return fragment % num_shards


def owned(shard: int, num_shards: int, num_fragments: int) -> frozenset[int]:
  """The fragments `shard` owns among 0..num_fragments-1.

  Raises:
    ValueError: if the shard count does not fit the fragments (`check_shards`) or `shard` is not
      in [0, num_shards).
  """
  check_shards(num_shards, num_fragments)
  if not 0 <= shard < num_shards:
    raise ValueError(f"Shard {shard} out of range [0, {num_shards}).")
  return frozenset(range(shard, num_fragments, num_shards))
