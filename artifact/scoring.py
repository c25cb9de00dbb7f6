"""SLO attainment, goodput and latency summaries of benchmark runs."""

from __future__ import annotations

import numpy as np

from artifact.bench_client import RequestRecord
from bullet.core.slo import SLO


def attainment(records: list[RequestRecord], slo: SLO) -> float:
    """Share of requests that completed and met both targets (a failed request misses)."""
    if not records:
        return 0.0
    ok = sum(1 for r in records if r.ok and slo.attained(r.input_len, r.ttft, r.tpot))
    return ok / len(records)


def summarize(records: list[RequestRecord], slo: SLO, duration: float) -> dict:
    done = [r for r in records if r.ok]
    ttft = np.array([r.ttft for r in done]) if done else np.array([np.nan])
    tpot = np.array([r.tpot for r in done if r.tpot is not None]) if done else np.array([np.nan])
    tokens = sum(r.output_len for r in done)
    return {"requests": len(records), "completed": len(done), "attainment": attainment(records, slo),
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
