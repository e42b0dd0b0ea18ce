"""The codec registry: one class per codec, a stable wire id, and nothing else to edit.

A codec added by one registered class is carried by the fragment wire format, its receivers'
view (`wire.received_values`) and the reader's checks without any other change.
"""

from typing import ClassVar

import numpy as np
import pytest

from ddiloco.fragments import codec, compression
from ddiloco.testing.wire import deserialize_fragment, serialize_fragment
from ddiloco.transport import wire
from ddiloco.transport.errors import WireError


def test_the_wire_ids_are_stable():
  # Written on the wire: changing one breaks every reader of an older writer.
  assert {name: compression.codec_class(name).wire_id for name in compression.CODECS} == {
    "fp32": 0,
    "bf16": 1,
    "int8": 2,
    "int4": 3,
  }
  assert compression.CODECS == ("fp32", "bf16", "int8", "int4")
  assert [c.name for c in map(compression.codec_by_wire_id, range(4))] == list(compression.CODECS)
  assert compression.codec_class("fp32").exact
  assert not any(compression.codec_class(n).exact for n in ("bf16", "int8", "int4"))
  assert [compression.codec_class(n).quantized for n in compression.CODECS] == [0, 0, 1, 1]


def test_unknown_names_and_ids_are_refused():
  with pytest.raises(ValueError, match="Unknown codec 'fp8'"):
    compression.get_codec("fp8")
  with pytest.raises(ValueError, match="Unknown codec id 9"):
    compression.codec_by_wire_id(9)
  with pytest.raises(TypeError, match="abstract"):
    codec.Codec()


@pytest.fixture
def fp16():
  """A float16 codec, defined and registered here only (wire id 200)."""

  @codec.register
  class Fp16(codec.Codec):
    name: ClassVar[str] = "fp16-test"
    wire_id: ClassVar[int] = 200
    unit_bytes: ClassVar[int] = 2

    def encode_run(self, x32):
      x16 = x32.astype(np.float16)
      if not np.isfinite(x16).all():
        raise ValueError("Values overflow float16.")
      return x16.astype("<f2", copy=False).view(np.uint8), np.empty(0, np.float32)

    def decode_run(self, payload, start, n, scales):
      del start, n, scales
      return np.frombuffer(payload, "<f2").astype(np.float32)

  yield Fp16
  del codec._REGISTRY[Fp16.name]


def test_a_codec_is_one_registered_class(fp16):
  rng = np.random.default_rng(0)
  values = {"a": rng.normal(size=(7, 5)).astype(np.float32), "b": np.arange(3, dtype=np.float32)}
  data = serialize_fragment(values, fp16.name)
  out = deserialize_fragment(
    data,
    list(values),
    {k: v.shape for k, v in values.items()},
    {k: v.dtype for k, v in values.items()},
    codec_name=fp16.name,
  )
  for k, v in values.items():
    np.testing.assert_array_equal(out[k], v.astype(np.float16).astype(np.float32))
  # What a receiver holds, without the framing, is the same bits.
  view = wire.received_values(values, fp16.name)
  for k in values:
    np.testing.assert_array_equal(view[k], out[k])
  # The wire names it by its id: the byte after the first key.
  assert bytes([fp16.wire_id]) in data


def test_a_clashing_or_incomplete_codec_is_refused(fp16):
  cases = (
    ({"name": fp16.name, "wire_id": 201}, "clashes"),
    ({"name": "other", "wire_id": fp16.wire_id}, "clashes"),
    ({"name": "big", "wire_id": 256}, "fit a byte"),
    ({"name": "nameless"}, "needs a `name`"),
  )
  for attrs, message in cases:
    with pytest.raises(ValueError, match=message):
      codec.register(type("Clash", (codec.Codec,), attrs))
  assert compression.codec_class(fp16.name) is fp16
  assert "other" not in compression.CODECS


def test_the_reader_refuses_an_unregistered_id():
  values = {"a": np.ones(4, np.float32)}
  data = bytearray(serialize_fragment(values, "fp32"))
  at = data.index(b"a") + 1  # The codec id follows the key.
  assert data[at] == 0
  data[at] = 77
  with pytest.raises(WireError, match="unknown codec id 77"):
    deserialize_fragment(bytes(data), ["a"], {"a": (4,)}, {"a": np.float32})
