"""Latency predictions the SLO-aware policies need, built on the estimator (Bullet §3.3.2):
TTFT of every in-flight and queued prefill request, the next decode step, each running decode
request's TPOT and how long decode could pause without breaking it.

`Predictor` is the small interface the policies call; `estimator.Estimator` satisfies it, and tests
use a simple analytic stand-in."""

from __future__ import annotations

import math
from typing import Iterator, Protocol, Sequence

from bullet.types.request import Request
from bullet.types.slo import SLO


class Predictor(Protocol):
    """What the policies ask of a latency model (`estimator.Estimator` is one)."""

    def prefill_time(self, seq_lens: Sequence[int], units: int, num_layers: int | None = None,
                     include_head: bool = True, co_decode_batch: int = 0,
                     cached: Sequence[int] | None = None) -> float:
        """A prefill of `seq_lens` new tokens; `cached`: each sequence's tokens already in the pool."""

    def decode_time(self, batch: int, context: int, units: int, co_prefill_tokens: int = 0) -> float:
        """A decode step of `batch` requests holding `context` KV tokens in all."""

    def decode_time_for(self, context_lens: Sequence[int], units: int, co_prefill_tokens: int = 0) -> float:
        """A decode step whose requests hold these contexts (exact where the device pads to the longest)."""


class LearningPredictor(Predictor, Protocol):
    """A predictor that refines itself from observed step times (Bullet §3.2: online calibration)."""

    def observe_prefill(self, seq_lens: Sequence[int], units: int, seconds: float, num_layers: int | None = None,
                        include_head: bool = True, co_decode_batch: int = 0) -> None: ...

    def observe_decode(self, context_lens: Sequence[int], units: int, seconds: float,
                       co_prefill_tokens: int = 0) -> None: ...


def percentile(values: Sequence[float], q: float = 0.9) -> float:
    """The nearest-rank q-quantile (0 for none): the smallest value at least a fraction q of them do not exceed."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def p90(values: Sequence[float]) -> float:
    return percentile(values, 0.9)


def prefill_seconds(est: Predictor, seq_lens: Sequence[int], units: int, cached: Sequence[int] | None = None,
                    **kwargs) -> float:
    """`est.prefill_time` of new tokens after cached prefixes (a prefix cache hit costs its new tokens
    plus their attention to the prefix); without a hit, exactly the plain call."""
    if cached and any(cached):
        return est.prefill_time(seq_lens, units, cached=list(cached), **kwargs)
    return est.prefill_time(seq_lens, units, **kwargs)


def prefill_seconds_over(est: Predictor, seq_lens: Sequence[int], units: Sequence[int],
                         cached: Sequence[int] | None = None, **kwargs) -> Iterator[float]:
    """`prefill_seconds` on each share of `units`, lazily — through the predictor's batched form
    (`prefill_times`, which does the per-call work once) when it has one."""
    many = getattr(est, "prefill_times", None)
    if many is None:
        return (prefill_seconds(est, seq_lens, u, cached, **kwargs) for u in units)
    return many(seq_lens, units, cached=cached if cached and any(cached) else None, **kwargs)


def decode_seconds_over(est: Predictor, batch: int, context: int, units: Sequence[int],
                        co_prefill_tokens: int = 0) -> Iterator[float]:
    """`est.decode_time` on each share of `units`, lazily (batched where the predictor can)."""
    many = getattr(est, "decode_times", None)
    if many is None:
        return (est.decode_time(batch, context, u, co_prefill_tokens=co_prefill_tokens) for u in units)
    return many(batch, context, units, co_prefill_tokens)


def prefill_costs(queue: Sequence[Request], est: Predictor, units: int, co_decode_batch: int) -> dict[Request, float]:
    """Each queued request's solo prefill time (its uncached tokens, attending to its cached prefix):
    one estimator call per request and decision, reused by every ordering the scheduler compares."""
    return {r: prefill_seconds(est, [r.num_uncomputed], units, [r.num_cached], co_decode_batch=co_decode_batch)
            for r in queue}


def predict_ttfts(now: float, inflight: Sequence[Request], remaining_s: float, queue: Sequence[Request],
                  costs: dict[Request, float]) -> dict[Request, float]:
    """Predicted TTFT (arrival to first token) of in-flight and queued requests, if the queue runs in
    the given order after the in-flight batch, one request after another (`costs`: solo times)."""
    out, t = {}, now + remaining_s
    for r in inflight:
        out[r] = t - r.arrival
    for r in queue:
        t += costs[r]
        out[r] = t - r.arrival
    return out


def tpot_after_next_step(req: Request, now: float, step_s: float, pause_s: float = 0.0) -> float:
    """The request's mean time per output token once its next token lands after `pause_s` + a step."""
    n = len(req.output_ids)  # tokens so far; the next one makes n intervals after the first token
    start = req.first_token_time if req.first_token_time is not None else now
    return (now - start + pause_s + step_s) / max(1, n)


def pause_budget(running: Sequence[Request], now: float, step_s: float, slo: SLO) -> float:
    """Longest pause before the next decode step that keeps every running request's TPOT within
    target (inf when nothing runs; negative when a request is already late)."""
    budget = math.inf
    for r in running:
        n = max(1, len(r.output_ids))
        start = r.first_token_time if r.first_token_time is not None else now
        budget = min(budget, slo.tpot * n - (now - start) - step_s)
    return budget


TPOT_MARGIN = 0.7  # decode steps chosen for TPOT aim at 70 % of the target: predictions are not exact, and the
# slack banked pays for prefill bursts (0.9 before: docs/sim/ledger.md §3c)


def decode_outlook(running: Sequence[Request], now: float, step_s: float, slo: SLO) -> tuple[float, list[float]]:
    """`pause_budget` and every request's `tpot_after_next_step` (no pause) in one pass over the
    batch, the same numbers: the decode policy needs both every step, for every request."""
    budget, tpots, target = math.inf, [], slo.tpot
    for r in running:
        start = r.first_token_time
        if start is None:
            start = now
        n = len(r.output_ids) or 1  # max(1, n): counts are never negative
        waited = now - start
        tpots.append((waited + step_s) / n)
        left = target * n - waited - step_s
        if left < budget:  # min(budget, left)
            budget = left
    return budget, tpots
