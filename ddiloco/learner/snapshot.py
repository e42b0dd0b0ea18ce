"""θ_p of one answer, held on the devices until a sender needs it (`Learner.snapshot_report`).

A sender either has the devices encode δ = Θ^(anchor) − θ_p in the uplink's codec
(`FragmentSnapshot.encode_delta`, fragments/device_codec.py) and copies only the encoded bytes
(0.5 + 4 / block_size per value with int4, 2 with bf16, instead of θ_p's 4) while its host does no
per-value work, or copies θ_p to host memory (`FragmentSnapshot()`) and encodes δ there. The first
is the default on accelerators (`LearnerConfig.device_encode`). On XLA's CPU backend the "device" is
the host itself, and its program measured 4x the CPU time of the numpy codec on the tiny model's
fragments (bench_learner_overhead.py's docs), so there the host path is the default.
"""

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from ddiloco.fragments import device_codec
from ddiloco.fragments.layout import FragmentLayout
from ddiloco.protocol import EncodedDelta


class FragmentSnapshot:
  """θ_p of one answer on the devices (see module docstring).

  Args:
    layout: the fragment layout.
    p: the fragment.
    names: the leaves fragment p touches.
    arrays: their arrays, readable on this host (host copies already started).
    device_encode: whether `encode_delta` encodes on the devices (False: it declines).
  """

  def __init__(
    self,
    layout: FragmentLayout,
    p: int,
    names: Sequence[str],
    arrays: Sequence[jax.Array],
    *,
    device_encode: bool,
  ):
    self._layout = layout
    self._p = p
    self._names = list(names)
    self._arrays = list(arrays)
    self.device_encode = device_encode

  def __call__(self) -> dict[str, np.ndarray]:
    """θ_p in host memory, keyed as the layout keys it (one transfer)."""
    host = jax.device_get(self._arrays)
    return self._layout.select({k: np.asarray(v) for k, v in zip(self._names, host)}, self._p)

  def encode_delta(
    self, codec: str, anchor: Mapping[str, np.ndarray], block_size: int
  ) -> EncodedDelta | None:
    """δ = anchor − θ_p encoded on the devices in `codec`, in host memory; None where the host must
    encode (`device_encode` off, a codec without a device program, a fragment with no valid device
    encoding, such as one with a NaN/Inf that the host codec then refuses by name:
    `DeviceEncoding.valid`, or a device error such as out of memory).

    Raises:
      ValueError: if `anchor` lacks a key of the fragment or has another shape.
    """
    if not self.device_encode or codec not in device_codec.CODECS:
      return None
    theta = self._layout.select(dict(zip(self._names, self._arrays)), self._p)
    keys = sorted(theta)
    missing = [k for k in keys if k not in anchor]
    if missing:
      raise ValueError(f"The anchor lacks keys {missing[:3]} of fragment {self._p}.")
    try:
      encoding = device_codec.encode_delta(
        [anchor[k] for k in keys], [theta[k] for k in keys], codec=codec, block_size=block_size
      )
      valid, pairs = encoding.to_host()
    except jax.errors.JaxRuntimeError:  # E.g. out of device memory: the host path still works.
      return None
    if not valid:
      return None
    return EncodedDelta(codec, block_size, dict(zip(keys, pairs)))
