"""Tests for the codecs of ddiloco.fragments.codecs (docs/algorithm.md §5)."""

import hashlib
import pickle
import subprocess
import sys
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.codecs import Int4
from ddiloco.fragments.compression import get_codec
from ddiloco.testing.codecs import (
  Encoded,
  decode,
  decode_fragment,
  encode,
  encode_fragment,
  fragment_wire_bytes,
  roundtrip,
)


def _normal(n: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  # Blocks with very different magnitudes, so per-block scales matter.
  return (
    rng.normal(size=n) * np.repeat(10.0 ** rng.integers(-4, 3, size=n // 8 + 1), 8)[:n]
  ).astype(np.float32)


def test_fp32_exact():
  x = _normal(1000).reshape(10, 100)
  enc = encode(get_codec("fp32"), x)
  assert enc.nbytes == 4000
  out = decode(get_codec("fp32"), enc)
  assert out.dtype == np.float32 and out.shape == (10, 100)
  np.testing.assert_array_equal(out, x)


def test_bf16_round_to_nearest():
  x = _normal(1000)
  enc = encode(get_codec("bf16"), x)
  assert enc.nbytes == 2000
  out = decode(get_codec("bf16"), enc)
  # bf16 keeps 8 significant bits: round-to-nearest errs by at most half an ulp = 2^-8 relative.
  assert np.all(np.abs(out - x) <= np.abs(x) * 2.0**-8)
  exact = np.array([1.5, -0.25, 0.0, 3.0, -1024.0], np.float32)
  np.testing.assert_array_equal(roundtrip(get_codec("bf16"), exact), exact)


def _block_absmax(x: np.ndarray, block: int) -> np.ndarray:
  n = x.size
  padded = np.zeros(-(-n // block) * block, np.float32)
  padded[:n] = np.abs(x.ravel())
  return np.repeat(padded.reshape(-1, block).max(axis=1), block)[:n]


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("block_size", [64, 128, 7])
def test_int_error_bound(name, qmax, block_size):
  x = _normal(1000, seed=block_size)
  codec = get_codec(name, block_size)
  out = roundtrip(codec, x)
  # Rounding to the nearest multiple of s = absmax/qmax errs by at most s/2; a few float32 ulps of
  # slack cover the float32 division and multiplication.
  bound = _block_absmax(x, block_size) / qmax / 2
  assert np.all(np.abs(out - x) <= bound * (1 + 1e-5) + 1e-30)
  # The block maximum itself is reproduced up to float32 rounding (q = ±qmax).
  assert np.abs(out).max() == pytest.approx(np.abs(x).max(), rel=1e-6)


def test_wire_sizes():
  x = _normal(1000)
  # int4: 1000 values -> 500 bytes; ceil(1000/64) = 16 blocks -> 16 float32 scales = 64 bytes.
  assert encode(get_codec("int4"), x).nbytes == 500 + 16 * 4
  # int8: 1000 bytes + the same 64 bytes of scales.
  assert encode(get_codec("int8"), x).nbytes == 1000 + 64
  # Block 128: ceil(1000/128) = 8 scales.
  assert encode(get_codec("int4", 128), x).nbytes == 500 + 8 * 4
  # Odd count: 5 values -> 3 bytes (last high nibble is padding) + 1 scale.
  assert encode(get_codec("int4"), x[:5]).nbytes == 3 + 4
  frag = encode_fragment({"a": x, "b": x[:5]}, "int4")
  assert fragment_wire_bytes(frag) == 564 + 7


def test_int8_hand_example():
  # absmax 1 -> s = 1/127; x/s = 127, -63.5, 31.75, 0 -> rint (ties to even) = 127, -64, 32, 0.
  x = np.array([1.0, -0.5, 0.25, 0.0], np.float32)
  enc = encode(get_codec("int8", 4), x)
  assert enc.payload == bytes([127, 256 - 64, 32, 0])
  s = np.float32(1.0) / np.float32(127)
  assert enc.scales == s.astype("<f4").tobytes()
  expected = np.array([127, -64, 32, 0], np.float32) * s
  np.testing.assert_array_equal(decode(get_codec("int8", 4), enc), expected)


def test_int4_hand_example():
  # absmax 7 -> s = 1; q = 7, -7, rint(3.5) = 4, 1, 0; codes q+8 = 15, 1, 12, 9, 8 (+ pad 8).
  # Bytes, low nibble first: 15 | 1<<4 = 0x1F, 12 | 9<<4 = 0x9C, 8 | 8<<4 = 0x88.
  x = np.array([7.0, -7.0, 3.5, 1.0, 0.0], np.float32)
  enc = encode(get_codec("int4"), x)
  assert enc.payload == bytes([0x1F, 0x9C, 0x88])
  assert enc.scales == np.float32(1.0).astype("<f4").tobytes()
  np.testing.assert_array_equal(decode(get_codec("int4"), enc), [7, -7, 4, 1, 0])


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_zero_blocks(name):
  x = np.zeros(130, np.float32)
  x[64:] = np.linspace(-1, 1, 66)  # Block 0 all zero, blocks 1-2 not.
  codec = get_codec(name)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # No divide-by-zero / invalid-value warnings.
    enc = encode(codec, x)
    out = decode(codec, enc)
  assert np.frombuffer(enc.scales, "<f4")[0] == 0.0
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[:64], 0.0)
  np.testing.assert_array_equal(roundtrip(codec, np.zeros(5, np.float32)), np.zeros(5))


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(), (0, 3), (3, 5, 7), (1,)])
def test_shapes_and_dtype_recorded(name, shape):
  x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) - 3.0
  enc = encode(get_codec(name), x.astype(ml_dtypes.bfloat16))
  assert enc.dtype == "bfloat16"
  assert enc.shape == shape
  out = decode(get_codec(name), enc)
  assert out.shape == shape and out.dtype == np.float32


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(name, bad):
  x = np.ones(100, np.float32)
  x[70] = bad
  with pytest.raises(ValueError, match="1 non-finite"):
    encode(get_codec(name), x)
  with pytest.raises(ValueError, match="'w': Refusing"):
    encode_fragment({"ok": np.ones(3), "w": x}, name)


def test_out_of_range_rejected():
  with pytest.raises(ValueError, match="overflow bfloat16"):
    encode(get_codec("bf16"), np.array([3.4e38], np.float32))
  # Encoded with what a receiver decodes formed alongside (`into`, the downlink's adoption).
  x, into = np.array([1.0, 3.4e38], np.float32), np.empty(2, np.float32)
  with pytest.raises(ValueError, match="overflow bfloat16"):
    list(get_codec("bf16").encode_runs(x, base=np.zeros(2, np.float32), into=into))
  with pytest.raises(ValueError, match="non-finite"), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # numpy warns about the float64 -> float32 overflow.
    encode(get_codec("int8"), np.array([1e300]))


def test_decode_rejects_malformed():
  x = np.linspace(-1, 1, 10, dtype=np.float32)
  enc = encode(get_codec("int8"), x)
  with pytest.raises(ValueError, match="cannot decode with 'int4'"):
    decode(get_codec("int4"), enc)
  with pytest.raises(ValueError, match="block_size 64, codec has 32"):
    decode(get_codec("int8", 32), enc)
  with pytest.raises(ValueError, match="payload has 9 bytes, expected 10"):
    decode(get_codec("int8"), Encoded(**{**vars(enc), "payload": enc.payload[:9]}))
  with pytest.raises(ValueError, match="outside"):
    decode(get_codec("int8"), Encoded(**{**vars(enc), "payload": bytes([128]) + enc.payload[1:]}))
  with pytest.raises(ValueError, match="scales has 0 bytes"):
    decode(get_codec("int8"), Encoded(**{**vars(enc), "scales": b""}))
  neg = np.float32(-1).astype("<f4").tobytes()
  with pytest.raises(ValueError, match="non-negative"):
    decode(get_codec("int8"), Encoded(**{**vars(enc), "scales": neg}))
  enc4 = encode(get_codec("int4"), x[:3])  # Codes ..., pad 8 in the high nibble of byte 1.
  with pytest.raises(ValueError, match="outside"):
    decode(
      get_codec("int4"), Encoded(**{**vars(enc4), "payload": bytes([0x80]) + enc4.payload[1:]})
    )
  with pytest.raises(ValueError, match="padding"):
    decode(
      get_codec("int4"), Encoded(**{**vars(enc4), "payload": enc4.payload[:1] + bytes([0x08])})
    )
  with pytest.raises(ValueError, match="'k': Encoded with block_size 0, codec has 64"):
    decode_fragment({"k": Encoded(**{**vars(enc), "codec": "int8", "block_size": 0})})


def test_codec_validation():
  with pytest.raises(ValueError, match="Unknown codec 'int2'"):
    get_codec("int2")
  with pytest.raises(ValueError, match="block_size must be >= 1"):
    get_codec("int8", 0)
  assert get_codec("int4", 128) == Int4(block_size=128)


def test_fragment_round_trip_and_jax_input():
  values = {"a": _normal(300).reshape(3, 100), "b": jnp.linspace(-2, 2, 17)}
  for name in ["fp32", "bf16", "int8", "int4"]:
    enc = encode_fragment(values, get_codec(name))
    assert sorted(enc) == ["a", "b"] and all(e.codec == name for e in enc.values())
    out = decode_fragment(enc)
    assert out["a"].shape == (3, 100) and out["b"].shape == (17,)
  np.testing.assert_array_equal(decode_fragment(encode_fragment(values, "fp32"))["a"], values["a"])


_DECODE_IN_CHILD = """
import hashlib, pickle, sys
from ddiloco.testing.codecs import decode_fragment
out = decode_fragment(pickle.loads(sys.stdin.buffer.read()))
print(hashlib.sha256(b"".join(out[k].tobytes() for k in sorted(out))).hexdigest())
"""


@pytest.mark.integration
def test_deterministic_and_bit_identical_across_processes():
  x = _normal(1000, seed=3)
  enc = encode_fragment({n: x for n in ["w"]}, "int4")
  assert encode_fragment({"w": x.copy()}, "int4") == enc  # Same bytes every time.
  encoded = {name: encode(get_codec(name), x) for name in ["fp32", "bf16", "int8", "int4"]}
  here = decode_fragment(encoded)
  digest = hashlib.sha256(b"".join(here[k].tobytes() for k in sorted(here))).hexdigest()
  child = subprocess.run(
    [sys.executable, "-c", _DECODE_IN_CHILD],
    input=pickle.dumps(encoded),
    capture_output=True,
    check=True,
    timeout=120,
  )
  assert child.stdout.decode().strip() == digest
