"""Checks the int4 encoding of δ on this machine's default devices against the numpy codec.

  python scripts/check_device_int4.py                 # random tensors and the edge cases
  python scripts/check_device_int4.py --timing_mib=64 # and the time of both paths for one tensor

`fragments/device_int4.py` must give the numpy codec's bytes bit for bit (`Int4.encode_runs` of
Θ^(anchor) with θ as base: what a push puts on the wire), or flag the tensors where it cannot
(NaN/Inf, subnormals). This runs both on tensors of many sizes and magnitudes and prints one line
per case; the exit status is 1 on any mismatch. With --timing_mib it also times, for one tensor of
that size on the device, the host path a sender takes without device encoding (copy θ to host,
numpy δ and encoding) against the device path (encode on device, copy the bytes).
"""

import sys
import time

import jax
import numpy as np
from absl import app, flags

from ddiloco.fragments import device_int4
from ddiloco.fragments.compression import get_codec
from ddiloco.testing.codecs import int4_delta_bytes

_TIMING = flags.DEFINE_integer("timing_mib", 0, "MiB of float32 for the timing (0: no timing)")
_SEED = flags.DEFINE_integer("seed", 0, "random seed")

_TINY = np.finfo(np.float32).tiny


def _cases(rng: np.random.Generator):
  """(name, anchor, θ, block size, whether the device must call it exact)."""
  for n in (1, 2, 63, 64, 65, 1000, 65536 + 129, 1 << 20):
    for bs in (64, 32, 7):
      theta = rng.standard_normal(n).astype(np.float32)
      anchor = theta + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
      yield f"random n={n} bs={bs}", anchor, theta, bs, True
  theta = rng.standard_normal(4096).astype(np.float32)
  mags = np.float32(2.0) ** rng.integers(-100, 100, theta.shape).astype(np.float32)
  anchor = (theta + rng.standard_normal(theta.shape).astype(np.float32) * mags).astype(np.float32)
  yield "magnitudes 2^-100..2^100", anchor, theta, 64, True
  ties = np.tile(np.array([7, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 6.5], np.float32), 16)
  yield "ties round to even", ties, np.zeros_like(ties), 64, True
  near = np.full(128, 16 * _TINY, np.float32) * np.arange(1, 129, dtype=np.float32)
  yield "normal values near the subnormal edge", near, np.zeros_like(near), 64, True
  zeros = np.linspace(-1, 1, 300, dtype=np.float32)
  yield "δ = 0", zeros, zeros.copy(), 64, True
  for name, a, t in [
    ("NaN", [np.nan, 1.0], [0.0, 0.0]),
    ("Inf", [np.inf, 1.0], [0.0, 0.0]),
    ("overflowing δ", [3e38, 1.0], [-3e38, 0.0]),
    ("subnormal input", [_TINY / 4, 1.0], [0.0, 0.0]),
    ("subnormal δ", [1.5 * _TINY, 1.0], [1.25 * _TINY, 1.0]),
    ("subnormal scale", [3 * _TINY, 2 * _TINY], [0.0, 0.0]),
  ]:
    yield name, np.array(a, np.float32), np.array(t, np.float32), 64, False


def _check(rng: np.random.Generator) -> int:
  failures = 0
  for name, anchor, theta, bs, want_exact in _cases(rng):
    enc = device_int4.encode_delta([anchor], [jax.device_put(theta)], block_size=bs)
    exact, [(payload, scales)] = enc.to_host()
    if not want_exact:
      ok = not exact
      print(f"  {'ok  ' if ok else 'FAIL'} {name}: flagged for the host codec = {not exact}")
    else:
      want_payload, want_scales = int4_delta_bytes(anchor, theta, bs)
      ok = exact and payload.tobytes() == want_payload and scales.tobytes() == want_scales
      print(f"  {'ok  ' if ok else 'FAIL'} {name}: exact {exact}, bytes equal {ok}")
      if not ok:
        got_p, got_s = np.asarray(payload, np.uint8).reshape(-1), np.asarray(scales, np.float32)
        want_p = np.frombuffer(want_payload, np.uint8)
        want_s = np.frombuffer(want_scales, np.float32)
        print(
          f"       payload {got_p.size} vs {want_p.size} bytes, "
          f"{np.count_nonzero(got_p[: want_p.size] != want_p[: got_p.size])} differ; scales "
          f"{got_s.size} vs {want_s.size}, "
          f"{np.count_nonzero(got_s[: want_s.size] != want_s[: got_s.size])} differ; "
          f"first payload {got_p[:8].tolist()} vs {want_p[:8].tolist()}, "
          f"first scales {got_s[:3].tolist()} vs {want_s[:3].tolist()}"
        )
    failures += not ok
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
    return device_int4.encode_delta([anchor_host], [theta]).to_host()

  anchor_dev = jax.device_put(anchor_host)

  def device_path_anchor_on_device():
    return device_int4.encode_delta([anchor_dev], [theta]).to_host()

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
  print(f"bit-exactness: {failures} failure(s)")
  if _TIMING.value > 0:
    _timing(_TIMING.value, rng)
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  app.run(main)
