"""The ablation policies (Fig. 23) are Bullet with one half switched off: `partition-only` keeps
the dynamic split but schedules in arrival order and never yields or pauses; `scheduler-only` keeps
ordering, yielding and pausing but gives whichever worker runs every unit. Both run whole
simulations to the end with every page back, through the same factory as the servers."""

from __future__ import annotations

import pytest

from bullet.config import ServerArgs
from bullet.policies.ablation import PartitionOnlyDecode, PartitionOnlyPrefill, SchedulerOnlyDecode, SchedulerOnlyPrefill
from bullet.policies.bullet_decode import BulletDecodePolicy
from bullet.policies.bullet_prefill import BulletPrefillPolicy
from bullet.policies.factory import make_decode_policy, make_prefill_policy
from bullet.types.slo import SLO
from tests.policies.fakes import LAYERS, TOTAL, FakePredictor, decode_state, decode_view, prefill_view, req
from tests.sim.test_runs import poisson, simulate

UNITS = list(range(1, TOTAL + 1))


def prefill(cls, ttft="10s", tpot="100ms"):
    return cls(FakePredictor(), SLO.parse(ttft, tpot), UNITS, 4, LAYERS, 8192, lambda units: 1)


def test_the_factory_builds_each_half():
    for name, p_cls, d_cls in [("partition-only", PartitionOnlyPrefill, PartitionOnlyDecode),
                               ("scheduler-only", SchedulerOnlyPrefill, SchedulerOnlyDecode)]:
        args = ServerArgs(policy=name)
        assert args.uses_estimator
        assert type(make_prefill_policy(args, UNITS, LAYERS, FakePredictor())) is p_cls
        assert type(make_decode_policy(args, UNITS, FakePredictor())) is d_cls
    with pytest.raises(ValueError, match="takes no argument"):
        ServerArgs(policy="partition-only:4")


def test_partition_only_keeps_arrival_order_and_never_preempts():
    p = prefill(PartitionOnlyPrefill)
    long, short = req("long", 2000, 0.0), req("short", 100, 0.1)
    assert p.decide(prefill_view(0.2, [long, short])).admit == [long]  # Bullet proper admits `short` first
    assert p.preemption is False


def test_scheduler_only_gives_prefill_every_unit_while_decode_runs():
    p = prefill(SchedulerOnlyPrefill)
    view = prefill_view(0.2, [req("a", 500, 0.0)], peer=decode_state(batch=8, context=4000, tpot_p90_ms=10))
    d = p.decide(view)
    assert d.units in (TOTAL, 0) and (d.units == TOTAL or d.yield_s > 0)


def test_partition_only_decode_never_pauses_and_scheduler_only_decode_takes_everything():
    running = [req(f"r{i}", 100, 0.0, outputs=5, first_token_time=0.1) for i in range(4)]
    busy_prefill = decode_state()  # a prefill that took every unit for a burst
    busy_prefill.compute_units, busy_prefill.queued_requests, busy_prefill.remaining_layers = TOTAL, 3, LAYERS
    po = PartitionOnlyDecode(FakePredictor(), SLO.parse("10s", "10s"), UNITS).decide(decode_view(1.0, running, busy_prefill))
    assert po.run and po.units == UNITS[0]  # a loose TPOT: one unit keeps it
    # a TPOT that one unit keeps with no margin (24 ms a step of 30) and two within 70 % of it (12 ms): Bullet
    # pauses for the burst; partition-only runs on two, not on the smallest share
    fresh = [req(f"f{i}", 100, 0.0, outputs=1, first_token_time=0.999) for i in range(4)]
    slo = SLO.parse("10s", "30ms")
    assert not BulletDecodePolicy(FakePredictor(), slo, UNITS).decide(decode_view(1.0, fresh, busy_prefill)).run
    po = PartitionOnlyDecode(FakePredictor(), slo, UNITS).decide(decode_view(1.0, fresh, busy_prefill))
    assert po.run and po.units == 2 and po.predicted_s == pytest.approx(0.012)
    so = SchedulerOnlyDecode(FakePredictor(), SLO.parse("10s", "100ms"), UNITS)
    busy_prefill.compute_units = TOTAL // 2
    d = so.decide(decode_view(1.0, running, busy_prefill))
    assert not d.run or d.units == TOTAL


@pytest.mark.parametrize("policy", ["partition-only", "scheduler-only"])
def test_a_simulated_run_finishes_every_request(policy):
    requests = poisson(120, 6.0, seed=1)
    sim, result = simulate(policy, requests)
    assert len(result.records) == len(requests) and all(r.ok for r in result.records)
    assert result.counters["free_pages"] == result.counters["total_pages"]


def test_where_bullet_would_yield_partition_only_gives_decode_the_most_a_split_leaves():
    """TPOT broken beyond any split: Bullet yields a whole decode step (scheduling); partition-only keeps
    both running and gives decode the most — prefill on its least — not the least, which left a broken
    TPOT on one unit and served nothing (found by the simulator's ledger on the measured H200: decode
    alone on 8 of 132 SMs half the time)."""
    peer = decode_state(batch=100, context=50_000, tpot_p90_ms=500)  # 120 ms steps on 2+ units: no split holds 100
    view = prefill_view(1.0, [req("a", 500, 0.9)], peer=peer)
    assert prefill(BulletPrefillPolicy).decide(view).yield_s > 0
    d = prefill(PartitionOnlyPrefill).decide(view)
    assert d.units == UNITS[0] and d.num_layers > 0 and "prefill on the least" in d.reason
