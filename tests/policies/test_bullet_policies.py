"""Each rule of Bullet's Algorithm 1 (prefill) and of the decode scheduler, reached in a constructed
situation, with a fake clock (the views' `now`) and a predictor of known latencies."""

from __future__ import annotations

import pytest

from bullet.policies.bullet_decode import BulletDecodePolicy
from bullet.policies.bullet_prefill import TPOT_MARGIN, BulletPrefillPolicy
from bullet.policies.views import PrefillView
from bullet.shm.state_buffer import WorkerFlags, WorkerState
from bullet.types.slo import SLO
from tests.policies.fakes import (LAYERS, TOTAL, FakePredictor, decode_state, decode_view, inflight,
                                    prefill_view, req)

K = 4


def policy(ttft="10s", tpot="100ms", limit=10_000, max_tokens=8192, max_wait=30.0, est=None, hand_back="bounded",
           preemption=True, split_rule="spatial", prefill_grow="after-decode-step"):
    return BulletPrefillPolicy(est or FakePredictor(), SLO.parse(ttft, tpot), list(range(1, TOTAL + 1)), K, LAYERS,
                               max_tokens, lambda units: limit, max_wait_s=max_wait, preemption=preemption,
                               hand_back=hand_back, split_rule=split_rule, prefill_grow=prefill_grow)


def order(p, view, units):
    """The policy's queue order when the queue runs on `units` units (nothing in flight)."""
    from bullet.policies.predict import prefill_costs

    return [r.rid for r in p.order_queue(view, 0.0, prefill_costs(view.queue, p.est, units, 0))]


# -- line 5: least predicted latency first, without starvation ------------------------------------

def test_queue_is_ordered_by_least_predicted_latency():
    p = policy(limit=1)  # batch one request at a time
    long, short, mid = req("long", 2000, 0.0), req("short", 100, 0.1), req("mid", 500, 0.2)
    d = p.decide(prefill_view(0.3, [long, short, mid]))
    assert d.admit == [short]
    assert order(p, prefill_view(0.3, [long, short, mid]), TOTAL) == ["short", "mid", "long"]


def test_reordering_never_makes_a_request_miss_its_ttft_it_would_meet_in_order():
    # 1.05 ms/token TTFT on 1 unit: the long request meets it only if it runs first
    p = policy(ttft="1.05ms/token", limit=1)
    long, short = req("long", 1000, 0.0), req("short", 100, 0.01)
    view = prefill_view(0.02, [long, short], units=1)
    assert order(p, view, 1) == ["long", "short"]
    # with a generous target the short one goes first
    assert order(policy(ttft="10ms/token"), view, 1) == ["short", "long"]


def test_a_request_that_waited_too_long_goes_first():
    p = policy(max_wait=5.0)
    old, new = req("old", 3000, 0.0), req("new", 10, 9.0)
    assert order(p, prefill_view(10.0, [old, new]), TOTAL) == ["old", "new"]


# -- lines 10-13: batch until the arithmetic-intensity limit --------------------------------------

def test_batching_stops_at_the_intensity_limit_and_at_memory():
    queue = [req(f"r{i}", 100, 0.01 * i) for i in range(5)]
    assert len(policy(limit=300).decide(prefill_view(1.0, queue)).admit) == 3
    assert len(policy(limit=10_000, max_tokens=250).decide(prefill_view(1.0, queue)).admit) == 2
    # 100-token prompts need 7 pages of 16 tokens; 20 free pages fit two
    assert len(policy(limit=10_000).decide(prefill_view(1.0, queue, free_pages=20)).admit) == 2
    # a prompt over the limit still runs, alone
    assert [r.rid for r in policy(limit=50).decide(prefill_view(1.0, queue)).admit] == ["r0"]


def test_idle_prefill_decides_nothing():
    d = policy().decide(prefill_view(1.0, []))
    assert d.admit == [] and d.num_layers == 0


# -- lines 14-19: the split -------------------------------------------------------------------------

def test_decode_idle_gives_prefill_every_unit():
    d = policy().decide(prefill_view(1.0, [req("a", 500, 0.9)]))
    assert d.units == TOTAL and d.num_layers == K and "decode idle" in d.reason


def test_tpot_slack_gives_decode_the_fewest_units_that_keep_it():
    # decode step on 1 unit: 20 + 10 = 30 ms <= 0.9 * 100 ms -> 1 unit is enough
    peer = decode_state(batch=10, context=5000, tpot_p90_ms=30)
    d = policy().decide(prefill_view(1.0, [req("a", 500, 0.9)], peer=peer))
    assert d.units == TOTAL - 1 and "fewest units" in d.reason
    # a tighter TPOT (25 ms): 1 unit (30 ms) is too slow, 2 units (15 ms) keep it
    d = policy(tpot="25ms").decide(prefill_view(1.0, [req("a", 500, 0.9)], peer=decode_state(10, 5000, 20)))
    assert d.units == TOTAL - 2


