"""An answer's snapshot (`learner/snapshot.py`): δ encoded on the devices, in every codec, is the
host path's wire byte for byte on CPU; the cases with no valid device encoding fall back to the
host, which refuses what must be refused."""

import dataclasses

import jax
import numpy as np
import pytest

from ddiloco.fragments import device_codec
from ddiloco.fragments import layout as layout_lib
from ddiloco.learner.snapshot import FragmentSnapshot
from ddiloco.protocol import Report
from ddiloco.testing.wire import push_messages


def _layout(split_large=False):
  rng = np.random.default_rng(0)
  flat = {
    "a/kernel": rng.standard_normal((48, 40)).astype(np.float32),
    "a/bias": rng.standard_normal(41).astype(np.float32),
    "b/kernel": rng.standard_normal((64, 33)).astype(np.float32),
  }
  return flat, layout_lib.make_layout(flat, num_fragments=2, split_large=split_large)


def _snapshot(flat, layout, p, *, device_encode=True):
  names = sorted({layout_lib.parse_key(k)[0] for k in layout.fragments[p]})
  arrays = [jax.device_put(flat[n]) for n in names]
  return FragmentSnapshot(layout, p, names, arrays, device_encode=device_encode)


def _wire(report, anchor, encoded=None, codec="int4", block_size=64):
  return b"".join(
    push_messages(report, codec, block_size=block_size, anchor_values=anchor, encoded=encoded)
  )


def _report(p, values):
  return Report(
    learner_id=3,
    fragment=p,
    values=values,
    tokens=10,
    steps=2,
    anchor_version=4,
    step=7,
    round_step=7,
  )


@pytest.mark.parametrize("codec", device_codec.CODECS)
@pytest.mark.parametrize("block_size", [64, 32])
@pytest.mark.parametrize("split_large", [False, True], ids=["whole", "split"])
def test_device_encoded_push_is_the_host_push_byte_for_byte(codec, block_size, split_large):
  flat, layout = _layout(split_large)
  rng = np.random.default_rng(1)
  for p in range(layout.num_fragments):
    snap = _snapshot(flat, layout, p)
    theta = snap()
    anchor = {
      k: (v + rng.standard_normal(v.shape).astype(np.float32) * np.float32(0.01)).astype(v.dtype)
      for k, v in theta.items()
    }
    encoded = snap.encode_delta(codec, anchor, block_size)
    assert encoded is not None and encoded.codec == codec and encoded.block_size == block_size
    assert set(encoded.entries) == set(theta)
    host = _wire(_report(p, theta), anchor, codec=codec, block_size=block_size)
    device = _wire(_report(p, {}), anchor, encoded.entries, codec=codec, block_size=block_size)
    assert device == host


def test_the_host_encodes_where_the_device_declines():
  flat, layout = _layout()
  snap = _snapshot(flat, layout, 0)
  theta = snap()
  anchor = {k: v + np.float32(1) for k, v in theta.items()}
  assert snap.encode_delta("fp8", anchor, 64) is None  # No device program: the host's to refuse.
  assert _snapshot(flat, layout, 0, device_encode=False).encode_delta("int4", anchor, 64) is None
  bad = dict(anchor)
  key = sorted(bad)[0]
  bad[key] = bad[key].copy()
  bad[key].flat[0] = np.nan  # The numpy codec refuses it; the device program must not guess.
  for codec in device_codec.CODECS:
    assert snap.encode_delta(codec, bad, 64) is None
    with pytest.raises(ValueError, match=r"non-finite|NaN"):
      _wire(_report(0, theta), bad, codec=codec)
  with pytest.raises(ValueError, match="lacks keys"):
    snap.encode_delta("int4", {}, 64)


def test_a_push_with_a_wrongly_sized_encoding_is_refused():
  flat, layout = _layout()
  snap = _snapshot(flat, layout, 1)
  theta = snap()
  anchor = {k: v + np.float32(1) for k, v in theta.items()}
  encoded = snap.encode_delta("int4", anchor, 64)
  key = sorted(encoded.entries)[0]
  payload, scales = encoded.entries[key]
  broken = dataclasses.replace(encoded, entries={**encoded.entries, key: (payload[:-1], scales)})
  with pytest.raises(ValueError, match="encoded as"):
    _wire(_report(1, {}), anchor, broken.entries)


def test_a_device_error_leaves_the_encoding_to_the_host(monkeypatch):
  flat, layout = _layout()
  snap = _snapshot(flat, layout, 0)
  anchor = {k: v + np.float32(1) for k, v in snap().items()}

  def fail(*args, **kwargs):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

  monkeypatch.setattr(device_codec, "encode_delta", fail)
  assert snap.encode_delta("int4", anchor, 64) is None
