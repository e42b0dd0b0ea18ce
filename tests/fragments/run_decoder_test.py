"""`RunDecoder`'s direct decoding (`Codec.decode_run_into`): bit for bit what `decode_run` gives."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.codecs import Bf16, Fp32, Int8
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
  for codec in (Fp32(), Int8()):  # Only bf16 has a direct decoding.
    assert not codec.decode_run_into(np.ones(4, np.uint8).tobytes(), np.zeros(1, np.float32))


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