def test_burst_pauses_decode_when_its_tpot_still_holds():
    # TTFT target 0.1 ms/token: the queued prompts cannot all meet it -> TTFT at risk
    queue = [req(f"r{i}", 400, 0.0) for i in range(4)]
    roomy = decode_state(batch=10, context=5000, tpot_p90_ms=30, pause_budget_ms=5000)
    d = policy(ttft="0.1ms/token", limit=1).decide(prefill_view(1.0, queue, peer=roomy))
    assert d.units == TOTAL and "decode pauses" in d.reason
    # the same burst, but decode cannot afford to wait for a full-device step: no pause
    tight = decode_state(batch=10, context=5000, tpot_p90_ms=30, pause_budget_ms=1)
    d = policy(ttft="0.1ms/token", limit=1).decide(prefill_view(1.0, queue, peer=tight))
    assert d.units == TOTAL - 1


def test_prefill_runs_beside_a_running_decode_step_and_claims_its_share_for_after_it():
    """A decode step keeps its units to its end: a share that reaches into them (a burst's every
    unit, here) runs beside them until decode's step ends, and the chosen share is published as
    claimed for decode's next step."""
    from dataclasses import replace

    queue = [req(f"r{i}", 400, 0.0) for i in range(4)]
    roomy = decode_state(batch=10, context=5000, tpot_p90_ms=30, pause_budget_ms=5000)
    stepping = replace(roomy, compute_units=3)
    burst = policy(ttft="0.1ms/token", limit=1)
    d = burst.decide(prefill_view(1.0, queue, peer=stepping))
    assert (d.units, d.claimed_units) == (TOTAL - 3, TOTAL) and "decode pauses" in d.reason
    d = burst.decide(prefill_view(1.0, queue, peer=replace(stepping, flags=int(WorkerFlags.PAUSED))))
    assert (d.units, d.claimed_units) == (TOTAL, 0)  # decode paused: every unit at once
    d = burst.decide(prefill_view(1.0, queue))
    assert (d.units, d.claimed_units) == (TOTAL, 0)  # decode idle
    # a usual split that fits beside decode's units claims nothing; one that does not, waits too
    d = policy().decide(prefill_view(1.0, [req("a", 500, 0.9)], peer=replace(stepping, compute_units=1)))
    assert (d.units, d.claimed_units) == (TOTAL - 1, 0)
    d = policy().decide(prefill_view(1.0, [req("a", 500, 0.9)], peer=stepping))
    assert (d.units, d.claimed_units) == (TOTAL - 3, TOTAL - 1)
    # "at-once", the rule before: the chosen share now
    d = policy(prefill_grow="at-once").decide(prefill_view(1.0, [req("a", 500, 0.9)], peer=stepping))
    assert (d.units, d.claimed_units) == (TOTAL - 1, 0)
    with pytest.raises(ValueError, match="prefill_grow"):
        policy(prefill_grow="later")


def test_decode_plans_its_next_step_beside_the_share_prefill_claimed():
    running = [req("a", 10, 0.0, outputs=50, first_token_time=0.0)]  # 50 tokens in 1 s: slack to pause
    beside = WorkerState(remaining_layers=8, compute_units=3)
    assert dpolicy().decide(decode_view(1.0, running, beside)).units == TOTAL - 3
    claimed = WorkerState(remaining_layers=8, compute_units=3, claimed_units=6)
    assert dpolicy().decide(decode_view(1.0, running, claimed)).units == TOTAL - 6
    burst = WorkerState(remaining_layers=8, compute_units=3, claimed_units=TOTAL)
    d = dpolicy().decide(decode_view(1.0, running, burst))
    assert not d.run and "prefill burst" in d.reason
    late = [req("a", 10, 0.0, outputs=5, first_token_time=0.0)]  # no budget left: it runs anyway
    assert dpolicy().decide(decode_view(1.0, late, burst)).run
    # on a CPU, mid-step: decode gives up at its next layer the units prefill claimed
    layer = dpolicy(yield_at="layer")
    assert layer.units_mid_step(claimed, current_units=TOTAL - 3) == TOTAL - 6
    assert layer.units_mid_step(beside, current_units=TOTAL - 3) is None


