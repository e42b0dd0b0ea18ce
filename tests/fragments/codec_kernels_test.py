"""The integer codecs' numpy kernels against the straightforward reference (docs/algorithm.md §5).

`codecs.py` quantizes and packs with fewer passes than the plain formulas (no clip where it
provably changes nothing, int4 nibbles packed and unpacked through uint16 pairs, scales broadcast
per block rather than repeated per value). The wire bytes and the decoded values must be the same
bits as the reference below, which is the codecs' earlier code, kept here as the specification.
"""

import numpy as np
import pytest

from ddiloco.fragments.codec import INTO_RUN_VALUES
from ddiloco.fragments.compression import get_codec

_TINY = np.finfo(np.float32).tiny


def _ref_quantize(flat: np.ndarray, qmax: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
  n = flat.size
  num_blocks = -(-n // bs)
  blocks = np.zeros(num_blocks * bs, np.float32)
  blocks[:n] = flat
  blocks = blocks.reshape(num_blocks, bs)
  scales = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype("<f4")
  safe = np.where(scales > 0, scales, np.float32(1))
  q = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int16)
  return q.ravel()[:n], scales


def _ref_encode(name: str, x32: np.ndarray, bs: int) -> tuple[bytes, bytes]:
  if name == "int8":
    q, scales = _ref_quantize(x32, 127, bs)
    return q.astype(np.int8).tobytes(), scales.tobytes()
  q, scales = _ref_quantize(x32, 7, bs)
  codes = (q + 8).astype(np.uint8)
  if codes.size % 2:
    codes = np.append(codes, np.uint8(8))
  return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8).tobytes(), scales.tobytes()


