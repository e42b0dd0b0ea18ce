"""A bf16 δ push kept as it was sent (`chunks_to_report(as_sent=True)`): bfloat16 arrays whose
widening is the decoded float32 bit for bit, the door's norms the same bits, and the syncer's
filing, merges (fused and numpy), digests and checkpoints of open rounds identical to those of the
decoded push."""

import dataclasses
import time

import ml_dtypes
import numpy as np
import pytest

from ddiloco.protocol import Report
from ddiloco.syncer import blockwise, merge
from ddiloco.syncer.core import SyncerConfig, SyncerCore
from ddiloco.syncer.merge_rules import RDA, WeightedMean
from ddiloco.testing.wire import push_messages
from ddiloco.transport import messages
from ddiloco.transport.chunks import ArrayPool
from ddiloco.transport.errors import WireError

B = blockwise.BLOCK_VALUES
BF16 = np.dtype(ml_dtypes.bfloat16)
# Sizes below, at and across a block; "c" is float64: never kept (its payload is not its bytes).
SHAPES = {"a": (3 * B + 17,), "b": (B,), "c": (5, 7), "d": (2 * B - 1,)}
DTYPES = {"a": np.float32, "b": np.float32, "c": np.float64, "d": np.float32}
KEYS = sorted(SHAPES)
ANCHOR = {
  k: np.random.default_rng(i).standard_normal(s).astype(DTYPES[k])
  for i, (k, s) in enumerate(SHAPES.items())
}


def _report(seed: int, learner: int = 0, step: int = 1) -> Report:
  rng = np.random.default_rng(100 + seed)
  theta = {k: (a - 1e-2 * rng.standard_normal(a.shape)).astype(a.dtype) for k, a in ANCHOR.items()}
  return Report(
    learner_id=learner,
    fragment=0,
    values=theta,
    tokens=10 + seed,
    steps=1,
    anchor_version=0,
    step=step,
    round_step=1,
  )


def _decode(chunks, *, as_sent: bool, check_finite: bool = False) -> Report:
  return messages.chunks_to_report(
    chunks,
    KEYS,
    SHAPES,
    DTYPES,
    max_chunk_bytes=1 << 21,
    alloc=ArrayPool(0).empty,
    check_finite=check_finite,
    as_sent=as_sent,
  )


def _bits(a: np.ndarray) -> np.ndarray:
  return np.asarray(a, np.float32 if a.dtype == BF16 else a.dtype).view(np.uint8)


# Chunks that end mid-value (1001 bytes: a bfloat16 split across two), in whole blocks' worth.
@pytest.mark.parametrize("chunk", [1001, 4 * B + 12, 1 << 20])
@pytest.mark.parametrize("check_finite", [False, True])
def test_kept_values_widen_to_the_decoded_bits_with_the_same_norms(chunk, check_finite):
  chunks = list(push_messages(_report(0), "bf16", chunk_size=chunk, anchor_values=ANCHOR))
  decoded = _decode(chunks, as_sent=False, check_finite=check_finite)
  kept = _decode(chunks, as_sent=True, check_finite=check_finite)
  for k in KEYS:
    want = np.float64 if k == "c" else BF16
    assert kept.values[k].dtype == want and kept.values[k].shape == SHAPES[k]
    np.testing.assert_array_equal(_bits(kept.values[k]), _bits(decoded.values[k]))
  if not check_finite:
    assert kept.sq_norms == decoded.sq_norms and sorted(kept.sq_norms) == ["a", "b", "d"]
    for k in ("a", "b", "d"):
      assert kept.sq_norms[k] == merge.finite_sq_norm(None, kept.values[k])  # The door's bits.


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_other_codecs_and_theta_pushes_decode_as_before(codec):
  got = _decode(push_messages(_report(0), codec, anchor_values=ANCHOR), as_sent=True)
  assert all(got.values[k].dtype == DTYPES[k] for k in KEYS)
  theta = _decode(push_messages(_report(0), "bf16"), as_sent=True)  # θ, not δ: float32.
  assert not theta.outer_gradient and all(theta.values[k].dtype == DTYPES[k] for k in KEYS)
  assert messages.kept_dtype("bf16") == BF16 and messages.kept_dtype(codec) is None


def _nan_push():
  delta = {k: (ANCHOR[k] - _report(2).values[k]).reshape(-1) for k in KEYS}
  encoded = {k: (v.astype(ml_dtypes.bfloat16), np.empty(0, np.float32)) for k, v in delta.items()}
  encoded["a"][0][B + 5] = np.nan
  encoded["d"][0][-1] = np.inf
  encoded["c"] = (delta["c"].astype(np.float32).astype(ml_dtypes.bfloat16), encoded["c"][1])
  as_bytes = {k: (v.view(np.uint8), s) for k, (v, s) in encoded.items()}
  return list(push_messages(_report(2), "bf16", anchor_values=ANCHOR, encoded=as_bytes))