def test_aggregate_rule_pauses_decode_while_its_budget_lasts_and_splits_after():
    # TTFT holds (10 s target): the spatial rule gives decode its fewest units even with budget to spare
    roomy = decode_state(batch=10, context=5000, tpot_p90_ms=30, pause_budget_ms=5000)
    queue = [req("a", 500, 0.9)]
    assert policy().decide(prefill_view(1.0, queue, peer=roomy)).units == TOTAL - 1
    d = policy(split_rule="aggregate").decide(prefill_view(1.0, queue, peer=roomy))
    assert d.units == TOTAL and "aggregate" in d.reason
    # the budget no longer covers a full-device layer group: split as the spatial rule does
    tight = decode_state(batch=10, context=5000, tpot_p90_ms=30, pause_budget_ms=1)
    d = policy(split_rule="aggregate").decide(prefill_view(1.0, queue, peer=tight))
    assert d.units == TOTAL - 1 and "fewest units" in d.reason
    with pytest.raises(ValueError, match="split_rule"):
        policy(split_rule="temporal")


def test_a_queued_request_behind_the_inflight_batch_counts_for_the_burst():
    # the in-flight batch meets its own target (800 ms), but a short prompt queued behind it
    # cannot wait for it: speeding the batch up (decode pauses) is the only help it can get
    batch = inflight([req("long", 800, 0.0)], layers_done=8)
    queue = [req("short", 10, 0.45)]
    roomy = decode_state(batch=10, context=5000, tpot_p90_ms=30, pause_budget_ms=5000)
    d = policy(ttft="1ms/token").decide(prefill_view(0.5, queue, inflight=batch, peer=roomy))
    assert d.units == TOTAL and "decode pauses" in d.reason
    # with nobody queued behind it, the batch keeps the usual share and decode keeps running
    d = policy(ttft="1ms/token").decide(prefill_view(0.5, [], inflight=batch, peer=roomy))
    assert d.units == TOTAL - 1


def test_tpot_violated_makes_prefill_yield_units():
    # decode is at 150 ms against a 100 ms target: it must catch up, 1 unit (30 ms) is not enough
    # once the target is scaled by 100/150 (0.9 * 100 * 100/150 = 60 ms -> still 1 unit ok); use 40 ms
    peer = decode_state(batch=10, context=5000, tpot_p90_ms=150)
    p = policy(tpot="40ms")
    d = p.decide(prefill_view(1.0, [req("a", 100, 0.99)], peer=peer))
    # target 0.9 * 40 * 40/150 = 9.6 ms: no share is fast enough -> prefill yields a decode step,
    # and on its next step decode gets all but prefill's minimum
    assert d.yield_s > 0 and "yields a decode step" in d.reason
    d = p.decide(prefill_view(1.0, [req("a", 100, 0.99)], peer=peer))
    assert d.units == 1 and "prefill yields units" in d.reason
    d = policy(tpot="100ms").decide(prefill_view(1.0, [req("a", 100, 0.99)], peer=decode_state(10, 5000, 150)))
    # target 0.9 * 100 * 100/150 = 60 ms: 1 unit (30 ms) catches up
    assert d.units == TOTAL - 1


def test_both_slos_broken_gives_a_balanced_split():
    est = FakePredictor()
    p = policy(ttft="0.1ms/token", tpot="10ms", limit=1, est=est)
    # more prompts miss TTFT (11) than requests decode (10): no yield, the paper's balanced split
    queue = [req(f"r{i}", 800, 0.0) for i in range(11)]
    peer = decode_state(batch=10, context=5000, tpot_p90_ms=50)
    d = p.decide(prefill_view(1.0, queue, peer=peer))
    assert "balanced" in d.reason

    def worst(units):
        return max(est.prefill_time([800], units) / 0.08, est.decode_time(10, 5000, TOTAL - units) / 0.010)

    assert worst(d.units) == min(worst(u) for u in range(1, TOTAL))
    assert 1 < d.units < TOTAL


def test_tpot_beyond_any_split_makes_prefill_yield_a_decode_step_then_run():
    # TPOT 10 ms: even 7 of 8 units give decode a 15 ms step, and it is at 30 ms already
    p = policy(tpot="10ms")
    peer = decode_state(batch=10, context=5000, tpot_p90_ms=30)
    view = prefill_view(1.0, [req("a", 100, 0.99)], peer=peer)
    d = p.decide(view)
    assert d.num_layers == 0 and not d.admit and "yields a decode step" in d.reason
    assert d.yield_s == pytest.approx(0.015)  # one decode step on all 8 units
    # yields alternate with prefill steps: the next decision runs prefill on its smallest share
    d = p.decide(view)
    assert d.num_layers == K and d.units == 1 and [r.rid for r in d.admit] == ["a"]
    assert p.decide(view).yield_s > 0
    # both broken, and more prompts would miss TTFT (3) than requests decode (2): no yield
    crowded = [req(f"q{i}", 800, 0.0) for i in range(3)]
    d = policy(ttft="0.1ms/token", tpot="10ms").decide(
        prefill_view(1.0, crowded, peer=decode_state(batch=2, context=1000, tpot_p90_ms=30)))
    assert d.yield_s == 0 and d.num_layers > 0


