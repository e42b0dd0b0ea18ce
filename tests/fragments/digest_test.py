"""Tests for ddiloco.fragments.digest (docs/algorithm.md §4.7)."""

import ml_dtypes
import numpy as np
import xxhash

from ddiloco.fragments.digest import values_digest


def _field(b: bytes) -> bytes:
  return len(b).to_bytes(8, "little") + b


def test_golden():
  # Hand-assembled: per leaf in sorted name order, the length-prefixed name, dtype name and
  # repr(shape), then the raw bytes; XXH3-128 as 32 hex digits.
  a = np.array([1.0, 2.0], np.float32)
  b = np.array([7], np.int8)
  stream = _field(b"a") + _field(b"float32") + _field(b"(2,)") + a.tobytes()
  stream += _field(b"b") + _field(b"int8") + _field(b"(1,)") + b.tobytes()
  h = xxhash.xxh3_128(stream).hexdigest()
  assert values_digest({"b": b, "a": a}) == h
  assert len(h) == 32


def test_field_boundaries_cannot_be_shifted():
  # Without length prefixes, name "ab" + dtype "c..." and name "a" + dtype "bc..." could collide.
  a = np.zeros(2, np.float32)
  assert values_digest({"a": a, "b": a}) != values_digest({"ab": a})


def test_order_independent():
  a, b = np.arange(4, dtype=np.float32), np.ones((2, 2), np.float32)
  assert values_digest({"a": a, "b": b}) == values_digest({"b": b, "a": a})


def test_sensitivity():
  a = np.arange(6, dtype=np.float32)
  base = values_digest({"a": a})
  flipped = a.copy()
  flipped.view(np.uint32)[3] ^= 1  # One low mantissa bit.
  assert values_digest({"a": flipped}) != base
  assert values_digest({"a": a.reshape(2, 3)}) != base  # Same bytes, other shape.
  assert values_digest({"a": a.view(np.int32)}) != base  # Same bytes, other dtype.
  assert values_digest({"b": a}) != base  # Other name.
  assert values_digest({"a": a, "b": a[:0]}) != base  # An extra empty leaf still counts.
  # Non-contiguous views digest like their contiguous copies; bf16 dtypes are named.
  strided = np.arange(12, dtype=np.float32)[::2]
  assert values_digest({"a": strided}) == values_digest({"a": strided.copy()})
  bf = a.astype(ml_dtypes.bfloat16)
  assert values_digest({"a": bf}) != values_digest({"a": bf.view(np.float16)})


def test_visit_sees_every_block_and_leaves_the_digest_unchanged():
  a, b = np.arange(10, dtype=np.float32), np.ones((2, 3), ml_dtypes.bfloat16)
  seen = []
  got = values_digest(
    {"b": b, "a": a}, visit=lambda k, blk: seen.append((k, blk.copy())), block_values=4
  )
  assert got == values_digest({"a": a, "b": b})
  assert [k for k, _ in seen] == ["a", "a", "a", "b", "b"]  # Name order, blocks of 4 values.
  np.testing.assert_array_equal(np.concatenate([blk for k, blk in seen if k == "a"]), a)
  assert all(blk.dtype == ml_dtypes.bfloat16 for k, blk in seen if k == "b")
