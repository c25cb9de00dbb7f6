"""Per-request outcomes of a simulated run and their summary: SLO attainment (both targets, Bullet
§4.1), TTFT and TPOT statistics, time between tokens (TBT), throughput. The summary keys match the
served benchmarks' scoring (`artifact.scoring`), so the same report and plotting code reads real and
simulated runs.

TBT is every gap between two consecutive output tokens of a request (its inter-token latencies, as
`sglang.bench_serving` records them): `p99_tbt_s` is the P99 over all gaps of all requests (what a
user watching every stream sees), `*_request_p99_tbt_s` summarize each request's own P99 (what a TBT
SLO judges, `SLO.tbt`)."""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from dataclasses import dataclass

from bullet.types.finish import Abort
from bullet.types.request import Request
from bullet.types.slo import SLO


@dataclass(frozen=True, slots=True)
class RequestRecord:
    rid: str
    arrival: float
    input_len: int
    output_len: int
    first_token_time: float | None
    finish_time: float
    aborted: bool
    token_gaps: tuple[float, ...] = ()  # seconds between consecutive output tokens

    @property
    def tbt_p99(self) -> float | None:
        """P99 of this request's gaps between tokens (None with fewer than two tokens)."""
        return percentile(self.token_gaps, 99) if self.token_gaps else None

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
        # when each output token of each request in flight appeared, by uid (the executors stamp them)
        self.token_times: dict[int, list[float]] = {}

    def finished(self, req: Request) -> None:
        times = self.token_times.pop(req.uid, ())
        self.records.append(RequestRecord(req.rid, req.arrival, len(req.prompt_ids), len(req.output_ids),
                                          req.first_token_time, req.finish_time, isinstance(req.finish_reason, Abort),
                                          token_gaps(times)))


def token_gaps(times) -> tuple[float, ...]:
    """Gaps between consecutive token times (later minus earlier)."""
    return tuple(map(operator.sub, times[1:], times))


def tbt_summary(gaps_per_request: list) -> dict:
    """P50/P99 TBT over every gap of every request, and the mean / P50 / P90 of each request's own P99
    (NaN where no request had two tokens)."""
    pooled = sorted(itertools.chain.from_iterable(gaps_per_request))
    per_request = [percentile(gaps, 99) for gaps in gaps_per_request if gaps]
    ranked = sorted(per_request)
    return {"p50_tbt_s": percentile(pooled, 50, presorted=True), "p99_tbt_s": percentile(pooled, 99, presorted=True),
            "max_tbt_s": pooled[-1] if pooled else math.nan,
            "mean_request_p99_tbt_s": _mean(per_request),
            "p50_request_p99_tbt_s": percentile(ranked, 50, presorted=True),
            "p90_request_p99_tbt_s": percentile(ranked, 90, presorted=True)}


def percentile(values, q: float, presorted: bool = False) -> float:
    """Linear-interpolation percentile (numpy's default), NaN for no values."""
    if not values:
        return math.nan
    n = len(values)
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    if not presorted and n - lo <= n // 8:
        # a high percentile (a P99 of every request's gaps): the largest few values, not a full sort;
        # top[j] is sorted(values)[n - 1 - j]
        top = heapq.nlargest(n - lo, values)
        return top[n - 1 - lo] + (top[n - 1 - hi] - top[n - 1 - lo]) * (pos - lo)
    s = values if presorted else sorted(values)
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
    tbt_ok = [slo.tbt_ok(r.tbt_p99) for r in done] if slo.tbt is not None else [True] * len(done)
    attained = sum(1 for a, b, c in zip(ttft_ok, tpot_ok, tbt_ok) if a and b and c)
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
            **tbt_summary([r.token_gaps for r in done]),
            "tbt_attained": sum(tbt_ok) / len(done) if done else 0.0,
            "mean_norm_latency_s": _mean(norm),
            "output_tok_per_s": tokens / duration if duration > 0 else 0.0,
            "req_per_s": len(done) / duration if duration > 0 else 0.0,
            "duration_s": duration}

