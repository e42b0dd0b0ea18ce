"""An answer's outer gradient δ = Θ^(anchor) − θ encoded on the learner's devices, in its wire codec.

One jitted program per fragment forms δ of every tensor and its payload (and block scales) in the
format of `codecs` (docs/algorithm.md §5), so the host copies only the encoded bytes (per value:
0.5 + 4 / block_size with int4, 1 + 4 / block_size with int8, 2 with bf16, 4 with fp32) and does
no per-value work. Every registered codec has a device program (`CODECS`).

**The bytes need not be the numpy codec's.** The syncer decodes the bytes it receives, and no
learner adopts its own answer: any encoding a decoder accepts, with the codec's error bound, is a
right answer. Only the downlink, which the syncer and every learner adopt, must decode bit-identical
everywhere, and it is always encoded on the syncer's host. The program still uses the numpy codec's
IEEE float32 operations in its order (a subtraction, |δ|, a block max, a division by qmax, a
division by the scale, round half to even; qmax is an argument and the divisors pass an
optimization barrier, so XLA keeps both divisions rather than multiplying by a reciprocal), and on
XLA's CPU backend its bytes are numpy's for normal values (tests/fragments/device_codec_test.py).
On a GPU a block scale may come out one ulp away: an equally valid encoding.

The error bound: bf16 rounds δ to nearest even; int8 and int4 decode within half a quantization
step s / 2 of δ, s = absmax / qmax of δ's block. A backend that flushes subnormals to zero moves a
value by less than the smallest normal float32 on top of that.

**Where no valid encoding comes out**, the program says so (`DeviceEncoding.valid` False) and the
caller encodes on the host, whose codec refuses what must be refused with a clear error: a NaN/Inf
value, a δ that overflows (float32, or bf16's range), and, for the block codecs, a block whose
absmax is so small that its scale would be subnormal (flushed to zero, every code would be 0).
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddiloco.fragments.compression import get_codec
from ddiloco.protocol import EncodedDelta

__all__ = ["CODECS", "DeviceEncoding", "EncodedDelta", "encode_delta"]

CODECS = ("fp32", "bf16", "int8", "int4")  # The codecs with a device program.

_TINY = float(np.finfo(np.float32).tiny)  # The smallest normal float32.


@dataclasses.dataclass(frozen=True)
class DeviceEncoding:
  """The encoding of each tensor's δ, still on the devices (copies to host started).

  Attributes:
    codec: the codec's name.
    payloads: per tensor, the payload in the program's dtype (float32 for fp32, uint16 bfloat16
      bits for bf16, int8 for int8, uint8 packed codes for int4).
    scales: per tensor, the float32 block scales (empty for fp32 and bf16).
    valid: a scalar bool array: False where the host must encode instead (module docstring).
  """

  codec: str
  payloads: tuple[jax.Array, ...]
  scales: tuple[jax.Array, ...]
  valid: jax.Array

  def to_host(self) -> tuple[bool, list[tuple[np.ndarray, np.ndarray]]]:
    """(valid, [(payload as little-endian uint8, float32 scales)] per tensor), in one transfer."""
    valid, payloads, scales = jax.device_get((self.valid, self.payloads, self.scales))
    wire = {"fp32": "<f4", "bf16": "<u2", "int8": "i1", "int4": "u1"}[self.codec]
    pairs = [
      (np.asarray(p).astype(wire, copy=False).view(np.uint8), np.asarray(s, "<f4"))
      for p, s in zip(payloads, scales)
    ]
    return bool(valid), pairs


def _blocks(delta: jax.Array, block_size: int) -> jax.Array:
  n = delta.size
  num_blocks = -(-n // block_size)
  return jnp.pad(delta, (0, num_blocks * block_size - n)).reshape(num_blocks, block_size)


def _quantized(delta: jax.Array, qmax: jax.Array, block_size: int):
  """(q as float32 integers in [-qmax, qmax], block scales, valid) of a flat δ."""
  blocks = _blocks(delta, block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  scales = absmax / jax.lax.optimization_barrier(jnp.broadcast_to(qmax, absmax.shape))
  # δ's own finiteness (then its scales are finite), not its scales': XLA's CPU backend reduces a
  # large max in a kernel that skips NaN, so a block holding one can still get a finite scale.
  valid = jnp.all(jnp.isfinite(blocks)) & ~jnp.any((absmax > 0) & (absmax < 2 * qmax * _TINY))
  safe = jnp.where(scales > 0, scales, jnp.float32(1))  # An all-zero block: every q is 0.
  per_value = jax.lax.optimization_barrier(jnp.broadcast_to(safe[:, None], blocks.shape))
  q = jnp.clip(jnp.round(blocks / per_value), -qmax, qmax)  # round: half to even, as rint.
  return q.reshape(-1)[: delta.size], scales, valid


def _encode_one(anchor, theta, qmax, *, codec: str, block_size: int):
  """(payload, scales, valid) of one tensor's δ = anchor − θ (see module docstring)."""
  delta = anchor.astype(jnp.float32).reshape(-1) - theta.astype(jnp.float32).reshape(-1)
  no_scales = jnp.zeros((0,), jnp.float32)
  if codec == "fp32":
    return delta, no_scales, jnp.all(jnp.isfinite(delta))
  if codec == "bf16":
    narrow = delta.astype(jnp.bfloat16)  # Round to nearest even, as ml_dtypes' cast.
    valid = jnp.all(jnp.isfinite(narrow))
    return jax.lax.bitcast_convert_type(narrow, jnp.uint16), no_scales, valid
  q, scales, valid = _quantized(delta, qmax, block_size)
  if codec == "int8":
    return q.astype(jnp.int8), scales, valid
  codes = (q + 8).astype(jnp.uint8)  # int4: two codes q + 8 a byte, value 2i in the low nibble.
  if codes.size % 2:
    codes = jnp.concatenate([codes, jnp.full((1,), 8, jnp.uint8)])
  pairs = codes.reshape(-1, 2)
  return pairs[:, 0] | (pairs[:, 1] << 4), scales, valid