def test_last_layers_hand_units_back_to_decode_within_ten_percent():
    est = FakePredictor()
    r = req("a", 800, 0.0)
    peer = decode_state(batch=10, context=5000, tpot_p90_ms=30)
    batch = inflight([r], layers_done=LAYERS - K)  # the last group of layers
    d = policy(est=est).decide(prefill_view(0.5, [], inflight=batch, peer=peer))
    # usual share 7 units: the group takes 0.1 s / 7 = 14.3 ms; it may take 10 % longer (15.7 ms):
    # 7 units is the fewest that does (6 units: 16.7 ms) — decode's complement grows only as far as
    # that, so an arrival during the tail still finds prefill at speed
    assert d.units == 7 and "hand units back" in d.reason

    class Saturating(FakePredictor):  # a small prefill stops scaling at 4 units (memory-bound)
        def prefill_time(self, seq_lens, units, num_layers=None, include_head=True, co_decode_batch=0):
            return super().prefill_time(seq_lens, min(units, 4), num_layers, include_head, co_decode_batch)

    d = policy(est=Saturating()).decide(prefill_view(0.5, [], inflight=batch, peer=peer))
    assert d.units == 4 and "hand units back" in d.reason  # 4 units are as fast as 7: give 3 back
    # off: the last group is split like any other
    d = policy(est=est, hand_back="off").decide(prefill_view(0.5, [], inflight=batch, peer=peer))
    assert "hand units back" not in d.reason


def test_last_layers_hand_back_by_one_decode_step_as_before():
    est = FakePredictor()
    r = req("a", 800, 0.0)
    batch = inflight([r], layers_done=LAYERS - K)  # the last group of layers
    peer = decode_state(batch=10, context=5000, tpot_p90_ms=30)
    d = policy(ttft="10s", est=est, hand_back="decode-step").decide(prefill_view(0.5, [], inflight=batch, peer=peer))
    # usual share 7 units: the group takes 0.1 s / 7 = 14 ms; one decode step on 1 unit is 30 ms, so
    # the group may take up to 44 ms: 3 units (33 ms). Not 1 unit, which TTFT alone would allow (100
    # ms): the next arrival would wait behind a slow tail.
    assert d.units == 3 and "hand units back" in d.reason
    assert d.num_layers == K
    # not the last layers: prefill keeps its priority share
    d = policy(est=est).decide(prefill_view(0.5, [], inflight=inflight([r], layers_done=8), peer=peer))
    assert d.units == TOTAL - 1


def test_decision_publishes_predictions_and_feedback_reaches_the_estimator():
    est = FakePredictor()
    p = policy(est=est)
    view = prefill_view(1.0, [req("a", 500, 0.5)])
    d = p.decide(view)
    assert d.predictions.ttft_pred_p90_ms == pytest.approx((1.0 + 0.5 / TOTAL - 0.5) * 1e3)
    assert d.predicted_s == pytest.approx(500e-3 / TOTAL * K / LAYERS)
    p.observe(d, 0.02, view)
    kind, args, kw = est.observed[-1]
    assert kind == "prefill" and args[0] == [500] and kw["num_layers"] == K
    # the last group reports the layers it really ran
    last = p.decide(prefill_view(1.0, [], inflight=inflight([req("b", 500, 0.5)], layers_done=LAYERS - 2)))
    assert last.num_layers == 2


# -- the decode scheduler ---------------------------------------------------------------------------

def dpolicy(tpot="100ms", idle_units="all", yield_at="layer", feasible=None):
    return BulletDecodePolicy(FakePredictor(), SLO.parse("10s", tpot), feasible or list(range(1, TOTAL + 1)),
                              idle_units, yield_at=yield_at)


def test_decode_takes_every_unit_while_prefill_is_idle():
    running = [req("a", 10, 0.0, outputs=5, first_token_time=0.0)]
    d = dpolicy().decide(decode_view(1.0, running, WorkerState()))
    assert d.run and d.units == TOTAL


def test_efficient_idle_decode_takes_only_the_units_that_speed_it_up():
    # the fake's decode step saturates at 2 units: more buy nothing, so 6 stay free for the next prompt
    running = [req("a", 10, 0.0, outputs=5, first_token_time=0.0)]
    d = dpolicy(idle_units="efficient").decide(decode_view(1.0, running, WorkerState()))
    assert d.run and d.units == 2 and "the rest wait for prompts" in d.reason
    # prefill busy: the complement of its share, as with every rule
    d = dpolicy(idle_units="efficient").decide(decode_view(1.0, running, WorkerState(remaining_layers=8,
                                                                                     compute_units=3)))
    assert d.units == TOTAL - 3
    with pytest.raises(ValueError, match="idle_units"):
        dpolicy(idle_units="some")


