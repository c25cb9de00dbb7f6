"""Fixed compute split (MuxServe / semi-PD style, `--policy static:<prefill units>`) and the
unpartitioned `naive` baseline: first-come first-served prefill batches up to a token budget, a
constant number of layers per step, decode always running."""

from __future__ import annotations

from bullet.policies.views import (
    DecodeDecision,
    DecodePolicy,
    DecodeView,
    PrefillDecision,
    PrefillPolicy,
    PrefillView,
    admit_fcfs,
)


def decode_page_reserve(running: int, queued: int) -> int:
    """Pages kept free for the decode batch to grow into: one page per running or arriving request
    covers the next page_size tokens of each, and the reserve is re-read every step."""
    return running + queued


class StaticPrefillPolicy(PrefillPolicy):
    name = "static"

    def __init__(self, units: int, layers_per_step: int, max_prefill_tokens: int):
        self.units, self.layers_per_step, self.max_prefill_tokens = units, layers_per_step, max_prefill_tokens

    def decide(self, view: PrefillView) -> PrefillDecision:
        admit = []
        if view.inflight is None and view.queue:
            reserve = decode_page_reserve(view.peer.batch_size, view.peer.queued_requests)
            admit = admit_fcfs(view.queue, self.max_prefill_tokens, view.free_pages, view.page_size, reserve,
                               view.free_slots)
        busy = view.inflight is not None or admit
        return PrefillDecision(admit=admit, num_layers=self.layers_per_step if busy else 0, units=self.units)


class StaticDecodePolicy(DecodePolicy):
    name = "static"

    def __init__(self, units: int):
        self.units = units

    def decide(self, view: DecodeView) -> DecodeDecision:
        return DecodeDecision(run=bool(view.running), units=self.units)
