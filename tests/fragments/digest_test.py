"""Tests for ddiloco.fragments.digest (SPEC §4.7)."""

import hashlib

import ml_dtypes
import numpy as np

from ddiloco.fragments.digest import values_digest


def test_golden():
  # Hand-assembled: name, dtype name, repr(shape), raw bytes, in sorted name order; first 32 hex.
  a = np.array([1.0, 2.0], np.float32)
  h = hashlib.sha256(b"a" + b"float32" + b"(2,)" + a.tobytes()).hexdigest()[:32]
  assert values_digest({"a": a}) == h
  assert len(h) == 32


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