def test_mid_step_decode_gives_prefill_the_units_it_claimed_at_the_next_layer():
    arrived = WorkerState(remaining_layers=30, compute_units=3)  # prefill started on 3 of the 8 units
    layer = dpolicy()
    assert layer.units_mid_step(arrived, current_units=TOTAL) == TOTAL - 3  # what its next step would take
    assert layer.units_mid_step(arrived, current_units=TOTAL - 3) is None  # no unit held twice: go on
    assert layer.units_mid_step(WorkerState(), current_units=TOTAL) is None  # prefill idle
    # prefill takes every unit (a burst): decode goes on with its smallest share rather than stop mid-step
    assert layer.units_mid_step(WorkerState(remaining_layers=4, compute_units=TOTAL), current_units=TOTAL) == 1
    # units come in steps (GPC or TPC granularity): the complement is rounded down to one, never into
    # prefill's units
    coarse = dpolicy(yield_at="layer", feasible=[2, 4, 6, 8])
    assert coarse.units_mid_step(WorkerState(remaining_layers=30, compute_units=5), current_units=8) == 2
    # "step" (the rule before) keeps a step's share to its end
    assert dpolicy(yield_at="step").units_mid_step(arrived, current_units=TOTAL) is None
    with pytest.raises(ValueError, match="yield_at"):
        dpolicy(yield_at="token")


def test_decode_follows_prefills_share_and_pauses_when_it_takes_everything():
    running = [req("a", 10, 0.0, outputs=50, first_token_time=0.0)]  # 50 tokens in 1 s: 20 ms each
    d = dpolicy().decide(decode_view(1.0, running, WorkerState(remaining_layers=8, compute_units=6)))
    assert d.run and d.units == 2
    d = dpolicy().decide(decode_view(1.0, running, WorkerState(remaining_layers=8, compute_units=TOTAL)))
    assert not d.run and d.predictions.pause_budget_ms > 0


def test_decode_runs_anyway_once_the_pause_budget_is_spent():
    running = [req("a", 10, 0.0, outputs=5, first_token_time=0.0)]  # 5 tokens in 1 s: already late
    d = dpolicy().decide(decode_view(1.0, running, WorkerState(remaining_layers=8, compute_units=TOTAL)))
    assert d.run and d.units == 1 and "budget spent" in d.reason  # 21 ms on 1 unit keeps 0.9 x 100 ms
    assert d.predictions.pause_budget_ms < 0
    # 30 requests: 50 ms on 1 unit, 25 ms on 2 — under a 40 ms target it takes the 2 that keep it
    # (on the smallest share its step would spend the TPOT its pause saved)
    crowd = [req(f"r{i}", 10, 0.0, outputs=5, first_token_time=0.0) for i in range(30)]
    d = dpolicy(tpot="40ms").decide(decode_view(1.0, crowd, WorkerState(remaining_layers=8, compute_units=TOTAL)))
    assert d.run and d.units == 2 and "budget spent" in d.reason


def test_a_tbt_target_bounds_the_pause_tpot_slack_would_allow():
    """TPOT is a mean over a request's life: 50 tokens in 1 s under a 100 ms target leave seconds of
    slack, so without a TBT target decode pauses; with `--tbt-slo 60ms` the gap since the last step's
    tokens (40 ms ago) plus the next step may not pass 60 ms, so it runs on a shared unit instead."""
    from dataclasses import replace

    running = [req("a", 10, 0.0, outputs=50, first_token_time=0.0)]
    burst = WorkerState(remaining_layers=8, compute_units=TOTAL)
    view = replace(decode_view(1.0, running, burst), last_step_end=0.96)
    assert not dpolicy().decide(view).run  # TPOT alone: pause
    tbt = BulletDecodePolicy(FakePredictor(), SLO.parse("10s", "100ms", "60ms"), list(range(1, TOTAL + 1)))
    d = tbt.decide(view)
    assert d.run and "budget spent" in d.reason and d.predictions.pause_budget_ms < 0
    # just after a step the same target leaves room for a pause
    d = tbt.decide(replace(view, last_step_end=0.999))
    assert not d.run and 0 < d.predictions.pause_budget_ms < 60
    # a request that joined after the last step counts its gap from its first token
    fresh = [req("b", 10, 0.0, outputs=1, first_token_time=0.999)]
    assert not tbt.decide(replace(decode_view(1.0, fresh, burst), last_step_end=0.5)).run


def test_a_tbt_target_that_does_not_parse_stops_the_launch():
    from pydantic import ValidationError

    from bullet.config import ServerArgs

    assert ServerArgs(tbt_slo="80ms").tbt_slo == "80ms"
    for field, bad in (("tbt_slo", "2ms/token"), ("tbt_slo", "soon"), ("tpot_slo", "-5ms"), ("ttft_slo", "x")):
        with pytest.raises(ValidationError, match="duration|per-token|positive"):
            ServerArgs(**{field: bad})


