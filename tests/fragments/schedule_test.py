"""Tests for ddiloco.fragments.schedule (docs/algorithm.md §2, §3)."""

import pytest

from ddiloco.fragments.schedule import FragmentSchedule


def test_defaults_are_spec():
  s = FragmentSchedule()
  assert (s.num_fragments, s.period, s.overlap) == (24, 24, 2)


def test_p_equals_h_24_one_due_per_step():
  s = FragmentSchedule(num_fragments=24, period=24, overlap=2)
  assert [s.offset(p) for p in range(24)] == list(range(24))
  assert s.due(0) == ()
  for t in range(1, 97):
    assert len(s.due(t)) == 1
  # Fragment 0 has offset 0: first due at t = H = 24, then 48; fragment p > 0 at t = p, p + 24.
  assert [t for t in range(1, 97) if 0 in s.due(t)] == [24, 48, 72, 96]
  assert s.due(1) == (1,)
  assert s.due(23) == (23,)
  assert s.due(25) == (1,)
  assert s.apply_step(24) == 26
  assert s.next_due(0, 0) == 24
  assert s.next_due(0, 24) == 48
  assert s.next_due(5, 0) == 5
  assert s.next_due(5, 5) == 29


def test_p1_h1_due_every_step():
  s = FragmentSchedule(num_fragments=1, period=1, overlap=0)
  assert s.due(0) == ()
  assert all(s.due(t) == (0,) for t in range(1, 20))
  assert [s.next_due(0, t) for t in range(4)] == [1, 2, 3, 4]
  assert s.apply_step(7) == 7


def test_p4_h8_offsets():
  s = FragmentSchedule(num_fragments=4, period=8, overlap=1)
  assert [s.offset(p) for p in range(4)] == [0, 2, 4, 6]
  assert [t for t in range(1, 25) if s.is_due(0, t)] == [8, 16, 24]
  assert [t for t in range(1, 25) if s.is_due(1, t)] == [2, 10, 18]
  assert [t for t in range(1, 25) if s.is_due(3, t)] == [6, 14, 22]
  assert all(s.due(t) == () for t in range(1, 25, 2))  # Odd steps: nothing due.


def test_more_fragments_than_period():
  # P = 4 > H = 2: offsets floor(p*2/4) = 0, 0, 1, 1; two fragments due each step.
  s = FragmentSchedule(num_fragments=4, period=2, overlap=1)
  assert [s.offset(p) for p in range(4)] == [0, 0, 1, 1]
  assert s.due(1) == (2, 3)
  assert s.due(2) == (0, 1)
  assert s.due(3) == (2, 3)
  assert s.next_due(0, 0) == 2
  assert s.next_due(3, 1) == 3


@pytest.mark.parametrize("num_fragments", range(1, 9))
@pytest.mark.parametrize("period", range(1, 9))
def test_each_fragment_once_per_period_and_next_due_consistent(num_fragments, period):
  s = FragmentSchedule(num_fragments=num_fragments, period=period, overlap=0)
  # Any H consecutive steps after the first period contain exactly one send of every fragment.
  sends = [p for t in range(period + 1, 2 * period + 1) for p in s.due(t)]
  assert sorted(sends) == list(range(num_fragments))
  for p in range(num_fragments):
    for t in range(0, 3 * period):
      expected = next(u for u in range(t + 1, t + period + 2) if s.is_due(p, u))
      assert s.next_due(p, t) == expected


def test_validation():
  with pytest.raises(ValueError, match="num_fragments must be >= 1"):
    FragmentSchedule(num_fragments=0, period=4, overlap=0)
  with pytest.raises(ValueError, match="period must be >= 1"):
    FragmentSchedule(num_fragments=1, period=0, overlap=0)
  with pytest.raises(ValueError, match=r"overlap must be in \[0, period=4\)"):
    FragmentSchedule(num_fragments=1, period=4, overlap=4)
  with pytest.raises(ValueError, match="overlap must be"):
    FragmentSchedule(num_fragments=1, period=4, overlap=-1)
  s = FragmentSchedule(num_fragments=2, period=4, overlap=1)
  with pytest.raises(ValueError, match=r"Fragment 2 out of range \[0, 2\)"):
    s.offset(2)
  with pytest.raises(ValueError, match="Step must be >= 0"):
    s.due(-1)


def test_gin_configurable():
  from ddiloco.launch import configurables

  try:
    configurables.parse(
      [],
      [
        "FragmentSchedule.num_fragments = 4",
        "FragmentSchedule.period = 8",
        "FragmentSchedule.overlap = 3",
      ],
    )
    s = configurables.configured(FragmentSchedule)()
    assert (s.num_fragments, s.period, s.overlap) == (4, 8, 3)
    assert FragmentSchedule().num_fragments == 24  # A direct call ignores gin.
  finally:
    configurables.clear()


def test_slices_of_a_group_are_due_together():
  # P = 4, H = 8, S = 3: fragments 0..11, fragment f in group f // 3 with the group's offset.
  plain = FragmentSchedule(num_fragments=4, period=8, overlap=1)
  s = FragmentSchedule(num_fragments=4, period=8, overlap=1, slices=3)
  assert s.total_fragments == 12 and plain.total_fragments == 4
  assert [s.group(f) for f in range(12)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
  assert [s.offset(f) for f in range(12)] == [plain.offset(f // 3) for f in range(12)]
  for t in range(0, 40):
    assert s.due(t) == tuple(3 * g + i for g in plain.due(t) for i in range(3))
    for f in range(12):
      assert s.next_due(f, t) == plain.next_due(f // 3, t)
  assert s.due(2) == (3, 4, 5)
  assert s.apply_step(2) == plain.apply_step(2)
  with pytest.raises(ValueError, match=r"Fragment 12 out of range \[0, 12\)"):
    s.offset(12)


def test_one_slice_is_the_plain_schedule():
  s = FragmentSchedule(num_fragments=24, period=24, overlap=2)
  assert s == FragmentSchedule(num_fragments=24, period=24, overlap=2, slices=1)
  assert s.total_fragments == 24 and [s.group(p) for p in range(24)] == list(range(24))
  with pytest.raises(ValueError, match="slices must be >= 1"):
    FragmentSchedule(slices=0)
  with pytest.raises(ValueError, match=r"Fragment 24 out of range \[0, 24\)"):
    s.offset(24)
