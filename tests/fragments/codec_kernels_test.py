"""The integer codecs' numpy kernels against the straightforward reference (docs/algorithm.md §5).

`codecs.py` quantizes and packs with fewer passes than the plain formulas (no clip where it
provably changes nothing, int4 nibbles packed and unpacked through uint16 pairs, scales broadcast
per block rather than repeated per value). The wire bytes and the decoded values must be the same
bits as the reference below, which is the codecs' earlier code, kept here as the specification.
"""

import numpy as np
import pytest

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
