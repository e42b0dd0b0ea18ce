"""The downlink of a lossy codec: the syncer publishes what a learner decodes (docs/algorithm.md §5).

With a lossy downlink codec the syncer sends Θ_new − Θ_old quantized and adopts what a receiver
decodes, so learners and syncer hold bit-identical fragments. The encoded delta is kept for the
newest version only; a learner that holds an older version (or none) gets the full values in fp32,
which is exact.
"""

from collections.abc import Mapping

import numpy as np

from ddiloco.fragments import compression
from ddiloco.syncer import blockwise
from ddiloco.transport import messages
from ddiloco.transport.fragment_encoder import serialize_chunks


class DownlinkAdopter:
  """The core's `adopt` hook for a lossy downlink codec, and the cache of the encoded deltas.

  At each merge it encodes Θ_new − Θ_old once, decodes it exactly as a learner holding Θ_old will,
  and returns that as the published value (docs/algorithm.md §5). The bytes are kept for the newest version.
  """

  def __init__(self, codec: str, *, block_size: int, chunk_size: int):
    if compression.codec_class(codec).exact:
      raise ValueError(f"{codec} needs no adoption: the syncer sends exact full values.")
    self._codec, self._block, self._chunk = codec, block_size, chunk_size
    self._staged: dict[int, list[bytes]] = {}
    self._cache: dict[int, tuple[int, list[bytes]]] = {}  # p -> (version, serialized chunks).

  def __call__(self, p: int, new: Mapping[str, np.ndarray], prev: Mapping[str, np.ndarray]):
    # The bytes are encoded once and kept: re-encoding adopted − prev need not give the same ints.
    # What a learner holding `prev` decodes from them is formed in the same pass, run by run
    # while each is in cache, from the encoding's own integers and scales with the operations of
    # the learner's decoder (`FragmentEncoder(received=...)`): bit-identical, without a decoding
    # pass (tests/distributed/downlink_test.py checks it against `read_layout`).
    keys = sorted(new)
    dtypes = [np.asarray(new[k]).dtype for k in keys]
    flats = blockwise.aligned_empties([(np.size(new[k]), d) for k, d in zip(keys, dtypes)])
    received = dict(zip(keys, flats))
    self._staged[p] = list(
      serialize_chunks(
        new,
        self._codec,
        block_size=self._block,
        base=prev,
        chunk_size=self._chunk,
        received=received,
      )
    )
    return {k: received[k].reshape(np.shape(new[k])) for k in keys}

  def published(self, p: int, version: int, digest: str) -> None:
    """Called (under the service lock) when version `version` of p, just adopted, is published.

    `digest` is the core's digest of the adopted values (MergeEvent.digest).
    """
    chunks = messages.encoded_state_messages(
      self._staged.pop(p),
      fragment=p,
      version=version,
      digest=digest,
      codec=self._codec,
      base_version=version - 1,
    )
    self._cache[p] = (version, chunks)

  def delta_chunks(self, p: int, version: int) -> list[bytes] | None:
    """The encoded update from version − 1 to `version` of p, if that is the newest cached, as
    serialized FragmentChunk messages: serialized once, sent to every learner as they are."""
    cached = self._cache.get(p)
    return cached[1] if cached is not None and cached[0] == version else None
