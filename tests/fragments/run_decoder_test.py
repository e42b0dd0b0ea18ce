"""Direct bf16 and int4 decoding (`Codec.decode_run_into`, `RunDecoder`) and the bf16 adoption
kernel: bit for bit what the ml_dtypes cast and `decode_run` give."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.codec import INTO_RUN_VALUES
from ddiloco.fragments.codecs import Bf16, Fp32, Int4, Int8
from ddiloco.fragments.run_decoder import RunDecoder


def _reference(codec, payload: bytes, n: int) -> np.ndarray:
  """The values as `decode_run` gives them, run by run (the path before direct decoding)."""
  return codec.decode_run(payload, 0, n, np.empty(0, np.float32))


def test_bf16_into_is_the_cast_for_every_bit_pattern():
  bits = np.arange(1 << 16, dtype=np.uint16)  # Every bfloat16, NaNs, infinities and zeros too.
  want = bits.view(ml_dtypes.bfloat16).astype(np.float32)
  out = np.full(bits.size, 7.0, np.float32)
  assert Bf16().decode_run_into(bits.astype("<u2").tobytes(), out)
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_bf16_into_refuses_what_it_cannot_write():
  payload = np.ones(4, "<u2").tobytes()
  assert not Bf16().decode_run_into(payload, np.zeros(4, np.float64))  # Not float32.
  assert not Bf16().decode_run_into(payload, np.zeros(8, np.float32)[::2])  # Not contiguous.
  with pytest.raises(ValueError):
    Bf16().decode_run_into(payload, np.zeros(3, np.float32))
  with pytest.raises(ValueError):
    Bf16().decode_run_into(payload[:-1], np.zeros(4, np.float32))  # Half a value.
  for codec in (Fp32(), Int8()):  # Only bf16 and int4 have a direct decoding.
    assert not codec.decode_run_into(np.ones(4, np.uint8).tobytes(), np.zeros(1, np.float32))


def _int4(n: int, block_size: int, seed: int = 0) -> tuple[Int4, bytes, np.ndarray]:
  """(codec, payload, scales) of n values with all-zero, subnormal-scale and huge blocks."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n).astype(np.float32)
  x[:block_size] = 0.0  # A zero scale.
  x[block_size : 2 * block_size] *= np.float32(1e-44)  # A subnormal scale.
  x[-1] = np.float32(3e38)  # q · s near float32's top.
  codec = Int4(block_size=block_size)
  runs = [(p.copy(), s.copy()) for p, s in codec.encode_runs(x)]  # Runs reuse their memory.
  return codec, b"".join(p.tobytes() for p, _ in runs), np.concatenate([s for _, s in runs])