def test_decode_publishes_tpot_p90_of_its_requests():
    running = [req(f"r{i}", 10, 0.0, outputs=10, first_token_time=0.0) for i in range(9)]
    running.append(req("slow", 10, 0.0, outputs=2, first_token_time=0.0))
    d = dpolicy().decide(decode_view(1.0, running, WorkerState()))
    step = (0.020 + 0.010) / 2
    assert d.predictions.tpot_pred_p90_ms == pytest.approx((1.0 + step) / 10 * 1e3)
    assert d.predictions.tpot_pred_p90_ms < (1.0 + step) / 2 * 1e3  # P90 ignores the one outlier


# -- layer-boundary preemption (MuxWise §3.3) ------------------------------------------------------

def _long_in_flight(ttft="3ms/token"):
    long = req("long", 2000, 0.0)
    return long, inflight([long], layers_done=K)  # one group done; ~0.25 s of it left on 7 units


def test_a_short_prompt_that_would_miss_behind_a_long_batch_preempts_it():
    long, batch = _long_in_flight()
    short = req("short", 50, 0.04)  # target 150 ms: behind the long batch it would wait ~0.25 s
    d = policy(ttft="3ms/token").decide(prefill_view(0.05, [short], inflight=batch))
    assert d.preempt and d.admit == [short] and "preempt" in d.reason
    assert d.lengths == [50] and d.num_layers == K  # the step runs the short prompt's first group


def test_no_preemption_while_a_preempted_batch_waits():
    long, batch = _long_in_flight()
    other = inflight([req("first-preemptor", 40, 0.01)], layers_done=0)
    view = prefill_view(0.05, [req("short", 50, 0.04)], inflight=other)
    view.suspended = batch
    d = policy(ttft="3ms/token").decide(view)
    assert not d.preempt and not d.admit


def test_preemption_never_costs_the_waiting_batch_its_ttft():
    long = req("long", 2000, 0.0)
    batch = inflight([long], layers_done=K)
    # on all 8 units at 0.14 ms/token the long batch finishes at 269 ms against its 280 ms target; the
    # short prompt (200 tokens, 28 ms target) meets its target only if it runs now (25 ms) — which
    # would push the long batch to 294 ms, past its own
    short = req("short", 200, 0.05)
    d = policy(ttft="0.14ms/token").decide(prefill_view(0.05, [short], inflight=batch))
    assert not d.preempt
    # a looser target for everyone: the delay no longer costs the long batch its TTFT, so it preempts
    assert policy(ttft="0.16ms/token").decide(prefill_view(0.05, [req("short", 200, 0.05)], inflight=batch)).preempt


def test_only_prompts_that_preemption_saves_preempt():
    long, batch = _long_in_flight()
    fine = req("fine", 50, 0.04)  # target 1 s: it can wait
    d = policy(ttft="20ms/token").decide(prefill_view(0.05, [fine], inflight=batch))
    assert not d.preempt
    recomputed = req("recomputed", 50, 0.0, outputs=3, first_token_time=0.01)  # decode handed it back
    d = policy(ttft="3ms/token").decide(prefill_view(0.05, [recomputed], inflight=batch))
    assert not d.preempt
    d = policy(ttft="3ms/token", preemption=False).decide(prefill_view(0.05, [req("short", 50, 0.04)], inflight=batch))
    assert not d.preempt


# -- an H200's green-context pool: 16 groups of 8 SMs + 4 the whole device only holds ---------------

H200_POOL = list(range(8, 129, 8)) + [132]
H200_COARSE = [16, 32, 64, 96, 112, 132]  # one coarse pool for both roles, the remainder in the full entry only
# the servers' pools (GroupLayout.coarse_counts on 16 groups of 8 + 4): decode's whole groups, prefill's
# the complements with the remainder
H200_COARSE_DECODE = [8, 16, 32, 64, 96, 112, 120, 132]
H200_COARSE_PREFILL = [12, 20, 36, 68, 100, 116, 124, 132]


class H200Decode(FakePredictor):
    """Decode flat in SMs, as the H200's eager profile measured it (2026-11-26, driver 13.0:
    decode[32x1024] 71 ms on 24 SMs, 72 ms on 132)."""

    def decode_time(self, batch, context, units, co_prefill_tokens=0):
        return 0.020 + 0.0015 * batch


@pytest.mark.parametrize("pool", [H200_POOL, H200_COARSE])
def test_decode_never_reaches_into_prefills_groups_on_a_pool_with_a_remainder(pool):
    running = [req("a", 10, 0.0, outputs=50, first_token_time=0.0)]
    decode = BulletDecodePolicy(H200Decode(), SLO.parse("10s", "50ms"), pool)
    for prefill_units in pool[:-1]:
        d = decode.decide(decode_view(1.0, running, WorkerState(remaining_layers=8, compute_units=prefill_units)))
        if 132 - prefill_units < pool[0]:  # 128 leaves 4 SMs, no share: decode pauses while its budget lasts
            assert not d.run and "paused" in d.reason
            continue
        assert d.run and d.units + prefill_units <= 132 and d.units in pool, (prefill_units, d.units)
        assert d.units == max(u for u in pool if u <= 132 - prefill_units)  # the largest that fits
    assert decode.units_mid_step(WorkerState(remaining_layers=30, compute_units=pool[0]), 132) == \
        max(u for u in pool if u <= 132 - pool[0])


