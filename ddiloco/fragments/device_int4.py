"""The int4 codec's encoding of an outer gradient δ = Θ^(anchor) − θ, run on the learner's devices.

One jitted program per fragment forms δ of every tensor and its int4 payload and block scales
(`codecs.Int4`'s format, docs/algorithm.md §5), so a learner copies 0.5 + 4 / block_size bytes per
value to host memory instead of 4 and its host does no per-value work. The bytes are those of the
numpy codec (`Int4.encode_runs` with the anchor as values and θ as base) bit for bit: the program
uses the same IEEE float32 operations in the same order (a subtraction, |δ|, a block max, a
division by 7, a division by the scale, round half to even); 7 is an argument rather than a
constant, and the scales reach the division through an optimization barrier, so that XLA cannot
rewrite either division as a multiplication by a reciprocal.

Where the two could differ the program says so instead of guessing (`DeviceEncoding.exact`
False): a NaN/Inf (the numpy codec refuses it), a subnormal input, δ or block scale (XLA's CPU
backend flushes subnormals to zero, numpy keeps them). The caller then encodes that fragment with
the numpy codec, the reference. `tests/fragments/device_int4_test.py` checks the bytes against it.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_TINY = float(np.finfo(np.float32).tiny)  # The smallest normal float32.
_EXPONENT, _MANTISSA = 0x7F800000, 0x007FFFFF


@dataclasses.dataclass(frozen=True)
class EncodedDelta:
  """A fragment's outer gradient δ, encoded: what a push sends as its payload.

  Attributes:
    codec: the codec's name.
    block_size: values per scale.
    entries: per layout key, (payload as uint8, float32 scales).
  """

  codec: str
  block_size: int
  entries: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class DeviceEncoding:
  """The int4 encoding of each tensor's δ, still on the devices (copies to host started).

  Attributes:
    payloads: per tensor, the packed codes (uint8, two values per byte, `Int4`'s order).
    scales: per tensor, the float32 block scales.
    exact: a scalar bool array: False where the numpy codec must encode instead (see module
      docstring).
  """

  payloads: tuple[jax.Array, ...]
  scales: tuple[jax.Array, ...]
  exact: jax.Array

  def to_host(self) -> tuple[bool, list[tuple[np.ndarray, np.ndarray]]]:
    """(exact, [(payload, scales)] per tensor) in host memory, in one transfer."""
    exact, payloads, scales = jax.device_get((self.exact, self.payloads, self.scales))
    pairs = [(np.asarray(p, np.uint8), np.asarray(s, "<f4")) for p, s in zip(payloads, scales)]
    return bool(exact), pairs


def _subnormal(x: jax.Array) -> jax.Array:
  """Whether each float32 value is subnormal, from its bits (unaffected by flush-to-zero)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return ((bits & _EXPONENT) == 0) & ((bits & _MANTISSA) != 0)


def _encode_one(anchor, theta, qmax, *, block_size: int):
  """(payload, scales, exact) of one tensor's δ = anchor − θ (see module docstring)."""
  a = anchor.astype(jnp.float32).reshape(-1)
  t = theta.astype(jnp.float32).reshape(-1)
  delta = a - t
  n = delta.size
  num_blocks = -(-n // block_size)
  blocks = jnp.pad(delta, (0, num_blocks * block_size - n)).reshape(num_blocks, block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  scales = absmax / jax.lax.optimization_barrier(jnp.broadcast_to(qmax, absmax.shape))
  # Every case where numpy and XLA may round differently, or numpy refuses: see module docstring.
  # A subnormal δ flushed to zero shows as a != t with δ == 0; a scale is subnormal where the block
  # max is under 7 · tiny (checked on the max, a normal number, with some margin).
  inexact = (
    ~jnp.all(jnp.isfinite(scales))
    | jnp.any(_subnormal(a) | _subnormal(t) | _subnormal(delta))
    | jnp.any((a != t) & (delta == 0))
    | jnp.any((absmax > 0) & (absmax < 8 * _TINY))
  )
  safe = jnp.where(scales > 0, scales, jnp.float32(1))
  # The divisor per value, behind a barrier: XLA rewrites a division by a broadcast as a product
  # with the reciprocal, which is off by an ulp now and then, and so rounds some ties the other
  # way (measured: 3 codes in 2^20 on CPU).
  per_value = jax.lax.optimization_barrier(jnp.broadcast_to(safe[:, None], blocks.shape))
  q = jnp.clip(jnp.round(blocks / per_value), -qmax, qmax)  # round: half to even, as rint.
  codes = (q.reshape(-1)[:n] + 8).astype(jnp.uint8)
  if n % 2:
    codes = jnp.concatenate([codes, jnp.full((1,), 8, jnp.uint8)])
  pairs = codes.reshape(-1, 2)
  payload = pairs[:, 0] | (pairs[:, 1] << 4)
  return payload, scales, ~inexact


@functools.partial(jax.jit, static_argnames="block_size")
def _encode(anchors, thetas, qmax, *, block_size: int):
  out = [_encode_one(a, t, qmax, block_size=block_size) for a, t in zip(anchors, thetas)]
  exact = jnp.bool_(True)
  for _, _, e in out:
    exact = exact & e
  return tuple(p for p, _, _ in out), tuple(s for _, s, _ in out), exact


def encode_delta(
  anchors: Sequence[np.ndarray | jax.Array],
  thetas: Sequence[jax.Array],
  *,
  block_size: int = 64,
) -> DeviceEncoding:
  """Dispatches the int4 encoding of δ = anchor − θ of each tensor (one program, asynchronous).

  Args:
    anchors: per tensor, Θ^(anchor) (host or device arrays).
    thetas: per tensor, θ of the same shape (device arrays).
    block_size: values per absmax scale.

  Returns:
    The encoding, its host copies started.

  Raises:
    ValueError: on tensors of different counts or shapes, or block_size < 1.
  """
  if len(anchors) != len(thetas):
    raise ValueError(f"{len(anchors)} anchors for {len(thetas)} tensors.")
  for a, t in zip(anchors, thetas):
    if tuple(np.shape(a)) != tuple(np.shape(t)):
      raise ValueError(f"anchor shape {np.shape(a)} != θ shape {np.shape(t)}.")
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}.")
  payloads, scales, exact = _encode(
    tuple(anchors), tuple(thetas), np.float32(7), block_size=block_size
  )
  for x in (*payloads, *scales, exact):
    x.copy_to_host_async()
  return DeviceEncoding(payloads, scales, exact)
