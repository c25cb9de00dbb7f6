"""Time between tokens: P99 over every gap of every request and each request's own P99, from the
token times a run stamps, and a TBT target that judges stalls a mean TPOT hides."""

from __future__ import annotations

import math

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.metrics import RequestLog, percentile, summarize
from bullet.types.finish import Length
from bullet.types.request import Request
from bullet.types.slo import SLO
from engines.sampling_params import SamplingParams


def finished_request(uid: int, arrival: float, token_times: list[float], log: RequestLog) -> None:
    """A request whose output tokens appeared at `token_times`, logged as a run logs it."""
    req = Request(rid=f"r{uid}", prompt_ids=[1] * 100, params=SamplingParams(max_new_tokens=len(token_times)),
                  uid=uid, arrival=arrival)
    req.output_ids = [0] * len(token_times)
    req.first_token_time = token_times[0]
    req.finish(Length(length=len(token_times)), token_times[-1])
    log.token_times[uid] = list(token_times)
    log.finished(req)


def test_p99_tbt_of_a_hand_built_stream():
    log = RequestLog()
    # steady 10 ms tokens, then one 480 ms stall: its mean TPOT (127.5 ms) stays under 150 ms
    finished_request(1, 0.0, [0.10, 0.11, 0.12, 0.60, 0.61], log)
    # a smooth stream: 20 ms gaps
    finished_request(2, 0.0, [0.20 + 0.02 * k for k in range(11)], log)
    stalled, smooth = log.records
    assert stalled.token_gaps == pytest.approx((0.01, 0.01, 0.48, 0.01))
    assert smooth.token_gaps == pytest.approx((0.02,) * 10)
    # numpy-style linear interpolation: sorted gaps (0.01, 0.01, 0.01, 0.48), position 3 * 0.99 = 2.97
    assert stalled.tbt_p99 == pytest.approx(0.01 + 0.97 * 0.47)
    assert smooth.tbt_p99 == pytest.approx(0.02)
    assert stalled.tpot == pytest.approx(0.1275)

    s = summarize(log.records, SLO.parse("10s", "150ms", "100ms"), duration=1.0)
    # every gap of every request: 3 x 10 ms, 10 x 20 ms, 1 x 480 ms; position 13 * 0.99 = 12.87
    gaps = sorted([0.01] * 3 + [0.02] * 10 + [0.48])
    assert s["p99_tbt_s"] == pytest.approx(gaps[12] + 0.87 * (gaps[13] - gaps[12]))
    assert s["p50_tbt_s"] == pytest.approx(0.02) and s["max_tbt_s"] == pytest.approx(0.48)
    assert s["mean_request_p99_tbt_s"] == pytest.approx((stalled.tbt_p99 + 0.02) / 2)
    # both meet TPOT; only the smooth one meets the TBT target: attainment counts it either way
    assert s["tpot_attained"] == 1.0 and s["tbt_attained"] == 0.5 and s["attainment"] == 0.5
    assert summarize(log.records, SLO.parse("10s", "150ms"), duration=1.0)["attainment"] == 1.0


def test_single_token_requests_have_no_gaps():
    log = RequestLog()
    finished_request(1, 0.0, [0.3], log)
    s = summarize(log.records, SLO.parse("10s", "150ms", "50ms"), duration=1.0)
    assert log.records[0].tbt_p99 is None and math.isnan(s["p99_tbt_s"])
    assert s["attainment"] == 1.0  # nothing to judge: the TBT target holds


def test_a_run_stamps_every_token():
    requests = [(0.05 * i, 200 + 50 * i, 8 + i) for i in range(12)]
    sim = Simulation(SimConfig(policy="bullet", noise=0.0, tbt_slo="1s"), requests)
    result = sim.run()
    assert not sim.log.token_times  # every finished request took its times along
    for r in result.records:
        assert len(r.token_gaps) == r.output_len - 1
        assert all(g > 0 for g in r.token_gaps)
        assert sum(r.token_gaps) == pytest.approx(r.finish_time - r.first_token_time)
        assert r.tbt_p99 == percentile(r.token_gaps, 99)
    assert result.summary["tbt_attained"] == 1.0


def test_percentile_by_selection_equals_the_full_sort():
    """A high percentile takes the largest few values instead of sorting them all: the same number."""
    import random

    rng = random.Random(1)
    for n in [*range(1, 40), 100, 257, 1000]:
        values = [rng.choice((rng.random(), 0.5, 0.25)) for _ in range(n)]  # ties too
        for q in (0, 50, 90, 99, 99.9, 100):
            s = sorted(values)
            pos = (n - 1) * q / 100.0
            lo, hi = math.floor(pos), min(math.floor(pos) + 1, n - 1)
            assert percentile(values, q) == s[lo] + (s[hi] - s[lo]) * (pos - lo)
