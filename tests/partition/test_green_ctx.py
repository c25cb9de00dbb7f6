"""Green-context pool logic against a fake driver that splits a device the way the CUDA docs
describe (group size raised to the minimum partition and alignment, leftover SMs in a remainder)
and remembers which physical SMs each stream got."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bullet.partition import PartitionUnavailable, make_backend
from bullet.partition.gpu_helper import SmResource, SmSplit
from bullet.partition.green_ctx import GroupLayout


class FakeDriver:
    def __init__(self, sm_count, min_partition, alignment, supported=True, fail_on_create=None):
        self.resource = SmResource(sm_count, min_partition, alignment)
        self.supported = supported
        self.fail_on_create = fail_on_create
        self.streams: dict[int, set[int]] = {}  # live stream -> physical SM ids
        self.splits_live = 0
        self.requested_group = None
        self._next = 0x100

    def green_ctx_supported(self):
        if not self.supported:
            raise PartitionUnavailable("CUDA driver lacks cuGreenCtxCreate: green contexts need 12.4")

    def sm_resource(self, device):
        assert device == 0
        return self.resource

    def split(self, device, group_sms, flags=0):
        self.requested_group = group_sms
        a = self.resource.coscheduled_alignment
        size = max(-(-group_sms // a) * a, self.resource.min_partition_size)
        n = self.resource.sm_count // size
        self.splits_live += 1
        return SmSplit(handle=0xABC, group_sms=[size] * n, remainder_sms=self.resource.sm_count - n * size)

    def create_stream(self, split, first, count, with_remainder):
        if self.fail_on_create is not None and len(self.streams) == self.fail_on_create:
            raise PartitionUnavailable("cuGreenCtxCreate failed: CUDA_ERROR_OUT_OF_MEMORY")
        size = split.group_sms[0]
        sms = set(range(first * size, (first + count) * size))
        if with_remainder:
            sms |= set(range(len(split.group_sms) * size, self.resource.sm_count))
        self._next += 0x10
        self.streams[self._next] = sms
        return self._next + 1, self._next  # (green ctx, stream)

    def destroy_stream(self, green_ctx, stream):
        assert green_ctx == stream + 1
        del self.streams[stream]

    def free_split(self, split):
        self.splits_live -= 1


def a100():
    return FakeDriver(108, min_partition=4, alignment=2)


def h100():
    return FakeDriver(132, min_partition=8, alignment=8)


def test_pool_is_built_from_the_group_sizes_the_driver_returned():
    drv = a100()
    b = make_backend("green-ctx", "prefill", driver=drv)
    assert drv.requested_group == 2  # asked for the alignment ...
    assert b.feasible_units() == list(range(4, 109, 4))  # ... got groups of the minimum partition
    assert (b.granularity.minimum, b.granularity.step) == (4, 4)
    assert b.current_units == 108 and drv.streams[b.launch_stream()] == set(range(108))


def test_hopper_pool_has_eight_sm_steps_and_a_full_entry_with_the_remainder():
    drv = h100()
    b = make_backend("green-ctx", "decode", driver=drv)
    assert b.feasible_units() == list(range(8, 129, 8)) + [132]
    assert b.peer_feasible_units() == list(range(12, 133, 8))  # prefill's: the remainder with its groups
    b.apply(130)
    assert b.current_units == 132 and drv.streams[b.launch_stream()] == set(range(132))
    b.apply(9)
    assert b.current_units == 16
    assert drv.streams[b.launch_stream()] == set(range(112, 128))  # the last two groups
    assert b.unit_set() == set(range(112, 128))


def test_applying_only_switches_streams_and_records_the_cost():
    drv = h100()
    b = make_backend("green-ctx", "prefill", driver=drv)
    created = dict(drv.streams)
    seen = set()
    for units in (12, 68, 36, 132, 12):  # prefill's shares: 4 + 8k SMs
        b.apply(units)
        assert len(drv.streams[b.launch_stream()]) == units
        seen.add(b.launch_stream())
    assert drv.streams == created  # nothing created or destroyed by apply
    assert len(seen) == 4 and b.apply_costs().count == 5
    assert b.pool_streams()[36] in seen


def test_prefill_and_decode_pools_are_disjoint_when_counts_fit():
    drv = h100()
    p = make_backend("green-ctx", "prefill", driver=drv)
    d = make_backend("green-ctx", "decode", driver=drv)
    for ps in p.feasible_units():
        for ds in d.feasible_units():
            p.apply(ps)
            d.apply(ds)
            physical = drv.streams[p.launch_stream()] & drv.streams[d.launch_stream()]
            logical = p.unit_set() & d.unit_set()
            if ps + ds <= 132:
                assert not physical and not logical, (ps, ds)
            assert len(physical) == len(logical)


def test_counts_limit_the_pool_to_covering_shares():
    drv = h100()
    b = make_backend("green-ctx", "decode", driver=drv, counts=[12, 32, 64])
    assert b.feasible_units() == [16, 32, 64, 132]
    assert len(drv.streams) == 4
    b.apply(40)
    assert b.current_units == 64
    p = make_backend("green-ctx", "prefill", driver=drv, counts=[12, 32, 64])
    assert p.feasible_units() == [12, 36, 68, 132]


def test_close_destroys_every_stream_and_the_split():
    drv = a100()
    b = make_backend("green-ctx", "decode", driver=drv)
    assert len(drv.streams) == 27 and drv.splits_live == 1
    b.close()
    b.close()  # idempotent
    assert drv.streams == {} and drv.splits_live == 0


def test_a_failure_while_building_the_pool_releases_what_was_built():
    drv = FakeDriver(132, 8, 8, fail_on_create=5)
    with pytest.raises(PartitionUnavailable, match="OUT_OF_MEMORY"):
        make_backend("green-ctx", "prefill", driver=drv)
    assert drv.streams == {} and drv.splits_live == 0


def test_unsupported_driver_is_reported_clearly():
    with pytest.raises(PartitionUnavailable, match="green-ctx unavailable: .*12.4"):
        make_backend("green-ctx", "prefill", driver=FakeDriver(108, 4, 2, supported=False))


@given(groups=st.integers(1, 40), size=st.integers(1, 16), rest=st.integers(0, 7), data=st.data())
def test_layout_shares_overlap_only_past_the_group_count(groups, size, rest, data):
    layout = GroupLayout([size] * groups, rest)
    k, j = data.draw(st.integers(1, groups)), data.draw(st.integers(1, groups))
    low, high = layout.share("prefill", k), layout.share("decode", j)
    assert (low.sms, high.sms) == (k * size + rest, j * size)  # the remainder goes with prefill's groups
    assert len(set(low.positions)) == low.sms and len(set(high.positions)) == high.sms
    assert len(set(low.positions) & set(high.positions)) == max(0, k + j - groups) * size
    if k + j == groups:  # complementary shares: the whole device, nothing idle
        assert set(low.positions) | set(high.positions) == set(range(layout.total))
    plan = layout.plan("decode")
    assert plan[-1].sms == layout.total == groups * size + rest
    assert [s.sms for s in plan] == sorted({s.sms for s in plan})


def test_the_coarse_pool_splits_at_sixteenths_eighths_quarters_halves_from_either_side():
    drv = h100()  # 16 groups of 8 SMs + a remainder of 4
    p = make_backend("green-ctx", "prefill", driver=drv, pool="coarse")
    d = make_backend("green-ctx", "decode", driver=drv, pool="coarse")
    assert d.feasible_units() == [8, 16, 32, 64, 96, 112, 120, 132]
    assert p.feasible_units() == [12, 20, 36, 68, 100, 116, 124, 132]  # the remainder's 4 SMs with prefill's groups
    assert p.peer_feasible_units() == d.feasible_units() and d.peer_feasible_units() == p.feasible_units()
    assert len(drv.streams) == 16  # 8 shares per role instead of 17
    for ps in p.feasible_units()[:-1]:  # every prefill share leaves its exact complement in decode's pool, disjoint
        rest = 132 - ps
        assert rest in d.feasible_units()
        p.apply(ps)
        d.apply(rest)
        both = drv.streams[p.launch_stream()] | drv.streams[d.launch_stream()]
        assert not drv.streams[p.launch_stream()] & drv.streams[d.launch_stream()] and len(both) == 132, (ps, rest)
    a = make_backend("green-ctx", "decode", driver=a100(), pool="coarse")  # 27 groups of 4 (cc 8.0)
    assert a.feasible_units() == [8, 12, 28, 52, 56, 80, 96, 100, 108]
    with pytest.raises(ValueError, match="pool"):
        make_backend("green-ctx", "decode", driver=h100(), pool="some")
