"""Checks the device encoding of δ (every codec) on this machine's default devices.

  python scripts/check_device_codec.py                 # random tensors and the edge cases
  python scripts/check_device_codec.py --timing_mib=64 # and the time of both paths for one tensor

`fragments/device_codec.py` must give, in each codec, a valid encoding of δ = Θ^(anchor) − θ: one
the receiver decodes within the codec's error bound (`testing.codecs.delta_excess`), or flag the
tensors where the host must encode (NaN/Inf, overflow, a scale that would be subnormal). Its bytes
need not be the host codec's; how many cases are is printed (on XLA's CPU backend, all the valid
ones with normal values). One line per case; the exit status is 1 on any encoding outside the
bound or any flag wrong. With --timing_mib it also times, for one tensor of that size on the
device, the int4 host path a sender takes without device encoding (copy θ to host, numpy δ and
encoding) against the device path (encode on device, copy the bytes).
"""

import sys
import time

import jax
import numpy as np
from absl import app, flags

from ddiloco.fragments import device_codec
from ddiloco.fragments.compression import get_codec
from ddiloco.testing.codecs import delta_bytes, delta_excess

_TIMING = flags.DEFINE_integer("timing_mib", 0, "MiB of float32 for the timing (0: no timing)")
_SEED = flags.DEFINE_integer("seed", 0, "random seed")

_TINY = np.finfo(np.float32).tiny


def _cases(rng: np.random.Generator):
  """(name, anchor, θ, block size, the codecs that must flag it for the host, or ())."""
  for n in (1, 2, 63, 64, 65, 1000, 65536 + 129, 1 << 20):
    for bs in (64, 32, 7):
      theta = rng.standard_normal(n).astype(np.float32)
      anchor = theta + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
      yield f"random n={n} bs={bs}", anchor, theta, bs, ()
  theta = rng.standard_normal(4096).astype(np.float32)
  mags = np.float32(2.0) ** rng.integers(-100, 100, theta.shape).astype(np.float32)
  anchor = (theta + rng.standard_normal(theta.shape).astype(np.float32) * mags).astype(np.float32)
  yield "magnitudes 2^-100..2^100", anchor, theta, 64, ()
  ties = np.tile(np.array([7, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 6.5], np.float32), 16)
  yield "ties", ties, np.zeros_like(ties), 64, ()
  near = np.full(128, 256 * _TINY, np.float32) * np.arange(1, 129, dtype=np.float32)
  yield "normal values near the subnormal edge", near, np.zeros_like(near), 64, ()
  zeros = np.linspace(-1, 1, 300, dtype=np.float32)
  yield "δ = 0", zeros, zeros.copy(), 64, ()
  sub_a = np.array([_TINY / 4, 1.5 * _TINY, 1.0, -0.5] * 16, np.float32)
  sub_t = np.array([0.0, 1.25 * _TINY, 0.25, 0.0] * 16, np.float32)
  yield "subnormal inputs and δ", sub_a, sub_t, 64, ()
  every = device_codec.CODECS
  for name, a, t, flagged in [
    ("NaN", [np.nan, 1.0], [0.0, 0.0], every),
    ("Inf", [np.inf, 1.0], [0.0, 0.0], every),
    ("overflowing δ", [3e38, 1.0], [-3e38, 0.0], every),
    ("δ beyond bf16", [3.4e38, 1.0], [0.0, 0.0], ("bf16",)),
    ("subnormal scale", [3 * _TINY, 2 * _TINY], [0.0, 0.0], ("int8", "int4")),
  ]:
    yield name, np.array(a, np.float32), np.array(t, np.float32), 64, flagged


def _check(rng: np.random.Generator) -> int:
  failures = 0
  for name, anchor, theta, bs, flagged in _cases(rng):
    line = []
    for codec in device_codec.CODECS:
      enc = device_codec.encode_delta([anchor], [jax.device_put(theta)], codec=codec, block_size=bs)
      valid, [(payload, scales)] = enc.to_host()
      if codec in flagged:
        ok = not valid
        line.append(f"{codec} {'flagged' if ok else 'NOT FLAGGED'}")
      elif not valid:
        ok = False
        line.append(f"{codec} FLAGGED")
      else:
        excess = delta_excess(codec, anchor, theta, payload, scales, block_size=bs)
        ok = excess <= 0
        host = delta_bytes(codec, anchor, theta, bs)
        same = payload.tobytes() == host[0] and scales.tobytes() == host[1]
        line.append(
          f"{codec} {'in bound' if ok else f'BEYOND BOUND by {excess:.3g}'}"
          f"{', host bytes' if same else ', other bytes'}"
        )
      failures += not ok
    print(f"  {name}: " + "; ".join(line))
  return failures


def _time(fn, reps: int = 5) -> float:
  fn()  # Compilation, first transfers.
  t0 = time.perf_counter()
  for _ in range(reps):
    fn()
  return (time.perf_counter() - t0) / reps


def _timing(mib: int, rng: np.random.Generator) -> None:
  n = mib * (1 << 20) // 4
  theta = jax.device_put(rng.standard_normal(n).astype(np.float32))
  anchor_host = np.asarray(jax.device_get(theta)) + np.float32(1e-3)
  codec = get_codec("int4", 64)

  def host_path():
    host = np.asarray(jax.device_get(theta))
    return sum(p.size for p, _ in codec.encode_runs(anchor_host, base=host))

  def device_path():
    return device_codec.encode_delta([anchor_host], [theta]).to_host()

  anchor_dev = jax.device_put(anchor_host)

  def device_path_anchor_on_device():
    return device_codec.encode_delta([anchor_dev], [theta]).to_host()

  print(f"timing, one tensor of {mib} MiB float32 on {theta.devices()}:")
  for name, fn in [
    ("host: copy θ, numpy δ + int4", host_path),
    ("device: anchor from host, encode, copy bytes", device_path),
    ("device: anchor on device, encode, copy bytes", device_path_anchor_on_device),
  ]:
    print(f"  {name:48s} {1e3 * _time(fn):9.2f} ms")


def main(argv: list[str]) -> None:
  del argv
  print(f"jax {jax.__version__}, devices {jax.devices()}")
  rng = np.random.default_rng(_SEED.value)
  failures = _check(rng)
  print(f"device encodings: {failures} failure(s)")
  if _TIMING.value > 0:
    _timing(_TIMING.value, rng)
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  app.run(main)