def _ref_decode(name: str, payload: bytes, start: int, n: int, *, scales: np.ndarray, bs: int):
  if name == "int8":
    q = np.frombuffer(payload, np.int8).astype(np.float32)
  else:
    packed = np.frombuffer(payload, np.uint8)
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2], codes[1::2] = packed & 0x0F, packed >> 4
    q = codes[: min(codes.size, n - start)].astype(np.float32) - np.float32(8)
  first = start // bs
  per_value = np.repeat(scales[first : -(-(start + q.size) // bs)], bs)
  per_value = per_value[start - first * bs : start - first * bs + q.size]
  return q * per_value


def _values(n: int, seed: int) -> np.ndarray:
  """Blocks of very different magnitudes, with all-zero, -0.0 and subnormal blocks among them:
  subnormal scales are where the clip matters (8 · 2^-149 / 7 rounds to 2^-149)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n).astype(np.float32)
  x *= np.repeat(10.0 ** rng.integers(-30, 30, size=n // 16 + 1), 16)[:n].astype(np.float32)
  tiny = np.arange(1, 17, dtype=np.float32) * np.float32(2.0**-149)  # Subnormals.
  x[: min(n, 16)] = tiny[: min(n, 16)]
  if n > 48:
    x[16:32] = 0.0
    x[32:48] = -0.0
    x[48 : min(n, 64)] = rng.standard_normal(min(n, 64) - 48) * np.float32(_TINY)
  return x


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bs", [64, 16, 7, 1])
@pytest.mark.parametrize("n", [1, 63, 64, 1000, 4097, 70_001])
def test_encode_and_decode_match_reference(name, bs, n):
  codec = get_codec(name, bs)
  x = _values(n, seed=n + bs)
  payload = b"".join(p.tobytes() for p, _ in codec.encode_runs(x))
  scales = b"".join(s.tobytes() for _, s in codec.encode_runs(x))
  want_payload, want_scales = _ref_encode(name, x, bs)
  assert payload == want_payload
  assert scales == want_scales
  s32 = codec.checked_scales(scales, n)
  # Whole payload, and runs starting at values that are not on a block boundary.
  unit = 2 if name == "int4" else 1
  for start in sorted({0, unit * (n // (2 * unit)), unit * ((n - 1) // unit)}):
    part = payload[start // unit :]
    got = codec.decode_run(part, start, n, s32)
    want = _ref_decode(name, part, start, n, scales=s32, bs=bs)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_int4_decode_refusals_unchanged():
  codec = get_codec("int4", 4)
  s32 = np.ones(1, np.float32)
  with pytest.raises(ValueError, match="padding nibble"):
    codec.decode_run(bytes([0x88, 0x08]), 0, 3, s32)  # Value 3 (a pad) must be code 8.
  with pytest.raises(ValueError, match="outside"):
    codec.decode_run(bytes([0x80]), 0, 2, s32)  # Code 0 in value 0.
  with pytest.raises(ValueError, match="past value"):
    codec.decode_run(bytes([0x88, 0x88]), 0, 2, s32)
  with pytest.raises(ValueError, match="scales cover"):
    codec.decode_run(bytes([0x88] * 4), 0, 8, s32)  # 8 values, scales for 4.


def _ref_received(name: str, x: np.ndarray, base: np.ndarray, bs: int) -> np.ndarray:
  """What a receiver holding `base` makes of the reference bytes of `x − base`: cast(base + q·s)."""
  delta = x.astype(np.float32) - base.astype(np.float32)
  payload, scales = _ref_encode(name, delta, bs)
  decoded = _ref_decode(name, payload, 0, x.size, scales=np.frombuffer(scales, "<f4"), bs=bs)
  with np.errstate(over="ignore"):
    return (base.astype(np.float32) + decoded).astype(base.dtype)


def _edge_pair(n: int, seed: int, dtype) -> tuple[np.ndarray, np.ndarray]:
  """(x, base) whose delta has `_values`' blocks (zeros, -0.0, subnormal scales, wide magnitudes),
  a base of -0.0 where q rounds to -0.0, and values at ±float32 max / 4 (the merge's limit)."""
  rng = np.random.default_rng(seed)
  base = rng.standard_normal(n).astype(np.float32)
  base[: min(n, 64) : 3] = -0.0
  delta = _values(n, seed)
  if n > 200:
    delta[100] = np.float32(-1e-9)  # Beside larger values: q = -0.0 on a -0.0 base.
    base[100] = -0.0
    delta[130] = np.finfo(np.float32).max / 4
    delta[131] = -np.finfo(np.float32).max / 4
  base = base.astype(dtype)
  with np.errstate(over="ignore"):
    x = (base.astype(np.float32) + delta).astype(np.float32)
  return x, base


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bs", [64, 16, 7, 1])
@pytest.mark.parametrize("n", [1, 63, 1000, 4097, INTO_RUN_VALUES + 1, 2 * INTO_RUN_VALUES + 7000])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_encode_into_matches_reference(name, bs, n, dtype):
  """The fused encode-and-adopt kernel (`encode_run_into`): the reference's bytes, and what a
  receiver decodes from them, base added, bit for bit (the larger n span several runs)."""
  codec = get_codec(name, bs)
  x, base = _edge_pair(n, seed=n + bs, dtype=dtype)
  into = np.full(n, np.nan, dtype)
  runs = [(p.tobytes(), s.tobytes()) for p, s in codec.encode_runs(x, base=base, into=into)]
  want_payload, want_scales = _ref_encode(name, x - base.astype(np.float32), bs)
  assert b"".join(p for p, _ in runs) == want_payload
  assert b"".join(s for _, s in runs) == want_scales
  want = _ref_received(name, x, base, bs)
  np.testing.assert_array_equal(into.view(np.uint8), want.view(np.uint8))
  # The bytes are those of the encoding without `into`.
  plain = b"".join(p.tobytes() for p, _ in codec.encode_runs(x, base=base))
  assert plain == want_payload


@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_into_refuses_non_finite(name, bad):
  codec = get_codec(name, 64)
  x, base = _edge_pair(INTO_RUN_VALUES + 5000, seed=3, dtype=np.float32)
  x[INTO_RUN_VALUES + 10] = bad  # In the second run.
  with pytest.raises(ValueError, match="1 non-finite"):
    list(codec.encode_runs(x, base=base, into=np.empty_like(x)))


def test_encode_into_needs_a_base_and_a_flat_output():
  codec = get_codec("int4", 64)
  x = np.ones(10, np.float32)
  for kwargs in (
    {"into": np.empty(10, np.float32)},
    {"base": x, "into": np.empty((2, 5), np.float32)},
    {"base": x, "into": np.empty(9, np.float32)},
    {"base": x, "into": np.empty(10, np.float32), "decoded": True},
  ):
    with pytest.raises(ValueError, match="`into` needs"):
      list(codec.encode_runs(x, **kwargs))
