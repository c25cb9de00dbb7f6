"""Served results read for the simulator's replay and the served scoring: a bench_serving file with
per-request details (its inter-token latencies give P99 TBT), the GPU run's summary lines with their
load redrawn, and a replay of both through the simulator."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from artifact.bench_client import read_bench_file
from artifact.scoring import outcomes, summarize
from artifact.served_runs import (
    bench_serving_arrivals,
    load_generator_requests,
    nearest_rank,
    read_bench_runs,
    read_bench_serving,
    read_serve_jsonl,
)
from artifact.sim_validation import predict, rankings, validate
from bullet.sim import SimConfig
from bullet.types.slo import SLO

ROOT = Path(__file__).resolve().parents[2]
SERVE_JSONL = ROOT / "docs" / "sim" / "h200-2026-11-26" / "serve.jsonl"


def bench_file(tmp_path: Path) -> Path:
    """What `bench_serving --output-details` appends: one JSON object per run (here three requests)."""
    result = {"backend": "sglang", "request_rate": 2.0, "duration": 3.0, "output_throughput": 4.0,
              "input_lens": [120, 300, 40], "output_lens": [4, 4, 1], "ttfts": [0.05, 0.08, 0.02],
              "itls": [[0.01, 0.01, 0.30], [0.02, 0.02, 0.02], []], "errors": ["", "", ""],
              "generated_texts": ["a", "b", "c"]}
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"an": "earlier run"}) + "\n" + json.dumps(result) + "\n")
    return path


def test_bench_serving_itls_give_p99_tbt_and_judge_it(tmp_path):
    _, records = read_bench_file(bench_file(tmp_path))
    assert [r.token_gaps for r in records] == [(0.01, 0.01, 0.30), (0.02, 0.02, 0.02), ()]
    stalled, smooth, single = records
    assert stalled.tpot == pytest.approx(0.32 / 3) and stalled.tbt_p99 == pytest.approx(0.01 + 0.98 * 0.29)
    assert single.tbt_p99 is None
    slo = SLO.parse("1s", "150ms", "100ms")
    s = summarize(records, slo, duration=3.0)
    gaps = sorted([0.01, 0.01, 0.30, 0.02, 0.02, 0.02])
    assert s["p99_tbt_s"] == pytest.approx(gaps[4] + 0.95 * (gaps[5] - gaps[4]))
    assert s["tbt_attained"] == pytest.approx(2 / 3) and outcomes(records, slo) == [0, 1, 1]
    assert outcomes(records, SLO.parse("1s", "150ms")) == [1, 1, 1]  # TPOT alone hides the 300 ms stall


def test_bench_serving_run_replays_with_its_redrawn_arrivals(tmp_path):
    run = read_bench_serving(bench_file(tmp_path), "bullet", seed=7)
    np.random.seed(7)  # what bench_serving does before sending
    gaps = [np.random.exponential(1 / 2.0) for _ in range(2)]
    assert [a for a, _, _ in run.loads[0]] == pytest.approx([0.0, gaps[0], gaps[0] + gaps[1]])
    assert [(p, o) for _, p, o in run.loads[0]] == [(120, 4), (300, 4), (40, 1)]
    assert run.measured["ttft_p50_s"] == pytest.approx(0.05) and run.measured["p99_tbt_s"] > 0.2
    predicted = predict(run, SimConfig(), seed=0)
    assert predicted["completed"] == 3 and predicted["ttft_p50_s"] > 0
    # a file that records when each request was sent (artifact.loadgen's) replays those times
    path = bench_file(tmp_path)
    result = json.loads(path.read_text().splitlines()[-1])
    path.write_text(json.dumps({**result, "arrivals": [0.0, 0.5, 0.7]}) + "\n")
    assert [a for a, _, _ in read_bench_serving(path, "static").loads[0]] == [0.0, 0.5, 0.7]


def test_the_load_generators_draws_are_redrawn_exactly():
    got = load_generator_requests(4, rate=4.0, seed=3, in_min=10, in_max=20, out_len=8, vocab=1000)
    rng = random.Random(3)  # the generator's recipe, written out
    prompts = [[rng.randrange(100, 1000) for _ in range(rng.randint(10, 20))] for _ in range(4)]
    t, want = 0.0, []
    for p in prompts:
        want.append((t, len(p), 8))
        t += rng.expovariate(4.0)
    assert got == want
    assert nearest_rank([3.0, 1.0, 2.0, 4.0], 50) == 3.0 and nearest_rank([1.0, 2.0], 90) == 2.0


def test_the_gpu_runs_summaries_replay_and_rank():
    runs = read_serve_jsonl(SERVE_JSONL)
    assert [(r.system, r.rate, r.num_requests) for r in runs][:3] == [("bullet", 1.0, 30), ("bullet", 4.0, 120),
                                                                      ("bullet", 12.0, 120)]
    assert {r.system for r in runs} == {"bullet", "chunked:1024", "static"}
    lengths = [p for _, p, _ in runs[0].loads[0]]
    assert all(128 <= n <= 2048 for n in lengths) and {o for _, _, o in runs[0].loads[0]} == {128}
    # a replay on the shipped H200 profile, cut to the first 6 requests of each rate-1 run to stay fast
    from estimator.reference.profiles import H200_PROFILE

    small = [r for r in runs if r.rate == 1.0]
    for r in small:
        r.loads = [r.loads[0][:6]]
    base = SimConfig(estimator_profile=str(H200_PROFILE), max_total_tokens=131072, max_running_requests=128)
    rows = validate(small, base, seeds=[0], slo_rule=(0.003, 0.25, 0.05))
    assert all(set(r["error"]) >= {"ttft_p50_s", "tpot_p90_s", "out_tok_per_s"} for r in rows)
    ranks = rankings(rows)
    assert {r["metric"] for r in ranks} >= {"ttft_p50_s", "attainment"}
    assert all(sorted(r["measured"]) == sorted(r["predicted"]) == ["bullet", "chunked:1024", "static"] for r in ranks)


def test_every_run_of_a_loadgen_file_replays(tmp_path):
    """`artifact.loadgen` appends one line per rate, each with its arrivals: every line is a run; lines
    without per-request details are skipped; several runs without arrivals cannot share one seed."""
    line = {"output_throughput": 4.0, "input_lens": [120, 300], "output_lens": [4, 4], "ttfts": [0.05, 0.08],
            "itls": [[0.01] * 3, [0.02] * 3], "errors": ["", ""]}
    path = tmp_path / "bench-bullet.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (
        {"an": "earlier run"}, {**line, "request_rate": 1.0, "arrivals": [0.0, 0.9]},
        {**line, "request_rate": 4.0, "arrivals": [0.0, 0.2]})) + "\n")
    runs = read_bench_runs(path, "bullet")
    assert [r.rate for r in runs] == [1.0, 4.0]
    assert [[a for a, _, _ in r.loads[0]] for r in runs] == [[0.0, 0.9], [0.0, 0.2]]
    path.write_text("\n".join(json.dumps({**line, "request_rate": r}) for r in (1.0, 4.0)) + "\n")
    with pytest.raises(ValueError, match="one seed"):
        read_bench_runs(path, "bullet", seed=3)
    path.write_text(json.dumps({"an": "earlier run"}) + "\n")
    with pytest.raises(ValueError, match="per-request"):
        read_bench_runs(path, "bullet")


def test_requests_cut_at_the_load_generators_deadline_replay_whole_and_are_censored_alike(tmp_path):
    """`artifact.loadgen` cancels what still runs at its deadline and writes it with 0 tokens: the
    replay asks it for the count every request asked for and leaves out, as the served point did,
    whatever the simulation finishes after the deadline."""
    cut = "unfinished at the point's deadline (6 s)"
    n = 120
    line = {"request_rate": 100.0, "output_throughput": 100.0, "arrivals": [0.01 * i for i in range(n)],
            "input_lens": [2000] * n, "output_lens": [64] * 10 + [0] * (n - 10), "ttfts": [0.1] * 10 + [0.0] * (n - 10),
            "itls": [[0.02] * 63] * 10 + [[]] * (n - 10), "errors": [""] * 10 + [cut] * (n - 10)}
    path = tmp_path / "bench-static.jsonl"
    path.write_text(json.dumps(line) + "\n")
    [run] = read_bench_runs(path, "static")
    assert run.extra["deadline_s"] == 6.0 and "unfinished at its 6 s deadline: 110" in run.load
    assert [o for _, _, o in run.loads[0]] == [64] * n  # not 0 (read as 1 token before)
    assert run.measured["completed"] == 10
    from estimator.reference.profiles import H200_PROFILE

    config = SimConfig(estimator_profile=str(H200_PROFILE),
                       max_total_tokens=131072, noise=0.0, policy_error=0.0)
    censored = predict(run, config, seed=0)
    run.extra["deadline_s"] = 600.0
    whole = predict(run, config, seed=0)
    assert whole["completed"] == n
    assert censored["completed"] < n  # 120 prompts of 2000 tokens in 1.2 s: not all done 6 s after the first
    assert all(r.finish_time <= 6.0 for r in censored["records"])


def test_the_slo_rule_reads_durations_and_a_comparison_is_judged_by_its_own_slo(tmp_path):
    import argparse

    from artifact.sim_validation import comparison_slo_rule, slo_rule_arg

    assert slo_rule_arg("0.003,0.25,0.05") == (0.003, 0.25, 0.05)
    assert slo_rule_arg("3ms/token, 250ms, 50ms") == pytest.approx((0.003, 0.25, 0.05))
    assert slo_rule_arg("21.9ms/token,0,287ms") == pytest.approx((0.0219, 0.0, 0.287))
    assert slo_rule_arg("") == "none"
    for bad in ("21.9ms/token", "3ms/token,250ms,50ms/token", "fast,0,1"):
        with pytest.raises(argparse.ArgumentTypeError):  # argparse's one-line error, not a traceback
            slo_rule_arg(bad)
    # a CPU comparison scores by its own rule (TTFT 21.9 ms/token there), not the GPU run's 3 ms/token
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"slo": {"ttft_s_per_token": 0.0219, "tpot_s": 0.287}, "systems": {}}))
    assert comparison_slo_rule(str(results)) == (0.0219, 0.0, 0.287)
    results.write_text(json.dumps({"systems": {}}))
    assert comparison_slo_rule(str(results)) is None


def test_a_comparison_replays_with_the_slo_its_servers_were_started_with(tmp_path, monkeypatch):
    """`--comparison` gives the simulated policies the SLO the comparison started its servers with
    (`server_slo_flags`): replayed with the old 3 ms/token and 150 ms, Bullet's policy on the CPU run of
    2026-12-01 chose other prefills and the replay ranked it last where the served run ranked it first."""
    from artifact import sim_validation
    from artifact.slo_rule import server_slo_flags
    from estimator.reference.profiles import SHIPPED_PROFILE

    sharegpt = pytest.importorskip("bullet.workloads.sharegpt")
    try:
        sharegpt.repaired_sharegpt_path()
    except sharegpt.DatasetMissing as exc:
        pytest.skip(str(exc))
    pytest.importorskip("sglang")
    results = tmp_path / "results.json"
    summary = {"mean_ttft_s": 0.2, "p90_ttft_s": 0.4, "mean_tpot_s": 0.05, "p90_tpot_s": 0.06,
               "output_tok_per_s": 20.0, "completed": 4, "attainment": 1.0}
    results.write_text(json.dumps({
        "slo": {"ttft_s_per_token": 0.0219055, "tpot_s": 0.2870545},
        "args": {"rates": [2.0], "seed": 1, "repeats": 1, "num_prompts": 4, "context_len": 256, "output_len": 4},
        "systems": {"static": {"per_rate": {"2.0": summary}}}}))
    assert server_slo_flags(0.0219055, 0.2870545) == ("21.9055ms/token", "287.05ms")
    assert SLO.parse(*server_slo_flags(0.0219055, 0.2870545)).ttft == pytest.approx(0.0219055)

    def replay(*extra: str) -> dict:
        out = tmp_path / "validation"
        monkeypatch.setattr("sys.argv", ["sim_validation", "--comparison", str(results), "--profile",
                                         str(SHIPPED_PROFILE), "--max-total-tokens", "65536",
                                         "--max-running-requests", "64", "--seeds", "1", *extra, "--out", str(out)])
        assert sim_validation.main() == 0
        return json.loads(out.with_suffix(".json").read_text())

    data = replay()
    assert (data["config"]["ttft_slo"], data["config"]["tpot_slo"]) == ("21.9055ms/token", "287.05ms")
    assert data["slo_rule"] == pytest.approx([0.0219055, 0.0, 0.2870545])
    assert data["runs"][0]["predicted"]["ttft_p50_s"] > 0
    data = replay("--ttft-slo", "5ms/token")  # a flag given wins; the other target stays the comparison's
    assert (data["config"]["ttft_slo"], data["config"]["tpot_slo"]) == ("5ms/token", "287.05ms")
