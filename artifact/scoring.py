"""SLO attainment, goodput and latency summaries of benchmark runs."""

from __future__ import annotations

import numpy as np

from artifact.bench_client import RequestRecord
from artifact.stats import Interval, attainment_interval, goodput_interval, verdict
from bullet.sim.metrics import tbt_summary
from bullet.types.slo import SLO


def outcomes(records: list[RequestRecord], slo: SLO) -> list[int]:
    """1 for each request that completed and met its targets (TTFT, TPOT, and P99 TBT where the SLO
    has one), 0 otherwise (a failed request misses): what `artifact.stats` bootstraps over."""
    return [int(r.ok and slo.attained(r.input_len, r.ttft, r.tpot, r.tbt_p99)) for r in records]


def attainment(records: list[RequestRecord], slo: SLO) -> float:
    """Share of requests that completed and met both targets (a failed request misses)."""
    return sum(outcomes(records, slo)) / len(records) if records else 0.0


def summarize(records: list[RequestRecord], slo: SLO, duration: float) -> dict:
    done = [r for r in records if r.ok]
    ttft = np.array([r.ttft for r in done]) if done else np.array([np.nan])
    tpot = np.array([r.tpot for r in done if r.tpot is not None]) if done else np.array([np.nan])
    tokens = sum(r.output_len for r in done)
    return {"requests": len(records), "completed": len(done), "attainment": attainment(records, slo),
            **tbt_summary([r.token_gaps for r in done]),
            "tbt_attained": float(np.mean([slo.tbt_ok(r.tbt_p99) for r in done])) if done else 0.0,
            "ttft_attained": float(np.mean([r.ttft <= slo.ttft_target(r.input_len) for r in done])) if done else 0.0,
            "tpot_attained": float(np.mean([r.tpot is None or r.tpot <= slo.tpot for r in done])) if done else 0.0,
            "mean_ttft_s": float(np.nanmean(ttft)), "p90_ttft_s": float(np.nanpercentile(ttft, 90)),
            "mean_tpot_s": float(np.nanmean(tpot)), "p90_tpot_s": float(np.nanpercentile(tpot, 90)),
            "output_tok_per_s": tokens / duration if duration > 0 else 0.0,
            "req_per_s": len(done) / duration if duration > 0 else 0.0}


def goodput(rate_results: dict[float, dict], threshold: float = 0.9) -> float:
    """Highest request rate whose attainment is at least `threshold` (0 when none is)."""
    good = [rate for rate, s in rate_results.items() if s["attainment"] >= threshold]
    return max(good) if good else 0.0


def add_intervals(systems: dict, reference: str = "bullet") -> dict:
    """Add bootstrap intervals to a comparison's results, in place, and return it.

    `systems` is {system: {"per_rate": {rate: summary}}} where each summary holds "runs": a list of
    [requests, attained] per run (`artifact.stats.run_counts`). Adds each summary's "attainment_ci", each
    system's "goodput_ci", and "vs_<reference>": per rate and for goodput, "tie" when the intervals
    overlap, else which is higher (artifact/stats.py)."""
    for res in systems.values():
        per_rate = res["per_rate"]
        for s in per_rate.values():
            s["attainment_ci"] = attainment_interval(s["runs"]).as_dict()
        res["goodput_ci"] = goodput_interval({float(r): s["runs"] for r, s in per_rate.items()}).as_dict()
    ref = systems.get(reference)
    if ref is None:
        return systems
    for system, res in systems.items():
        if system == reference:
            continue
        per_rate = {}
        for rate, s in res["per_rate"].items():
            mine = ref["per_rate"].get(rate)
            if mine is not None:
                per_rate[rate] = verdict(Interval.from_dict(mine["attainment_ci"]), Interval.from_dict(s["attainment_ci"]),
                                         reference, system)
        res[f"vs_{reference}"] = {
            "goodput": verdict(Interval.from_dict(ref["goodput_ci"]), Interval.from_dict(res["goodput_ci"]),
                               reference, system),
            "attainment": per_rate}
    return systems