def test_with_decode_flat_in_sms_the_split_gives_decode_its_fewest_units_on_the_coarse_pool():
    """A decode step that costs the same on every share holds TPOT on the smallest one: prefill takes the
    rest, and the decode share it leaves is one of the pool's (no share outside it, so no CUDA graph
    the decode worker did not capture at start)."""
    peer = decode_state(batch=8, context=8 * 1100, tpot_p90_ms=30.0, pause_budget_ms=5.0)
    view = PrefillView(now=1.0, queue=[req("q", 1000, 0.9)], inflight=None, peer=peer, total_units=132,
                       current_units=132, free_pages=100_000, page_size=16)
    p = BulletPrefillPolicy(H200Decode(), SLO.parse("3ms/token", "50ms"), H200_COARSE, K, LAYERS, 4096,
                            lambda units: 4096)
    d = p.decide(view)  # one pool for both roles: decode keeps 16 SMs (20 left, rounded down), 4 idle
    assert d.units == 112 and "fewest units" in d.reason
    assert p.decode_gets(132 - d.units) == 16 and 16 in H200_COARSE
    # the servers' pools: decode keeps its smallest, 8 SMs, and prefill the other 124, none idle
    p = BulletPrefillPolicy(H200Decode(), SLO.parse("3ms/token", "50ms"), H200_COARSE_PREFILL, K, LAYERS, 4096,
                            lambda units: 4096, decode_units=H200_COARSE_DECODE)
    d = p.decide(view)
    assert d.units == 124 and p.decode_gets(132 - d.units) == 8 and d.units + 8 == 132


def test_with_the_h200_profile_decode_gets_few_sms_and_prefill_the_rest():
    """The estimator `--policy bullet` calibrates from the H200's profile (decode flat in SMs, prefill
    scaling 4x from 24 to 132 SMs), the run's SLOs (3 ms/token, 50 ms) and the servers' coarse pool. With
    TPOT holding and a prompt queued, no share is predicted to keep decode within 45 ms beside a prefill,
    so decode takes the fewest SMs near its best step — at most half of the 132 (beside a 1000-token
    prefill the calibrated contention makes small shares dearer), not the 112 it took before."""
    from tests.policies.h200_profile import h200_estimator

    est = h200_estimator()
    assert est.prefill_time([2048], 24) > 3.5 * est.prefill_time([2048], 132)
    for batch, ctx in ((8, 2048), (32, 1024)):
        times = [est.decode_time(batch, batch * ctx, u) for u in (24, 40, 72, 132)]
        assert max(times) < 1.3 * min(times), times  # flat: launch-bound eager steps
    p = BulletPrefillPolicy(est, SLO.parse("3ms/token", "50ms"), H200_COARSE, K, LAYERS, 4096, lambda units: 4096)
    for batch in (1, 8, 17):
        peer = decode_state(batch=batch, context=batch * 1100, tpot_p90_ms=30.0, pause_budget_ms=5.0)
        view = PrefillView(now=1.0, queue=[req("q", 1000, 0.9)], inflight=None, peer=peer, total_units=132,
                           current_units=132, free_pages=100_000, page_size=16)
        d = p.decide(view)
        decode_units = p.decode_gets(132 - d.units)
        assert d.admit and decode_units <= 64 and d.units >= 64, (batch, d.units, d.reason)
        assert "near its best" in d.reason
        best = min(est.decode_time(batch, batch * 1100, u, co_prefill_tokens=1000) for u in H200_COARSE[:-1])
        assert est.decode_time(batch, batch * 1100, decode_units, co_prefill_tokens=1000) <= 1.1 * best


# -- complementary pools: the remainder of the device goes with prefill's shares ---------------------

