"""The cross-process isolation check: its verdict on synthetic rates (every outcome), and the whole
measuring path — two real processes, each holding a share through the `cpu` backend — on the CPU,
where cores are the units."""

from __future__ import annotations

import os

import pytest

from bullet.doctor.isolation import (
    DISJOINT,
    FAILED,
    NOISY,
    PARTIAL,
    SHARED,
    IsolationSamples,
    judge_isolation,
)
from bullet.doctor.isolation_check import isolation_plan
from bullet.doctor.isolation_run import Side, measure_isolation, measure_pairs


def rates(alone_a, alone_b, together_a, together_b, **kw) -> IsolationSamples:
    return IsolationSamples(alone_a, alone_b, together_a, together_b, **kw)


def test_disjoint_shares_keep_their_rates():
    v = judge_isolation(rates([100, 102], [50, 51], [97, 99], [48, 49]))
    assert v.outcome == DISJOINT and v.isolated
    assert v.kept_a == pytest.approx(98 / 101) and v.kept_b == pytest.approx(48.5 / 50.5)


def test_time_sliced_or_shared_units_split_the_time():
    no_mps = judge_isolation(rates([100, 100], [100, 100], [50, 51], [49, 50]))  # two processes time-slice
    assert no_mps.outcome == SHARED and not no_mps.isolated
    uneven = judge_isolation(rates([100, 100], [60, 60], [70, 70], [20, 20]))  # 0.70 + 0.33
    assert uneven.outcome == SHARED


def test_partly_overlapping_shares_are_neither():
    v = judge_isolation(rates([100, 100], [100, 100], [75, 75], [92, 92]))  # A loses a quarter: 0.75 + 0.92
    assert v.outcome == PARTIAL and not v.isolated
    just_under = judge_isolation(rates([100], [100], [89], [99]))
    assert just_under.outcome == PARTIAL  # 89 % < 90 %: not proven disjoint


def test_a_whole_device_limit_is_not_taken_for_overlap():
    """Two halves of 64 SMs each keep 75 % together. If side A on all 132 SMs alone makes only 152
    where the halves alone make 100 + 100 (a power cap: every SM busy lowers the clocks), disjoint
    shares could keep no more than 74 % here: disjoint as far as the device allows. If the whole
    device scales (206), the same 75 % is overlap."""
    capped = judge_isolation(rates([100, 100], [100, 100], [75, 75], [76, 76], whole=[152, 152], units=(64, 64, 132)))
    assert capped.outcome == DISJOINT and capped.isolated
    assert capped.reference == pytest.approx(152 / 200 * 128 / 132) and "as far as this device allows" in capped.summary
    scales = judge_isolation(rates([100, 100], [100, 100], [75, 75], [76, 76], whole=[206, 206], units=(64, 64, 132)))
    assert scales.outcome == PARTIAL and scales.reference == pytest.approx(206 / 200 * 128 / 132) and "would keep 100%" in scales.summary
    # a plain time split stays shared, and without a whole-device rate nothing changes
    assert judge_isolation(rates([100], [100], [50], [50], whole=[150], units=(64, 64, 132))).outcome == SHARED
    assert judge_isolation(rates([100], [100], [75], [76])).outcome == PARTIAL
    assert judge_isolation(rates([100], [100], [75], [76], whole=[152])).reference is None  # units unknown


def test_noisy_rounds_are_not_judged():
    v = judge_isolation(rates([100, 70], [100, 100], [95, 95], [99, 99]))  # alone rounds of A differ by 35 %
    assert v.outcome == NOISY and v.spread == pytest.approx(30 / 85)
    faster_together = judge_isolation(rates([100], [100], [130], [100]))  # 130 % of alone: a clock moved
    assert faster_together.outcome == NOISY
    mild = judge_isolation(rates([100, 95], [100, 104], [96, 93], [100, 99]))  # 5 % jitter: still judged
    assert mild.outcome == DISJOINT


def test_a_side_that_fails_fails_the_verdict():
    v = judge_isolation(IsolationSamples(errors={"B": "green-ctx unavailable: driver lacks cuGreenCtxCreate"}))
    assert v.outcome == FAILED and "side B" in v.summary and "cuGreenCtxCreate" in v.summary
    assert judge_isolation(rates([100], [100], [100], [])).outcome == FAILED  # B never reported together
    assert judge_isolation(rates([100], [0.0], [100], [50])).outcome == FAILED  # B made no progress
    assert judge_isolation(rates([], [], [], [])).outcome == FAILED


def test_the_plan_halves_the_h200_from_opposite_ends():
    plan = {b: (a, s, flags) for b, a, s, flags in isolation_plan(132, "/opt/libsmctrl.so", True)}
    assert list(plan) == ["green-ctx", "libsmctrl", "mps-percentage"]
    a, b, _ = plan["green-ctx"]
    assert (a.role, a.units, b.role, b.units) == ("prefill", 64, "decode", 64)  # 8 groups of 8 each, 4 SMs spare
    assert plan["libsmctrl"][2] == ["--library", "/opt/libsmctrl.so", "--allow-untested-driver"]
    assert plan["mps-percentage"][0].env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "49"}
    assert [b for b, *_ in isolation_plan(132, None, False)] == ["green-ctx", "mps-percentage"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_two_processes_on_their_own_cores_and_on_a_shared_core_are_measured_and_judged():
    """The real measuring path with cores as units: processes A (prefill: the lowest core) and B
    (decode: the highest), then B on the lowest core too. Both runs start two real processes, each
    holds the share it asked for and reports a rate every round, and the verdict is the judge's on
    those very samples. Which verdict comes out is a timing (a CI machine's neighbours move it), so
    it is the doctor's to report on the machine it checks, not this test's to assert."""
    disjoint, shared = measure_pairs("cpu", Side("prefill", 1), [Side("decode", 1), Side("prefill", 1)], device="cpu",
                                     phase_s=0.3, rounds=2)
    for run in (disjoint, shared):
        assert run.verdict.outcome != FAILED, run.verdict.summary
        assert run.granted == {"A": 1, "B": 1}
        assert all(len(r) == 2 and min(r) > 0 for r in run.as_dict()["rates"].values())  # whole too
        assert run.verdict == judge_isolation(run.samples)
        # and A alone on every core, once, for the device's own limit
        assert run.samples.units == (1, 1, 2) and len(run.samples.whole) == 2 and min(run.samples.whole) > 0


def test_a_side_that_cannot_start_is_reported_not_raised():
    run = measure_isolation("no-such-backend", Side("prefill", 1), Side("decode", 1), device="cpu", phase_s=0.1,
                            rounds=1)
    assert run.verdict.outcome == FAILED and "side A" in run.verdict.summary and "no-such-backend" in run.verdict.summary
