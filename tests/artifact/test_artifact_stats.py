"""Bootstrap intervals for attainment and goodput, the "tie" verdict (artifact/stats.py), and the
crossing's overrides."""

from __future__ import annotations

import numpy as np
import pytest

from artifact.scoring import add_intervals, goodput
from artifact.stats import (Interval, attainment_interval, attainment_replicates, goodput_interval, goodput_of,
                            run_counts, verdict)


def test_run_counts_and_the_pooled_estimate():
    assert run_counts([1, 0, True, False, 1]) == (5, 3)
    ci = attainment_interval([(50, 45)])
    assert ci.value == 0.9 and ci.low < 0.9 < ci.high
    assert attainment_interval([(50, 45), (50, 35)]).value == pytest.approx(0.8)
    with pytest.raises(ValueError):
        attainment_interval([(0, 0)])
    with pytest.raises(ValueError):
        attainment_interval([(3, 4)])


def test_one_run_spreads_like_the_request_bootstrap_without_collapsing_at_100_percent():
    """Away from 0 and 100 % the replicates spread as resampling the requests would; at 30 of 30
    the interval still admits that the true attainment may be lower."""
    rng = np.random.default_rng(1)
    outcomes = np.array([1] * 37 + [0] * 13)
    direct = rng.choice(outcomes, size=(20000, outcomes.size)).mean(axis=1)
    ours = attainment_replicates([run_counts(outcomes)], 20000, np.random.default_rng(2))
    assert ours.mean() == pytest.approx(direct.mean(), abs=0.01)
    assert ours.std() == pytest.approx(direct.std(), rel=0.05)
    assert np.percentile(ours, 2.5) == pytest.approx(np.percentile(direct, 2.5), abs=0.025)
    perfect = attainment_interval([(30, 30)])
    assert perfect.value == 1.0 and 0.85 < perfect.low < 0.99 and perfect.high == 1.0


def test_the_interval_covers_the_true_rate_about_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    p, n, trials = 0.8, 100, 400
    covered = 0
    for seed in range(trials):
        ci = attainment_interval([(n, int(rng.binomial(n, p)))], resamples=1000, seed=seed)
        covered += ci.low <= p <= ci.high
    assert 0.90 <= covered / trials <= 0.99


def test_intervals_narrow_with_more_requests_and_widen_with_disagreeing_runs():
    small = attainment_interval([(20, 16)])
    large = attainment_interval([(2000, 1600)])
    assert (large.high - large.low) < (small.high - small.low) / 5
    agreeing = attainment_interval([(50, 40), (50, 40), (50, 40)])
    disagreeing = attainment_interval([(50, 30), (50, 40), (50, 50)])
    assert agreeing.value == disagreeing.value == pytest.approx(0.8)
    assert (disagreeing.high - disagreeing.low) > 1.5 * (agreeing.high - agreeing.low)


def test_goodput_interval_brackets_the_crossing():
    per_rate = {0.5: [(50, 50)], 1.0: [(50, 48)], 1.5: [(50, 45)], 2.0: [(50, 20)]}
    ci = goodput_interval(per_rate)
    assert ci.value == goodput_of(list(per_rate), [1.0, 0.96, 0.9, 0.4]) == 1.5
    assert ci.low in (0.5, 1.0) and ci.high == 1.5  # 45/50 sits on the threshold: often below it
    clear = goodput_interval({1.0: [(400, 400)], 2.0: [(400, 396)], 3.0: [(400, 100)]})
    assert (clear.value, clear.low, clear.high) == (2.0, 2.0, 2.0)
    assert goodput_interval({1.0: [(50, 10)]}).as_dict() == {"value": 0.0, "low": 0.0, "high": 0.0}


def test_verdict_is_a_tie_when_intervals_overlap():
    a, b, c = Interval(0.9, 0.82, 0.96), Interval(0.86, 0.78, 0.93), Interval(0.6, 0.5, 0.7)
    assert verdict(a, b, "bullet", "static") == "tie"
    assert verdict(a, c, "bullet", "naive") == "bullet higher"
    assert verdict(c, a, "bullet", "chunked") == "chunked higher"
    assert Interval.from_dict(a.as_dict()) == a


def test_add_intervals_marks_each_system_against_bullet():
    def system(hits_per_rate):
        per_rate = {r: {"attainment": h / 100, "runs": [(100, h)]} for r, h in hits_per_rate.items()}
        return {"per_rate": per_rate, "goodput": goodput(per_rate)}

    results = add_intervals({"bullet": system({1.0: 99, 2.0: 95}), "same": system({1.0: 98, 2.0: 93}),
                             "worse": system({1.0: 60, 2.0: 20})})
    assert results["bullet"]["goodput_ci"]["value"] == 2.0
    assert results["same"]["vs_bullet"] == {"goodput": "tie", "attainment": {1.0: "tie", 2.0: "tie"}}
    assert results["worse"]["vs_bullet"]["goodput"] == "bullet higher"
    assert results["worse"]["vs_bullet"]["attainment"][2.0] == "bullet higher"
    assert "vs_bullet" not in results["bullet"]


