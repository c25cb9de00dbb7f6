"""A device with simple, known latencies, so each rule of Algorithm 1 can be put in a situation
where the right answer is computable by hand. 8 units; prefill costs 1 ms per token per unit for
the whole 32-layer model; a decode step costs (20 ms + 1 ms per request) on 1 unit and half that
on 2 or more (bandwidth saturates at 2 units, as on real hardware)."""

from __future__ import annotations

from bullet.policies.views import DecodeView, InflightPrefill, PrefillView
from bullet.types.request import Request
from bullet.types.worker_state import WorkerState
from engines.sampling_params import SamplingParams

TOTAL = 8
LAYERS = 32


class FakePredictor:
    def __init__(self):
        self.observed = []

    def prefill_time(self, seq_lens, units, num_layers=None, include_head=True, co_decode_batch=0):
        layers = LAYERS if num_layers is None else num_layers
        return sum(seq_lens) * 1e-3 / units * layers / LAYERS

    def decode_time(self, batch, context, units, co_prefill_tokens=0):
        return (0.020 + 0.001 * batch) / min(units, 2)

    def decode_time_for(self, context_lens, units, co_prefill_tokens=0):
        return self.decode_time(len(context_lens), sum(context_lens), units, co_prefill_tokens)

    def observe_prefill(self, *args, **kw):
        self.observed.append(("prefill", args, kw))

    def observe_decode(self, *args, **kw):
        self.observed.append(("decode", args, kw))


def req(rid: str, tokens: int, arrival: float, outputs: int = 0, first_token_time: float | None = None) -> Request:
    r = Request(rid=rid, prompt_ids=[1] * tokens, params=SamplingParams(), arrival=arrival)
    r.output_ids = [2] * outputs
    r.first_token_time = first_token_time
    return r


def decode_state(batch: int = 0, context: int = 0, tpot_p90_ms: float = 0.0, pause_budget_ms: float = 0.0) -> WorkerState:
    return WorkerState(batch_size=batch, tokens_in_flight=context, tpot_pred_p90_ms=tpot_p90_ms,
                       pause_budget_ms=pause_budget_ms)


def prefill_view(now: float, queue=(), inflight=None, peer=None, units: int = TOTAL, free_pages: int = 10_000) -> PrefillView:
    return PrefillView(now=now, queue=list(queue), inflight=inflight, peer=peer or decode_state(),
                       total_units=TOTAL, current_units=units, free_pages=free_pages, page_size=16)


def inflight(requests, layers_done: int, started: float = 0.0) -> InflightPrefill:
    return InflightPrefill(list(requests), layers_done, LAYERS, started)


def decode_view(now: float, running, prefill: WorkerState, units: int = TOTAL) -> DecodeView:
    return DecodeView(now=now, running=list(running), peer=prefill, total_units=TOTAL, current_units=units)