@functools.partial(jax.jit, static_argnames=("codec", "block_size"))
def _encode(anchors, thetas, qmax, *, codec: str, block_size: int):
  out = [
    _encode_one(a, t, qmax, codec=codec, block_size=block_size) for a, t in zip(anchors, thetas)
  ]
  valid = jnp.bool_(True)
  for _, _, v in out:
    valid = valid & v
  return tuple(p for p, _, _ in out), tuple(s for _, s, _ in out), valid


def encode_delta(
  anchors: Sequence[np.ndarray | jax.Array],
  thetas: Sequence[jax.Array],
  *,
  codec: str = "int4",
  block_size: int = 64,
) -> DeviceEncoding:
  """Dispatches the encoding of δ = anchor − θ of each tensor (one program, asynchronous).

  Args:
    anchors: per tensor, Θ^(anchor) (host or device arrays).
    thetas: per tensor, θ of the same shape (device arrays).
    codec: one of `CODECS`.
    block_size: values per absmax scale (int8 and int4).

  Returns:
    The encoding, its host copies started.

  Raises:
    ValueError: on tensors of different counts or shapes, a codec without a device program, or
      block_size < 1.
  """
  if codec not in CODECS:
    raise ValueError(f"No device program for codec {codec!r}; these have one: {CODECS}.")
  if len(anchors) != len(thetas):
    raise ValueError(f"{len(anchors)} anchors for {len(thetas)} tensors.")
  for a, t in zip(anchors, thetas):
    if tuple(np.shape(a)) != tuple(np.shape(t)):
      raise ValueError(f"anchor shape {np.shape(a)} != θ shape {np.shape(t)}.")
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}.")
  spec = get_codec(codec, block_size)
  qmax = np.float32(getattr(spec, "qmax", 1))
  blocked = getattr(spec, "quantized", False)
  payloads, scales, valid = _encode(
    tuple(anchors), tuple(thetas), qmax, codec=codec, block_size=block_size if blocked else 1
  )
  for x in (*payloads, *scales, valid):
    x.copy_to_host_async()
  return DeviceEncoding(codec, payloads, scales, valid)