def test_crossing_overrides_read_json_else_strings():
    from artifact.crossing import parse_override

    assert parse_override("policy_error=0.1") == ("policy_error", 0.1)
    assert parse_override("policy_error_learnable=false") == ("policy_error_learnable", False)
    assert parse_override("split_rule=aggregate") == ("split_rule", "aggregate")
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_override("split_rule")


def test_the_report_warns_when_the_machine_speed_drifted_between_systems():
    from artifact.report import speed_drift_lines

    steady = {"bullet": {"cpu_probe_s": {"before": 0.100, "after": 0.104}},
              "static": {"cpu_probe_s": {"before": 0.102, "after": 0.101}}}
    lines = speed_drift_lines(steady)
    assert "bullet 100 / 104 ms" in lines[1] and "1.04x" in lines[1] and not any("Warning" in l for l in lines)
    drifted = {**steady, "static": {"cpu_probe_s": {"before": 0.160, "after": 0.150}}}
    assert any("Warning" in line and "1.60x" in line for line in speed_drift_lines(drifted))
    assert speed_drift_lines({"bullet": {"per_rate": {}}}) == []
    shared = {"cpu_probe_s": {"before": 0.100, "after": 0.160}}  # --interleave: one probe pair for the run
    (line,) = [l for l in speed_drift_lines({"bullet": shared, "static": shared}) if l]
    assert "took turns" in line and "1.60x" in line and "Warning" not in line


def test_every_point_of_a_sweep_samples_other_prompts():
    from artifact.bench_client import point_seed

    seeds = {point_seed(1, rate, rep) for rate in range(6) for rep in range(3)}
    assert len(seeds) == 18  # a prefix cache never sees a point's prompts again at a later point
    assert point_seed(1, 2, 1) == point_seed(1, 2, 1)  # and every system gets the same ones


def test_interleaved_systems_take_turns_in_a_rotating_order():
    from artifact.cpu_comparison import turns

    systems = ["bullet", "sglang:1024", "static"]
    orders = [turns(systems, point) for point in range(6)]
    assert all(sorted(o) == sorted(systems) for o in orders)  # everyone runs at every point
    # none always goes first: on a machine that slows down over the run, first is an advantage
    assert [o[0] for o in orders] == systems * 2


def test_a_goodput_outside_the_rates_run_is_reported_as_a_bound():
    from artifact.report import goodput_cell

    ci = {"value": 6.0, "low": 5.0, "high": 6.0}
    bracketed = {"goodput": 5.0, "goodput_ci": {"value": 5.0, "low": 4.0, "high": 6.0},
                 "per_rate": {"4.0": {}, "5.0": {}, "6.0": {}}}
    assert goodput_cell(bracketed) == "5 [4, 6]"
    # no rate reached 90 %: the goodput lies below the lowest rate run, it is not 0
    assert goodput_cell({"goodput": 0.0, "goodput_ci": {"value": 0.0, "low": 0.0, "high": 0.0},
                         "per_rate": {"5.0": {}, "6.0": {}}}) == "< 5"
    # the highest rate run still reached it: the goodput is at least that
    assert goodput_cell({"goodput": 6.0, "goodput_ci": ci, "per_rate": {"4.0": {}, "6.0": {}}}) == "≥ 6 [5, 6]"


def test_bullets_goodput_over_a_system_that_reached_no_rate_is_a_lower_bound():
    from artifact.report import comparison_markdown

    def system(goodput, attained):
        per_rate = {str(rate): {"attainment": a, "ttft_attained": a, "tpot_attained": 1.0, "mean_ttft_s": 0.5,
                                "p90_ttft_s": 1.0, "mean_tpot_s": 0.1, "p90_tpot_s": 0.2, "output_tok_per_s": 200.0}
                    for rate, a in attained.items()}
        return {"goodput": goodput, "per_rate": per_rate}

    table = comparison_markdown({"bullet": system(6.0, {5.0: 0.95, 6.0: 0.92, 7.0: 0.87}),
                                 "chunked:1024": system(0.0, {5.0: 0.79, 6.0: 0.55, 7.0: 0.50})}, [5.0, 6.0, 7.0], "rule")
    assert "| chunked:1024 | < 5 | > 1.20x |" in table
