"""The interface's shared logic: role placement, rounding, id lists, apply-cost statistics, and the
`none` backend (which is nothing but that logic)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bullet.partition import (BACKENDS, Granularity, PartitionBackend, format_id_list, make_backend,
                              parse_id_list, role_slice)
from bullet.partition.stats import ApplyCostRecorder


@given(total=st.integers(1, 256), data=st.data())
def test_roles_are_disjoint_until_asked_to_overlap(total, data):
    p = data.draw(st.integers(0, total))
    d = data.draw(st.integers(0, total))
    low, high = set(role_slice(total, p, "prefill")), set(role_slice(total, d, "decode"))
    assert len(low) == p and len(high) == d
    assert min(low, default=0) == 0 and max(high, default=total - 1) == total - 1
    assert len(low & high) == max(0, p + d - total)


def test_role_slice_rejects_unknown_roles():
    with pytest.raises(ValueError, match="role"):
        role_slice(8, 2, "both")


@given(st.sets(st.integers(0, 300)))
def test_id_lists_round_trip(ids):
    assert parse_id_list(format_id_list(ids)) == ids


def test_id_list_format_matches_the_kernel_style():
    assert format_id_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert parse_id_list("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}


class _Recording(PartitionBackend):
    name = "test"

    def __init__(self, role, total, granularity):
        super().__init__(role, total, granularity)
        self.applied = []

    def _apply(self, units):
        self.applied.append(units)


def test_requests_round_up_to_the_next_feasible_share_and_cap_at_total():
    b = _Recording("decode", 10, Granularity(minimum=4, step=2))
    assert b.feasible_units() == [4, 6, 8, 10]
    for asked, granted in [(1, 4), (4, 4), (5, 6), (9, 10), (50, 10)]:
        b.apply(asked)
        assert b.current_units == granted
    assert b.applied == [4, 4, 6, 10, 10]
    assert b.unit_set() == set(range(0, 10))
    b.apply(6)
    assert b.unit_set() == {4, 5, 6, 7, 8, 9}  # decode: the high end
    with pytest.raises(ValueError):
        b.apply(0)


def test_fresh_backend_holds_everything_before_the_first_apply():
    b = _Recording("prefill", 12, Granularity(2, 2))
    assert b.current_units == 12 and b.unit_set() == set(range(12))
    assert b.apply_costs().count == 0


def test_apply_cost_summary_uses_observed_values():
    rec = ApplyCostRecorder(window=1000)
    for ns in range(1000, 101000, 1000):  # 1..100 µs
        rec.record(ns)
    s = rec.summary()
    assert s.count == 100 and s.mean_us == pytest.approx(50.5)
    assert (s.p50_us, s.p99_us, s.max_us) == (50.0, 99.0, 100.0)


def test_apply_cost_window_bounds_memory_but_totals_stay_exact():
    rec = ApplyCostRecorder(window=10)
    for ns in [1_000_000] + [1000] * 20:
        rec.record(ns)
    s = rec.summary()
    assert s.count == 21 and s.max_us == 1000.0  # max over all applies
    assert s.p99_us == 1.0  # percentiles over the recent window


def test_none_backend_records_the_request_and_keeps_everything():
    b = make_backend("none", "decode", total_units=108, unit_kind="SM")
    b.apply(30)
    assert b.requested_units == 30
    assert b.current_units == 108 and b.unit_set() == set(range(108))
    assert b.apply_costs().count == 1
    d = b.describe()
    assert d["backend"] == "none" and d["unit_kind"] == "SM" and d["requested_units"] == 30


def test_factory_knows_the_five_backends_and_rejects_others():
    assert set(BACKENDS) == {"cpu", "libsmctrl", "green-ctx", "mps-percentage", "none"}
    with pytest.raises(ValueError, match="unknown partition backend 'mps'"):
        make_backend("mps", "prefill")
    with pytest.raises(ValueError, match="role"):
        make_backend("none", "middle")