@pytest.mark.parametrize("n", [1, 2, 129, 64 * 1000 + 3])
@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_int4_into_is_decode_run(n, block_size):
  codec, payload, scales = _int4(max(n, 2 * block_size + 1), block_size, seed=n)
  n = max(n, 2 * block_size + 1)
  want = codec.decode_run(payload, 0, n, scales)
  out = np.full(n, 7.0, np.float32)
  assert codec.decode_run_into(payload, out, start=0, scales=scales)
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
  # A run from a later block on, as `RunDecoder` cuts them.
  start = 2 * block_size * (n // (4 * block_size))
  rest = np.empty(n - start, np.float32)
  assert codec.decode_run_into(payload[start // 2 :], rest, start=start, scales=scales)
  np.testing.assert_array_equal(rest.view(np.uint32), want[start:].view(np.uint32))


def test_int4_into_decodes_every_valid_byte_as_decode_run():
  # Every byte of two codes in [1, 15] (q in [-7, 7]; code 8 is q = 0, +0.0 either way), under a
  # scale of 1 and one that rounds: `decode_run_into` forms q in int8 where `decode_run` forms
  # float32(code) − 8.
  codes = np.arange(1, 16, dtype=np.uint8)
  payload = (codes[:, None] | codes[None, :] << 4).reshape(-1).tobytes()
  codec = Int4(block_size=2)
  for scale in (np.float32(1), np.float32(0.1)):
    scales = np.full(len(payload), scale, np.float32)
    want = codec.decode_run(payload, 0, 2 * len(payload), scales)
    out = np.empty(2 * len(payload), np.float32)
    assert codec.decode_run_into(payload, out, scales=scales)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_int4_into_refuses_what_decode_run_refuses():
  codec, payload, scales = _int4(129, 64)
  out = np.empty(129, np.float32)
  bad = bytearray(payload)
  bad[3] &= 0xF0  # Code 0: q = -8.
  with pytest.raises(ValueError, match=r"outside \[-7, 7\]"):
    codec.decode_run_into(bytes(bad), out, scales=scales)
  bad = bytearray(payload)
  bad[-1] = (bad[-1] & 0x0F) | 0x90  # The padding nibble of an odd count must be 8.
  with pytest.raises(ValueError, match="padding"):
    codec.decode_run_into(bytes(bad), out, scales=scales)
  with pytest.raises(ValueError, match="65 bytes for 126 values"):
    codec.decode_run_into(payload, out[:126], scales=scales)
  with pytest.raises(ValueError, match="scales cover"):
    codec.decode_run_into(payload, out, scales=scales[:1])
  assert not codec.decode_run_into(payload[1:], out[2:], start=2, scales=scales)  # Mid-block.
  assert not codec.decode_run_into(payload, out.astype(np.float64), scales=scales)


@pytest.mark.parametrize("block_size", [64, 100])  # 100: runs start mid-block (`decode_run`).
def test_int4_runs_decode_as_before_and_report_their_progress(block_size):
  n = 3 * (1 << 16) + 101
  codec, payload, scales = _int4(n, block_size)
  out = np.full(n, 3.0, np.float32)
  done = []
  decoder = RunDecoder(codec, out, scales=scales, check=True, on_values=done.append)
  decoder.feed(payload)
  assert decoder.close() == 0
  want = codec.decode_run(payload, 0, n, scales)
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
  assert done == sorted(done) and done[-1] == n and len(done) == -(-n // INTO_RUN_VALUES)


@pytest.mark.parametrize("offset", [0, 1])  # Payloads sit at any byte offset of a chunk.
@pytest.mark.parametrize("piece", [1, 2, 3, 4097, 1 << 20])
def test_pieces_decode_as_before(offset, piece):
  rng = np.random.default_rng(piece + offset)
  n = 300_001
  values = rng.standard_normal(n).astype(np.float32) * np.float32(1e3)
  values[[5, 77, 300_000]] = [np.nan, np.inf, -0.0]
  payload = values.astype(ml_dtypes.bfloat16).view(np.uint16).astype("<u2").tobytes()
  buf = memoryview(bytes(offset) + payload)[offset:]
  out = np.full(n, 3.0, np.float32)
  decoder = RunDecoder(Bf16(), out, check=True)
  for i in range(0, len(buf), piece):
    decoder.feed(buf[i : i + piece])
  assert decoder.close() == 2  # The NaN and the Inf, counted as `_run` counts them.
  want = _reference(Bf16(), payload, n)
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_a_base_still_adds_as_before():
  rng = np.random.default_rng(1)
  n = 70_000
  base = rng.standard_normal(n).astype(np.float32)
  delta = rng.standard_normal(n).astype(np.float32)
  payload = delta.astype(ml_dtypes.bfloat16).view(np.uint16).astype("<u2").tobytes()
  out = np.empty(n, np.float32)
  decoder = RunDecoder(Bf16(), out, base=base)
  decoder.feed(payload)
  assert decoder.close() == 0
  np.testing.assert_array_equal(out, base + _reference(Bf16(), payload, n))


def test_too_long_a_payload_is_refused():
  out = np.empty(10, np.float32)
  decoder = RunDecoder(Bf16(), out)
  with pytest.raises(ValueError, match="more than the array's 10 values"):
    decoder.feed(np.zeros(11, "<u2").tobytes())


@pytest.mark.parametrize("n", [1, 1000, INTO_RUN_VALUES + 1, 2 * INTO_RUN_VALUES + 7000])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bf16_adoption_kernel_matches_the_cast(n, dtype):
  """The downlink's encode-and-adopt (`encode_run_into`) of bf16: the bytes of the plain
  encoding, and base + the values ml_dtypes decodes from them, bit for bit."""
  rng = np.random.default_rng(n)
  base = rng.standard_normal(n).astype(dtype)
  x = base.astype(np.float32) + rng.standard_normal(n).astype(np.float32) * np.float32(1e-2)
  if n > 10:
    x[3], base[3] = np.float32(-1e-9), -0.0  # A -0.0 delta on a -0.0 base.
    x[7] = np.float32(1e30)  # Far beyond the base: no rounding to it.
  into = np.full(n, np.nan, dtype)
  payload = b"".join(p.tobytes() for p, _ in Bf16().encode_runs(x, base=base, into=into))
  delta = x - base.astype(np.float32)
  want_bits = delta.astype(ml_dtypes.bfloat16)
  assert payload == want_bits.view(np.uint16).astype("<u2").tobytes()
  with np.errstate(over="ignore"):
    want = (base.astype(np.float32) + want_bits.astype(np.float32)).astype(dtype)
  np.testing.assert_array_equal(into.view(np.uint8), want.view(np.uint8))
  assert payload == b"".join(p.tobytes() for p, _ in Bf16().encode_runs(x, base=base))


def test_bf16_adoption_takes_finite_values_whose_squares_overflow():
  """The adoption proves a run finite by its dot product; one that overflows float32 while
  every value is finite (|x| ~ 1e20) is checked value by value, and taken."""
  x = np.full(10, 1e20, np.float32)
  x[2] = -3e38  # Within bfloat16's range.
  into = np.empty(10, np.float32)
  payload = b"".join(p.tobytes() for p, _ in Bf16().encode_runs(x, base=np.zeros(10), into=into))
  bits = x.astype(ml_dtypes.bfloat16)
  assert payload == bits.view(np.uint16).astype("<u2").tobytes()
  np.testing.assert_array_equal(into, bits.astype(np.float32))


def test_bf16_adoption_refuses_overflow():
  x = np.ones(10, np.float32)
  x[4] = np.finfo(np.float32).max  # Rounds to bfloat16's infinity.
  with pytest.raises(ValueError, match="overflow bfloat16"):
    list(Bf16().encode_runs(x, base=np.zeros(10, np.float32), into=np.empty(10, np.float32)))
