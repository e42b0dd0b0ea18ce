"""The downlink of a lossy codec: the syncer publishes what a learner decodes (docs/algorithm.md §5).

With a lossy downlink codec the syncer sends Θ_new − Θ_old quantized and adopts what a receiver
decodes, so learners and syncer hold bit-identical fragments. The encoded delta is kept for the
newest version only; a learner that holds an older version (or none) gets the full values in fp32,
which is exact.
"""

import os
import sys
from collections.abc import Mapping

import numpy as np

from ddiloco.fragments import compression
from ddiloco.syncer import blockwise
from ddiloco.transport import state_messages
from ddiloco.transport.chunks import ArrayPool
from ddiloco.transport.fragment_encoder import SPLIT_VALUES, FragmentEncoder, encode_in_parts


class DownlinkAdopter:
  """The core's `adopt` hook for a lossy downlink codec, and the cache of the encoded deltas.

  At each merge it encodes Θ_new − Θ_old once, decodes it exactly as a learner holding Θ_old will,
  and returns that as the published value (docs/algorithm.md §5). The bytes are kept for the
  newest version.

  The encoding of a large fragment is split into `workers` parts of about equal size, each encoded
  on its own thread (numpy releases the GIL in its loops): every value's bytes, scales and adopted
  value depend only on its own block, so parts cut at block (and int4 byte) boundaries give the
  bytes of one encoding of the whole (checked in tests/service/downlink_test.py). The merge
  holds the service's lock while it adopts, so its wall time is what pushes and pulls wait.
  """

  def __init__(
    self,
    codec: str,
    *,
    block_size: int,
    chunk_size: int,
    workers: int | None = None,
    split_values: int = SPLIT_VALUES,
  ):
    """Args: `workers`, threads per adoption: None for 2, or 1 on a process allowed one CPU (a
    pinned shard, where a second thread only adds switches); `split_values`: fragments of fewer
    values are adopted on the calling thread alone.

    Raises:
      ValueError: for an exact codec or workers < 1.
    """
    if compression.codec_class(codec).exact:
      raise ValueError(f"{codec} needs no adoption: the syncer sends exact full values.")
    if workers is None:
      workers = min(2, len(os.sched_getaffinity(0)))
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}.")
    self._codec, self._block, self._chunk = codec, block_size, chunk_size
    self._workers, self._split = workers, split_values
    # p -> (its chunks as `state_messages.staged_prefix` cuts them, payload bytes), till published.
    self._staged: dict[int, tuple[list[bytes | memoryview], int]] = {}
    # p -> (version, serialized chunks: after the first, each in memory of its own).
    self._cache: dict[int, tuple[int, list[bytes | memoryview]]] = {}
    self._encoded = blockwise.OutputBuffer()  # Payloads and scales, reused by every adoption.
    # The adopted values (published versions) in the memory of versions no longer held: fresh
    # pages cost the kernel's zeroing, ~8 % of a bf16 shard's CPU (scripts/bench_ingest.py); kept
    # within the most ever held at once, the pool adds nothing to the process's peak.
    self._pool = ArrayPool(sys.maxsize, within_peak=True)

  def __call__(self, p: int, new: Mapping[str, np.ndarray], prev: Mapping[str, np.ndarray]):
    # The bytes are encoded once and kept: re-encoding adopted − prev need not give the same ints.
    # What a learner holding `prev` decodes from them is formed in the same pass, run by run
    # while each is in cache, from the encoding's own integers and scales with the operations of
    # the learner's decoder (`Codec.encode_runs(into=)`): bit-identical, without a decoding pass
    # (tests/service/downlink_test.py checks it against `read_layout`).
    keys = sorted(new)
    dtypes = [np.asarray(new[k]).dtype for k in keys]
    specs = [(np.size(new[k]), d) for k, d in zip(keys, dtypes)]
    flats = blockwise.aligned_empties(specs, lambda nbytes: self._pool.empty(nbytes, np.uint8))
    received = dict(zip(keys, flats))
    total = sum(np.size(new[k]) for k in keys)
    if self._workers > 1 and total >= self._split:
      encoder = self._split_encoder(new, prev, received)
    else:
      encoder = FragmentEncoder(
        new, self._codec, block_size=self._block, base=prev, received=received
      )
    # Each chunk after the first is made whole (its message) in its one copy; the first gets its
    # header, which holds the digest of the adopted values, when published.
    chunks = list(encoder.chunks(self._chunk, state_messages.staged_prefix))
    self._staged[p] = (chunks, encoder.nbytes)
    return {k: received[k].reshape(np.shape(new[k])) for k in keys}

  def _split_encoder(self, new, prev, received) -> FragmentEncoder:
    """The encoder of `serialize_chunks(new, base=prev, received=received)`'s bytes, encoded in
    parts on `workers` threads (see the class docstring), `received` filled."""
    encoded = encode_in_parts(
      new,
      self._codec,
      block_size=self._block,
      base=prev,
      workers=self._workers,
      received=received,
      allocate=self._encoded.arrays,
    )
    return FragmentEncoder(new, self._codec, block_size=self._block, encoded=encoded)

  def published(self, p: int, version: int, digest: str) -> None:
    """Called (under the service lock) when version `version` of p, just adopted, is published.

    `digest` is the core's digest of the adopted values (MergeEvent.digest).
    """
    staged, payload_bytes = self._staged.pop(p)
    chunks = state_messages.headed_state_messages(
      staged,
      payload_bytes,
      fragment=p,
      version=version,
      digest=digest,
      codec=self._codec,
      base_version=version - 1,
    )
    self._cache[p] = (version, chunks)

  def delta_chunks(self, p: int, version: int) -> list[bytes | memoryview] | None:
    """The encoded update from version − 1 to `version` of p, if that is the newest cached, as
    serialized FragmentChunk messages: serialized once, sent to every learner as they are."""
    cached = self._cache.get(p)
    return cached[1] if cached is not None and cached[0] == version else None