def test_with_a_remainder_prefill_and_decode_shares_add_up_to_the_device():
    """16 groups of 8 and 4 left (an H200's green contexts): prefill's shares carry the remainder, so
    the share decode is left beside each is exactly the rest, and the fewest-units rule lands on it."""
    from estimator.hardware import HardwareSpec

    hw = HardwareSpec.builtin("h200").model_copy(update={"partition_step": 8, "min_partition": 8})
    prefill_units, decode_units = hw.partition_sizes("prefill"), hw.partition_sizes("decode")
    assert prefill_units == list(range(12, 133, 8)) and decode_units == list(range(8, 129, 8)) + [132]
    assert hw.partition_sizes() == decode_units  # one pool for both, as before

    class Linear(FakePredictor):  # decode keeps the TPOT aim (TPOT_MARGIN of 100 ms) from 40 units on
        def decode_time(self, batch, context, units, co_prefill_tokens=0):
            return 0.9 * TPOT_MARGIN * 0.1 * 40 / units

    p = BulletPrefillPolicy(Linear(), SLO.parse("10s", "100ms"), prefill_units, K, LAYERS, 8192, lambda u: 10_000,
                            decode_units=decode_units)
    d = p.decide(PrefillView(now=1.0, queue=[req("a", 500, 0.9)], inflight=None,
                             peer=decode_state(batch=10, context=5000, tpot_p90_ms=30), total_units=132,
                             current_units=132, free_pages=10_000, page_size=16))
    decode = BulletDecodePolicy(Linear(), SLO.parse("10s", "100ms"), decode_units).complement(d.units)
    assert (d.units, decode) == (92, 40) and d.units + decode == 132


def test_the_throughput_goal_gives_decode_the_units_prefill_cannot_use():
    """`split_goal="throughput"`: a prefill batch that runs as fast on 4 units as on 7 (it cannot fill
    more) leaves the rest to decode, which is faster on them, while TTFT has slack; prefill-first keeps
    decode at the fewest units that hold TPOT."""

    class Small(FakePredictor):
        def prefill_time(self, seq_lens, units, num_layers=None, include_head=True, co_decode_batch=0):
            return super().prefill_time(seq_lens, min(units, 4), num_layers, include_head, co_decode_batch)

        def decode_time(self, batch, context, units, co_prefill_tokens=0):
            return 0.9 * TPOT_MARGIN * 0.1 / units  # one unit keeps the aim

    def decide(goal):
        p = BulletPrefillPolicy(Small(), SLO.parse("10s", "100ms"), list(range(1, TOTAL + 1)), K, LAYERS, 8192,
                                lambda u: 10_000, split_goal=goal)
        return p.decide(prefill_view(1.0, [req("a", 500, 0.9)], peer=decode_state(10, 5000, 30)))

    assert decide("prefill-first").units == TOTAL - 1  # 1 unit keeps the aim
    d = decide("throughput")
    assert d.units == 4 and "most work per second" in d.reason
    with pytest.raises(ValueError, match="split_goal"):
        BulletPrefillPolicy(Small(), SLO.parse("10s", "100ms"), [1, 2], K, LAYERS, 8192, lambda u: 1, split_goal="x")


def test_decode_takes_every_unit_for_a_step_in_which_prefills_batch_ends():
    """Prefill's last layer group (4 layers left, 4 per step, 5 ms predicted) ends within half of decode's
    next step (30 ms on the 2 units prefill leaves it, FakePredictor): decode starts that step on every
    unit instead of leaving prefill's 6 idle after its batch ends. Not with more queued, nor with a long
    tail, nor when the rule is off (prefill_layers_per_step 0)."""
    running = [req(f"r{i}", 10, 0.0, outputs=5, first_token_time=0.0) for i in range(10)]

    def decide(remaining=4, queued=0, step_ms=5.0, k=4):
        prefill = WorkerState(remaining_layers=remaining, queued_requests=queued, compute_units=6, step_pred_ms=step_ms)
        p = BulletDecodePolicy(FakePredictor(), SLO.parse("10s", "100ms"), list(range(1, TOTAL + 1)),
                               prefill_layers_per_step=k)
        return p.decide(decode_view(1.0, running, prefill))

    d = decide()
    assert d.units == TOTAL and "ends early" in d.reason
    assert decide(queued=1).units == 2  # more prompts behind it: prefill goes on with its share
    assert decide(remaining=16).units == 2  # four groups: 20 ms, more than half of the 30 ms step
    assert decide(k=0).units == 2  # the rule off


def test_the_slo_percentile_is_the_one_each_scheduler_keeps():
    """`--slo-percentile` reaches both schedulers through the factory; the published TPOT and the TTFT
    check read that nearest-rank percentile (the paper's P90 by default)."""
    from bullet.config import ServerArgs
    from bullet.policies.factory import make_decode_policy, make_prefill_policy
    from bullet.policies.predict import p90, percentile
    from tests.policies.fakes import LAYERS, FakePredictor

    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 0.9) == p90(values) == 9.0
    assert percentile(values, 0.5) == 5.0 and percentile(values, 1.0) == 10.0 and percentile([], 0.9) == 0.0
    units = [1, 2, 3, 4]
    for q in (0.8, 0.9, 0.99):
        args = ServerArgs(slo_percentile=q)
        assert make_prefill_policy(args, units, LAYERS, FakePredictor()).percentile == q
        assert make_decode_policy(args, units, FakePredictor()).percentile == q
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            ServerArgs(slo_percentile=bad)
