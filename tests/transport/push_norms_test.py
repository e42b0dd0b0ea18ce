"""A delta push's norms summed by the receiving transport as its values arrive (`Report.sq_norms`):
the very bits the syncer's door sums itself, and the same filing and merge."""

import dataclasses
import time

import numpy as np
import pytest

from ddiloco.protocol import Report
from ddiloco.syncer import blockwise, merge
from ddiloco.syncer.core import SyncerConfig, SyncerCore
from ddiloco.testing.wire import push_messages
from ddiloco.transport import messages
from ddiloco.transport.chunks import ArrayPool

B = blockwise.BLOCK_VALUES
# Sizes below, at and across a block; an array that is not float32 has no sum of its own.
SHAPES = {"a": (3 * B + 17,), "b": (B,), "c": (5, 7), "d": (2 * B - 1,)}
KEYS = sorted(SHAPES)
ANCHOR = {
  k: np.random.default_rng(i).standard_normal(s, dtype=np.float32)
  for i, (k, s) in enumerate(SHAPES.items())
}


def _report(theta, step: int = 1) -> Report:
  return Report(
    learner_id=0,
    fragment=0,
    values=theta,
    tokens=10,
    steps=1,
    anchor_version=0,
    step=step,
    round_step=1,
  )


def _theta(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(100 + seed)
  return {
    k: a - np.float32(1e-2) * rng.standard_normal(a.shape, dtype=np.float32)
    for k, a in ANCHOR.items()
  }


def _decode(chunks, *, check_finite: bool = False) -> Report:
  return messages.chunks_to_report(
    chunks,
    KEYS,
    SHAPES,
    {k: np.float32 for k in KEYS},
    max_chunk_bytes=1 << 20,
    alloc=ArrayPool(0).empty,
    check_finite=check_finite,
  )


# Chunks that end mid-value (1001 bytes), and in whole blocks' worth; every codec decodes into
# float32 (bf16 and int4 sum each run as it is decoded).
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int4"])
@pytest.mark.parametrize("chunk", [1001, 4 * B + 12, 1 << 20])
def test_the_sums_are_the_doors_bit_for_bit(chunk, codec):
  theta = _theta(0)
  report = _decode(push_messages(_report(theta), codec, chunk_size=chunk, anchor_values=ANCHOR))
  assert report.outer_gradient and sorted(report.sq_norms) == KEYS
  for k in KEYS:
    if codec == "fp32":
      np.testing.assert_array_equal(report.values[k], ANCHOR[k] - theta[k])
    want = merge.finite_sq_norm(None, report.values[k])
    assert report.sq_norms[k] == want  # Exactly: the same block dot products, added in order.


def test_no_sums_when_the_receiver_checks_itself_or_for_theta():
  theta = _theta(1)
  checked = _decode(push_messages(_report(theta), "fp32", anchor_values=ANCHOR), check_finite=True)
  assert checked.sq_norms is None
  plain = _decode(push_messages(_report(theta), "fp32"))
  assert not plain.outer_gradient and plain.sq_norms is None


def test_a_non_finite_block_has_no_sum_and_the_door_refuses_it():
  delta = {k: ANCHOR[k] - _theta(2)[k] for k in KEYS}
  delta["a"][B + 5] = np.nan
  delta["d"][-1] = np.inf
  encoded = {k: (v.reshape(-1).view(np.uint8), np.empty(0, np.float32)) for k, v in delta.items()}
  report = _decode(push_messages(_report(_theta(2)), "fp32", anchor_values=ANCHOR, encoded=encoded))
  assert sorted(report.sq_norms) == ["b", "c"]
  core = _core()
  result = core.report(report, copy=False)
  assert result.status == "rejected" and "'a'" in result.reason


def _core() -> SyncerCore:
  core = SyncerCore(
    fragment_keys=[KEYS],
    init_values=ANCHOR,
    config=SyncerConfig(min_quorum=2, use_grace=False),
    clock=time.monotonic,
  )
  for learner in (0, 1):
    core.register(learner)
    core.mark_delivered(learner, 0, 0)
  core.open_round(0, 1)
  return core


def test_filing_with_the_sums_merges_the_same_bits():
  """Two syncers file the same two answers, one with the transport's sums, one without: the
  answers' results, the merged versions and their digests are identical."""
  results, states = [], []
  for keep in (True, False):
    core = _core()
    got = []
    for learner in (0, 1):
      chunks = push_messages(
        dataclasses.replace(_report(_theta(learner)), learner_id=learner),
        "fp32",
        anchor_values=ANCHOR,
      )
      report = _decode(chunks)
      assert sorted(report.sq_norms) == KEYS
      got.append(
        core.report(report if keep else dataclasses.replace(report, sq_norms=None), copy=False)
      )
    core.closer.flush()
    results.append([(r.status, r.weight) for r in got])
    states.append((core.version(0), core.state(0).digest))
  assert results[0] == results[1] and results[0][0][0] == "accepted"
  assert states[0] == states[1] and states[0][0] == 1
