"""Per-request outcomes of a simulated run and their summary: SLO attainment (both targets, Bullet
§4.1), TTFT and TPOT statistics, throughput. The summary keys match the served benchmarks' scoring (`artifact.scoring`),
so the same report and plotting code reads real and simulated runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bullet.core.finish import Abort
from bullet.core.request import Request
from bullet.core.slo import SLO


@dataclass(frozen=True, slots=True)
class RequestRecord:
    rid: str
    arrival: float
    input_len: int
    output_len: int
    first_token_time: float | None
    finish_time: float
    aborted: bool

    @property
    def ok(self) -> bool:
        return not self.aborted and self.first_token_time is not None

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with a single token)."""
        if self.output_len < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output_len - 1)


class RequestLog:
    def __init__(self):
        self.records: list[RequestRecord] = []

    def finished(self, req: Request) -> None:
        self.records.append(RequestRecord(req.rid, req.arrival, len(req.prompt_ids), len(req.output_ids),
                                          req.first_token_time, req.finish_time, isinstance(req.finish_reason, Abort)))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(records: list[RequestRecord], slo: SLO, duration: float, total_requests: int | None = None) -> dict:
    """Summary over `total_requests` (default: the records; requests without a record — e.g. still
    queued when a run was cut short — count as missing their SLO)."""
    total = len(records) if total_requests is None else total_requests
    done = [r for r in records if r.ok]
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    ttft_ok = [r.ttft <= slo.ttft_target(r.input_len) for r in done]
    tpot_ok = [r.tpot is None or r.tpot <= slo.tpot for r in done]
    attained = sum(1 for a, b in zip(ttft_ok, tpot_ok) if a and b)
    tokens = sum(r.output_len for r in done)
    # normalized latency (Bullet Fig. 17/18): end-to-end latency per output token
    norm = [(r.finish_time - r.arrival) / max(1, r.output_len) for r in done]
    return {"requests": total, "completed": len(done), "dropped": sum(1 for r in records if r.aborted),
            "attainment": attained / total if total else 0.0,
            "ttft_attained": sum(ttft_ok) / len(done) if done else 0.0,
            "tpot_attained": sum(tpot_ok) / len(done) if done else 0.0,
            "mean_ttft_s": _mean(ttft), "p50_ttft_s": percentile(ttft, 50), "p90_ttft_s": percentile(ttft, 90),
            "p99_ttft_s": percentile(ttft, 99),
            "mean_tpot_s": _mean(tpot), "p50_tpot_s": percentile(tpot, 50), "p90_tpot_s": percentile(tpot, 90),
            "p99_tpot_s": percentile(tpot, 99),
            "mean_norm_latency_s": _mean(norm),
            "output_tok_per_s": tokens / duration if duration > 0 else 0.0,
            "req_per_s": len(done) / duration if duration > 0 else 0.0,
            "duration_s": duration}

