"""A fragment encoded in parts on threads (`fragment_encoder.encode_in_parts`) is one encoding of
the whole, byte for byte; a learner's link uses it for a large answer its host encodes."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.learner_process.link import SyncerLink
from ddiloco.protocol import Answer, HostTheta, ReportResult
from ddiloco.testing.wire import push_messages
from ddiloco.transport.fragment_encoder import (
  SPLIT_VALUES,
  FragmentEncoder,
  encode_in_parts,
  serialize_chunks,
)

SHAPES = {"a": (301, 7), "b": (64,), "c": (1,), "d": (4099,), "e": (2, 3, 5)}


def _values(seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def _serialized(values, codec, block_size, base=None, encoded=None) -> bytes:
  if encoded is not None:
    return b"".join(FragmentEncoder(values, codec, block_size=block_size, encoded=encoded).chunks())
  return b"".join(serialize_chunks(values, codec, block_size=block_size, base=base))


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("workers", [1, 2, 3, 8])
@pytest.mark.parametrize("block_size", [64, 7])
def test_parts_are_one_encoding_of_the_whole(codec, workers, block_size):
  anchor, theta = _values(0), _values(1)
  parts = encode_in_parts(anchor, codec, block_size=block_size, base=theta, workers=workers)
  assert sorted(parts) == sorted(SHAPES)
  whole = _serialized(anchor, codec, block_size, base=theta)
  assert _serialized(anchor, codec, block_size, encoded=parts) == whole


def test_without_a_base_and_with_bf16_values():
  values = _values(2, dtype=np.float32)
  values["b"] = values["b"].astype(ml_dtypes.bfloat16)
  parts = encode_in_parts(values, "int4", block_size=64, workers=3)
  assert _serialized(values, "int4", 64, encoded=parts) == _serialized(values, "int4", 64)


def test_what_a_receiver_decodes_is_filled_part_by_part():
  anchor, theta = _values(3), _values(4)
  received = {k: np.empty(np.size(v), np.float32) for k, v in anchor.items()}
  one = {k: np.empty(np.size(v), np.float32) for k, v in anchor.items()}
  encode_in_parts(anchor, "int4", base=theta, workers=3, received=received)
  encode_in_parts(anchor, "int4", base=theta, workers=1, received=one)
  for k in SHAPES:
    np.testing.assert_array_equal(received[k], one[k])


@pytest.mark.parametrize("workers", [1, 3])
def test_a_non_finite_value_is_refused_by_key_and_counted_over_its_array(workers):
  anchor, theta = _values(5), _values(6)
  theta["d"][[3, 4000]] = [np.nan, np.inf]
  with pytest.raises(ValueError, match=r"'d': Refusing to encode 2 non-finite value\(s\)"):
    encode_in_parts(anchor, "int4", base=theta, workers=workers)


def test_bad_workers_are_refused():
  with pytest.raises(ValueError, match="workers must be >= 1"):
    encode_in_parts(_values(0), "int4", workers=0)
  with pytest.raises(ValueError, match="encode_workers must be >= 1"):
    SyncerLink(None, learner_id=0, layouts=[{}], layout_digest="", encode_workers=0)


class _Client:
  """Records the arguments of each push, answers accepted."""

  def __init__(self):
    self.pushes = []

  def push(self, report, codec, **kwargs):
    self.pushes.append((report, codec, kwargs))
    return ReportResult("accepted", "", 1.0)


def _answer(theta, anchor) -> Answer:
  return Answer(
    learner_id=0,
    fragment=0,
    round_step=4,
    step=4,
    anchor_version=2,
    tokens=64,
    steps=2,
    new_tokens=64,
    theta=HostTheta(theta),
    anchor=anchor,
  )


@pytest.mark.parametrize("codec", ["bf16", "int4"])
def test_a_link_encodes_a_large_answer_in_parts_with_the_bytes_of_one_pass(codec):
  rng = np.random.default_rng(7)
  theta = {
    "w": rng.standard_normal((SPLIT_VALUES // 64 + 3, 64), dtype=np.float32),
    "b": rng.standard_normal(33, dtype=np.float32),
  }
  anchor = {k: v + np.float32(1e-3) for k, v in theta.items()}
  wires = []
  for workers in (1, 3):
    client = _Client()
    link = SyncerLink(client, learner_id=0, layouts=[{}], layout_digest="", encode_workers=workers)
    link.codec = codec
    assert link.push(_answer(theta, anchor)).status == "accepted"
    [(report, sent_codec, kwargs)] = client.pushes
    assert (kwargs.get("encoded") is not None) == (workers > 1)
    if workers > 1:
      assert not report.values  # θ stays home: only δ's bytes go.
    wires.append(b"".join(push_messages(report, sent_codec, **kwargs)))
  assert wires[0] == wires[1]


@pytest.mark.parametrize("size, codec", [(100, "int4"), (SPLIT_VALUES, "fp32")])
def test_a_link_streams_a_small_or_an_fp32_answer_in_one_pass(size, codec):
  theta = {"w": np.ones(size, np.float32)}
  client = _Client()
  link = SyncerLink(client, learner_id=0, layouts=[{}], layout_digest="", encode_workers=4)
  link.codec = codec
  link.push(_answer(theta, {"w": np.zeros(size, np.float32)}))
  assert client.pushes[0][2].get("encoded") is None


def test_a_link_refuses_a_non_finite_answer_before_sending():
  theta = {"w": np.ones(SPLIT_VALUES, np.float32)}
  theta["w"][5] = np.nan
  client = _Client()
  link = SyncerLink(client, learner_id=0, layouts=[{}], layout_digest="", encode_workers=2)
  link.codec = "int4"
  with pytest.raises(ValueError, match=r"'w': Refusing to encode 1 non-finite"):
    link.push(_answer(theta, {"w": np.zeros(SPLIT_VALUES, np.float32)}))
  assert not client.pushes