def test_a_kept_non_finite_value_is_refused_at_the_door():
  with pytest.raises(WireError, match="non-finite"):
    _decode(_nan_push(), as_sent=True, check_finite=True)
  report = _decode(_nan_push(), as_sent=True)
  assert sorted(report.sq_norms) == ["b"]  # No sum for a block with a NaN/Inf.
  core = _core(SyncerConfig(min_quorum=2, use_grace=False))
  result = core.report(report, copy=False)
  assert result.status == "rejected" and "'a'" in result.reason
  assert not core.rounds[0].entries


def test_the_door_refuses_a_kept_dtype_for_theta_or_a_narrower_tensor():
  core = _core(SyncerConfig(min_quorum=2, use_grace=False))
  kept = _decode(push_messages(_report(0), "bf16", anchor_values=ANCHOR), as_sent=True)
  as_theta = dataclasses.replace(kept, outer_gradient=False, sq_norms=None)
  result = core.report(as_theta, copy=False)
  assert result.status == "rejected" and "'a' is bfloat16" in result.reason
  values = dict(kept.values, c=kept.values["c"].astype(ml_dtypes.bfloat16))
  result = core.report(dataclasses.replace(kept, values=values), copy=False)
  assert result.status == "rejected" and "'c' is bfloat16" in result.reason


def _core(config: SyncerConfig) -> SyncerCore:
  core = SyncerCore(fragment_keys=[KEYS], init_values=ANCHOR, config=config, clock=time.monotonic)
  for learner in range(3):
    core.register(learner)
    core.mark_delivered(learner, 0, 0)
  core.open_round(0, 1)
  return core


def _pushes(chunk: int = 1 << 20):
  return [
    list(push_messages(_report(m, learner=m), "bf16", chunk_size=chunk, anchor_values=ANCHOR))
    for m in range(3)
  ]


def _merged(core: SyncerCore):
  core.closer.flush()
  state = core.state(0)
  return state.version, state.digest, {k: _bits(v) for k, v in state.values.items()}


def _same(a, b) -> None:
  assert a[:2] == b[:2] and a[0] == 1
  for k in KEYS:
    np.testing.assert_array_equal(a[2][k], b[2][k])


CONFIGS = {
  # Fused: every fragment merges in the XLA program; numpy: `merge.merge_reports`.
  f"{path}-{type(rule).__name__}": SyncerConfig(
    min_quorum=3, use_grace=False, merge_rule=rule, fused_merge_bytes=size
  )
  for path, size in (("fused", 0), ("numpy", 1 << 40))
  for rule in (RDA(), WeightedMean())
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_merging_kept_answers_gives_the_same_bits(name):
  """Two syncers file the same three bf16 answers, decoded and kept: the same results, versions,
  digests and values."""
  out = []
  for as_sent in (False, True):
    core = _core(CONFIGS[name])
    results = [
      core.report(_decode(chunks, as_sent=as_sent), copy=False).status for chunks in _pushes()
    ]
    assert results == ["accepted"] * 3
    if as_sent:
      assert core.rounds[0].entries[0].report.values["a"].dtype == BF16
    out.append(_merged(core))
  _same(*out)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_checkpointed_open_round_of_kept_answers_restores_and_merges_the_same_bits(name):
  """A round holding a kept answer is checkpointed (widened: the tensors' dtypes) and restored;
  two kept answers join it (a round of float32 and bfloat16 answers): the merge is the decoded
  one's, bit for bit, its norms recomputed for the restored answer."""
  config = CONFIGS[name]
  pushes = _pushes(chunk=4 * B + 12)
  decoded = _core(config)
  for chunks in pushes:
    decoded.report(_decode(chunks, as_sent=False), copy=False)
  want = _merged(decoded)
  before = _core(config)
  assert before.report(_decode(pushes[0], as_sent=True), copy=False).status == "accepted"
  state = before.state_dict()
  assert state["fragment/0/round/0/value/a"].dtype == np.float32
  after = _core(config)
  after.load_state_dict(state)
  for chunks in pushes[1:]:
    assert after.report(_decode(chunks, as_sent=True), copy=False).status == "accepted"
  entries = after.rounds[0].entries
  assert entries[0].report.values["a"].dtype == np.float32 and entries[0].sq_norms is None
  assert entries[1].report.values["a"].dtype == BF16
  _same(_merged(after), want)


def test_a_warm_up_for_kept_answers_compiles_the_program_their_merge_runs():
  core = _core(CONFIGS["fused-RDA"])
  core.warm_up(0, 3, sent_as=messages.kept_dtype("bf16"))
  fused = core._updater._outer._fused
  compiled = fused._cache_size()
  for chunks in _pushes():
    core.report(_decode(chunks, as_sent=True), copy=False)
  assert _merged(core)[0] == 1
  assert fused._cache_size() == compiled  # Not compiled again under the service's lock.
