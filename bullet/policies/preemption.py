"""Layer-boundary preemption of an in-flight prefill batch (MuxWise §3.3, here inside Bullet's
layer-wise prefill): a queued prompt that would miss its TTFT waiting behind the batch in flight,
but meets it if it runs now, starts at the next layer boundary; the in-flight batch waits with its
K/V in place and resumes afterwards.

Rules: a preempting batch is itself never preempted (no recursion: at most one batch waits);
preemption never makes a request of the waiting batch miss a TTFT it would otherwise meet; prompts
that already had their first token (decode handed them back to be recomputed) are not TTFT-bound
and never preempt; the preempting batch must fit in the free pages as it is."""

from __future__ import annotations

from typing import Sequence

from bullet.policies.predict import Predictor, prefill_seconds
from bullet.policies.views import InflightPrefill
from bullet.types.request import Request
from bullet.types.slo import SLO


def choose_preemptors(now: float, inflight: InflightPrefill, remaining_s: float, order: Sequence[Request],
                      ttfts: dict[Request, float], est: Predictor, slo: SLO, units: int, co_decode_batch: int,
                      max_tokens: int, free_pages: int, page_size: int) -> list[Request]:
    """The queued requests (in queue order) that should run ahead of `inflight`, or none.
    `remaining_s`: the in-flight batch's predicted time to finish; `ttfts`: each queued request's
    predicted TTFT if nothing is preempted."""
    chosen: list[Request] = []
    tokens = pages = 0
    for req in order:
        target = slo.ttft_target(len(req.prompt_ids))
        if req.first_token_time is not None or ttfts[req] <= target:
            continue  # not TTFT-bound, or makes its target by waiting
        n = req.num_uncomputed
        need = -(-n // page_size)
        if tokens + n > max_tokens or pages + need > free_pages:
            continue
        candidate = chosen + [req]
        run_s = prefill_seconds(est, [r.num_uncomputed for r in candidate], units, [r.num_cached for r in candidate],
                                co_decode_batch=co_decode_batch)
        if any(now + run_s - r.arrival > slo.ttft_target(len(r.prompt_ids)) for r in candidate):
            continue  # running now would not save it (or would cost one already chosen its target)
        if _costs_a_victim(now, inflight, remaining_s, run_s, slo):
            continue
        chosen, tokens, pages = candidate, tokens + n, pages + need
    return chosen


def _costs_a_victim(now: float, inflight: InflightPrefill, remaining_s: float, delay_s: float, slo: SLO) -> bool:
    """Would delaying the in-flight batch by `delay_s` make one of its requests miss a TTFT it meets?"""
    for r in inflight.requests:
        if r.first_token_time is not None:
            continue
        target = slo.ttft_target(len(r.prompt_ids))
        if now + remaining_s - r.arrival <= target < now + remaining_s + delay_s - r.arrival:
            return True
    return False
