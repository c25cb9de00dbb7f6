"""The arithmetic of one steady-state point of the served comparison, apart from any server.

A point sends Poisson arrivals for `window_s` seconds. The first `warmup_s` of them fill the
server's batches and are served like any other but left out of every metric: a point is judged on
the requests that arrived once the load had settled. After the last arrival the point drains until
every request has finished — but never past the longest time a request can take and still meet its
SLO (`slo_bound_s`), and it stops sooner once every request still running has already missed
(`certain_miss`): from then on nothing can change the point's attainment, so waiting would only
spend the run's minutes. Requests cut either way are counted as misses, never dropped.

Throughput is what the server delivered while the measured load lasted: requests (any) finished
between the end of the warm-up and the end of the arrivals, over that span — a drained burst's
"requests over the point's duration" reads higher or lower with the point's length.

Goodput is the highest rate with >= 90 % of its measured requests in SLO, with two intervals:
the bootstrap over requests (`artifact.stats.goodput_interval`) and the bracket between that rate
and the next one served (the true knee lies between them)."""

from __future__ import annotations

from artifact.bench_client import RequestRecord
from artifact.stats import goodput_interval, goodput_of, run_counts
from bullet.types.slo import SLO

THRESHOLD = 0.9


def slo_bound_s(slo: SLO, longest_prompt: int, output_tokens: int) -> float:
    """The longest a request can take from its send to its last token and still meet the SLO: its
    TTFT target, then every gap at the TPOT target."""
    return slo.ttft_target(longest_prompt) + slo.tpot * max(0, output_tokens - 1)


def certain_miss(rec, now_s: float, slo: SLO, output_tokens: int) -> bool:
    """Whether a request still running at `now_s` (seconds from the point's start) has already
    missed its SLO whatever happens next: no first token past its TTFT target, or a decode that
    has already taken longer than every gap at the TPOT target allows (its mean gap can only be
    higher). A request not yet sent has not missed."""
    if rec.sent_s is None:
        return False
    if rec.output_len == 0:
        return now_s - rec.sent_s > slo.ttft_target(rec.input_len)
    if rec.ttft > slo.ttft_target(rec.input_len):
        return True
    gaps = output_tokens - 1
    return gaps > 0 and now_s - (rec.sent_s + rec.ttft) > slo.tpot * gaps


def nothing_left_to_attain(records, now_s: float, slo: SLO, output_tokens: int) -> bool:
    """The point may stop: every request was sent, and each is finished (in SLO or not) or a
    certain miss."""
    return all(r.sent_s is not None for r in records) and all(
        r.ok or r.error or certain_miss(r, now_s, slo, output_tokens) for r in records)


def finish_s(rec) -> float | None:
    """When a finished request's last token came, from the point's start."""
    if not rec.ok or rec.sent_s is None:
        return None
    return rec.sent_s + rec.ttft + sum(rec.itl)


def _pct(values: list[float], p: float) -> float | None:
    import numpy as np  # deferred: as artifact.loadgen's percentiles

    return float(np.percentile(values, p)) if values else None


def point_summary(records, duration: float, slo: SLO, warmup_s: float, window_s: float) -> dict:
    """One point's metrics over the requests that arrived after the warm-up; a request that did not
    finish (cut at the drain's bound, stopped early as a certain miss, failed) misses."""
    measured = [r for r in records if r.arrival_s >= warmup_s]
    done = [r for r in measured if r.ok]
    bench = [RequestRecord(r.input_len, r.output_len, r.ttft, r.tpot, r.ok, tuple(r.itl)) for r in measured]
    hits = [bool(b.ok and slo.attained(b.input_len, b.ttft, b.tpot, b.tbt_p99)) for b in bench]
    span = max(window_s - warmup_s, 1e-9)
    finished_in_span = [r for r in records if (f := finish_s(r)) is not None and warmup_s <= f < window_s]
    tpots = [r.tpot for r in done if r.tpot is not None]
    errors = sorted({r.error for r in measured if r.error})
    n, attained = run_counts(hits)
    return {"requests": len(records), "warmup_requests": len(records) - len(measured), "measured": n,
            "completed": len(done), "attained": attained, "attainment": attained / n if n else 0.0,
            "cut": sum(1 for r in measured if not r.ok and r.error.startswith("unfinished")),
            "failed": sum(1 for r in measured if not r.ok and not r.error.startswith("unfinished")),
            "duration_s": duration, "req_per_s": len(finished_in_span) / span,
            "output_tok_per_s": sum(r.output_len for r in finished_in_span) / span,
            "ttft_p50_s": _pct([r.ttft for r in done], 50), "ttft_p90_s": _pct([r.ttft for r in done], 90),
            "tpot_p50_s": _pct(tpots, 50), "tpot_p90_s": _pct(tpots, 90),
            "itl_p99_s": _pct([g for r in done for g in r.itl], 99),
            "slo": slo.describe(), "errors": errors[:5]}


def goodput_summary(per_rate: dict[float, dict], threshold: float = THRESHOLD) -> dict:
    """Goodput of one system's points ({rate: point_summary}), its bootstrap interval over the
    measured requests and the bracket up to the next rate served (None above the highest)."""
    rates = sorted(per_rate)
    runs = {r: [(per_rate[r]["measured"], per_rate[r]["attained"])] for r in rates if per_rate[r]["measured"]}
    value = goodput_of(rates, [per_rate[r]["attainment"] for r in rates], threshold)
    above = [r for r in rates if r > value]
    out = {"goodput_req_s": value, "bracket": [value, above[0] if above else None], "threshold": threshold}
    if runs:
        out["interval"] = goodput_interval(runs, threshold=threshold).as_dict()
    return out
