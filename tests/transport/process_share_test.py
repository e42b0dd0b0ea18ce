"""What a multi-process learner's leader shares: every item round-trips bit for bit, and a payload
that is not exactly an encoding raises."""

import ml_dtypes
import numpy as np
import pytest

from ddiloco.fragments.digest import values_digest
from ddiloco.protocol import FragmentState, ReportResult, RoundRequest
from ddiloco.transport import process_share, wire
from ddiloco.transport.chunks import DEFAULT_CHUNK_SIZE
from ddiloco.transport.errors import WireError

BIG = DEFAULT_CHUNK_SIZE // 4 + 3  # float32 values: a Pull stream of two chunks.


def _layouts():
  return [
    wire.make_layout(["a/w", "a/b"], [(2, 3), (4,)], [np.float32, ml_dtypes.bfloat16]),
    wire.make_layout(["b/w", "b/h"], [(BIG,), (5,)], [np.float32, np.float16]),
  ]


def _state(p: int, version: int, seed: int = 0) -> FragmentState:
  rng = np.random.default_rng(seed)
  values = {}
  for key, (shape, dtype) in _layouts()[p].items():
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[0] = -0.0  # Bits a float round trip could lose: the sign of zero, a subnormal.
    x.flat[1] = np.float32(1e-45)
    values[key] = x.astype(dtype)
  return FragmentState(p, version, values, values_digest(values))


def _bits(state: FragmentState):
  return (
    state.fragment,
    state.version,
    state.digest,
    {k: (v.dtype.name, v.shape, v.tobytes()) for k, v in state.values.items()},
  )


def _drained() -> process_share.Drained:
  return process_share.Drained(
    results=[
      (1, 7, ReportResult("accepted", "", 0.1 + 0.2, fleet_step=9, round_version=3)),
      (0, 8, 11),  # Folded into the newer report of step 11.
      (1, 2**40, ReportResult("late", "round (1, 4) closed ✓", 0.0)),
    ],
    states=[_state(1, 4), _state(0, 2, seed=1), _state(0, 3, seed=2)],
    requests=[(RoundRequest(0, 12, 2), 12345.678901234567), (RoundRequest(1, 13, -1), -0.0)],
    settle=([3, 4], [-1, 2**40]),
  )


def test_a_drain_round_trips_every_item_exactly():
  drained = _drained()
  got = process_share.decode_drained(process_share.encode_drained(drained), _layouts())
  assert got.results == drained.results
  assert [_bits(s) for s in got.states] == [_bits(s) for s in drained.states]
  assert got.requests == drained.requests
  assert [str(t) for _, t in got.requests] == [str(t) for _, t in drained.requests]  # -0.0 kept.
  assert got.settle == drained.settle


@pytest.mark.parametrize(
  "drained",
  [
    process_share.Drained(settle=([], [])),  # An empty settlement is still one.
    process_share.Drained(results=[(0, 1, 2)]),
    process_share.Drained(states=[_state(0, 1)]),
  ],
)
def test_each_kind_round_trips_alone(drained):
  assert drained
  got = process_share.decode_drained(process_share.encode_drained(drained), _layouts())
  assert (got.results, got.requests, got.settle) == (
    drained.results,
    drained.requests,
    drained.settle,
  )
  assert [_bits(s) for s in got.states] == [_bits(s) for s in drained.states]


def test_an_empty_drain_is_false_and_round_trips():
  assert not process_share.Drained()
  got = process_share.decode_drained(process_share.encode_drained(process_share.Drained()), [])
  assert got == process_share.Drained()


def test_the_global_model_round_trips_exactly():
  states = [_state(0, 5), _state(1, 0)]
  payload = process_share.encode_global(states, 2**35, [5, 0])
  got, fleet_step, versions = process_share.decode_global(payload, _layouts())
  assert [_bits(s) for s in got] == [_bits(s) for s in states]
  assert (fleet_step, versions) == (2**35, [5, 0])
  with pytest.raises(WireError, match="Unexpected record"):
    process_share.decode_drained(payload, _layouts())  # A start is not a drain.


def test_every_truncation_and_every_flipped_byte_raises():
  small = process_share.Drained(
    results=[(1, 7, ReportResult("accepted", "", 0.5)), (0, 8, 11)],
    states=[_state(0, 2)],
    requests=[(RoundRequest(0, 12, 2), 1.5)],
    settle=([3, 4], [-1, 7]),
  )
  payload = process_share.encode_drained(small)
  for n in range(len(payload)):
    with pytest.raises(WireError):
      process_share.decode_drained(payload[:n], _layouts())
  for i in range(len(payload)):
    garbled = bytearray(payload)
    garbled[i] ^= 0x10
    with pytest.raises(WireError):
      process_share.decode_drained(bytes(garbled), _layouts())
  with pytest.raises(WireError, match="Checksum mismatch"):
    process_share.decode_drained(payload + b"\0", _layouts())


def test_a_fragment_that_does_not_match_its_digest_or_layout_raises():
  state = _state(0, 2)
  wrong = FragmentState(0, 2, state.values, "0" * 64)
  payload = process_share.encode_drained(process_share.Drained(states=[wrong]))
  with pytest.raises(WireError, match="Digest mismatch"):
    process_share.decode_drained(payload, _layouts())
  payload = process_share.encode_drained(process_share.Drained(states=[_state(1, 2)]))
  with pytest.raises(WireError, match="names fragment 1; the layout has 1"):
    process_share.decode_drained(payload, _layouts()[:1])


def test_values_fp32_cannot_carry_exactly_are_refused():
  values = {"a/w": np.zeros((2, 3)), "a/b": np.zeros(4, ml_dtypes.bfloat16)}  # float64.
  state = FragmentState(0, 1, values, values_digest(values))
  with pytest.raises(ValueError, match="float64 does not travel exactly"):
    process_share.encode_drained(process_share.Drained(states=[state]))
