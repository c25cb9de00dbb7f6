"""Bullet's decode scheduler: each step it predicts the next step's latency, publishes the P90 of
its requests' TPOT and its pause budget, and follows the split the prefill scheduler published —
all units when prefill is idle, the complement of prefill's share otherwise (the share prefill chose:
it may still run beside this worker's last step), a pause when prefill took everything, unless the
pause budget is spent (then it runs anyway, sharing units).

The pause budget is what keeps every running request's TPOT within target, and with a TBT target
(`--tbt-slo`) also what keeps the gap since each request's last token within it: TPOT is a mean over
a request's life, so a request with slack may otherwise freeze for several steps at once (on an H200,
2026-11-26, pauses of 77-115 ms under a 50 ms TPOT target made the served P99 gap 130 ms).

`idle_units="efficient"` (an option): while prefill is idle, decode takes the fewest units whose step
is predicted within IDLE_SLACK of its step on every unit, and leaves the rest free — a prompt that
arrives mid-step starts on free units instead of on units decode's step still holds (on a CPU a core
is held until the step ends: found in the served decision timelines, where a second core bought
decode 0-6 % at batch 8-24 and the next prompt's prefill shared a core with it)."""

from __future__ import annotations

import bisect
import math

from bullet.policies.predict import TPOT_MARGIN, LearningPredictor, Predictor, decode_outlook, percentile
from bullet.policies.views import DecodeDecision, DecodePolicy, DecodeView, beside_size, largest_at_most
from bullet.types.request import seq_lens
from bullet.types.slo import SLO
from bullet.types.worker_state import Predictions, WorkerState

IDLE_UNITS_RULES = ("all", "efficient")
IDLE_SLACK = 0.10  # "efficient": a step at most 10 % slower than on every unit
# a prefill batch that ends within this fraction of decode's next step, with nothing queued behind it:
# decode takes every unit at once (sharing prefill's for its last layers) instead of the complement
TAIL_FRACTION = 0.5


YIELD_AT_RULES = ("step", "layer")  # when decode gives up units prefill has claimed: at its next step or layer


def oldest_token(running, last_step_end: float | None) -> float:
    """When the request waiting longest for its next token got its last one: the last step's end, or
    its first token (from prefill) when it joined after that step."""
    last = last_step_end if last_step_end is not None else -math.inf
    return min(max(last, r.first_token_time if r.first_token_time is not None else last) for r in running)


def prefill_share(peer) -> int:
    """Prefill's share as decode plans its next step: the one prefill chose, which it may not run on
    yet (it runs beside the units decode's step holds until that step ends)."""
    return max(peer.compute_units, peer.claimed_units)


def prefill_active(peer) -> bool:
    return peer.remaining_layers > 0 or peer.queued_requests > 0


class BulletDecodePolicy(DecodePolicy):
    name = "bullet"

    def __init__(self, est: Predictor, slo: SLO, feasible_units: list[int], idle_units: str = "all",
                 yield_at: str = "layer", prefill_layers_per_step: int = 0, percentile: float = 0.9):
        """`prefill_layers_per_step`: how many layers prefill runs per step (its published step time
        covers that many), to foresee the end of its batch; 0: decode never takes units prefill still
        holds (`tail_share`). `percentile`: of the running requests' predicted TPOT, published for prefill's
        split (`tpot_pred_p90_ms`, named for the paper's default)."""
        if not 0.0 < percentile <= 1.0:
            raise ValueError(f"percentile must lie in (0, 1], not {percentile}")
        self.percentile = percentile
        if idle_units not in IDLE_UNITS_RULES:
            raise ValueError(f"idle_units must be one of {IDLE_UNITS_RULES}, not {idle_units!r}")
        if yield_at not in YIELD_AT_RULES:
            raise ValueError(f"yield_at must be one of {YIELD_AT_RULES}, not {yield_at!r}")
        self.est, self.slo, self.feasible, self.idle_units = est, slo, sorted(feasible_units), idle_units
        self.yield_at, self.prefill_k = yield_at, prefill_layers_per_step
        self.learner: LearningPredictor | None = est if hasattr(est, "observe_decode") else None
        self.total = self.feasible[-1]

    def decide(self, view: DecodeView) -> DecodeDecision:
        running, peer = view.running, view.peer
        if not running:
            return DecodeDecision(run=False, units=view.current_units or self.total,
                                  predictions=Predictions(pause_budget_ms=1e9))
        active = prefill_active(peer)
        lens = seq_lens(running)
        if not active:
            units, reason = self.total, "prefill idle: decode takes every unit"
            fewer = self.efficient_units(lens) if self.idle_units == "efficient" else None
            if fewer is not None:
                units = fewer
                reason = "prefill idle: decode takes the units that speed it up, the rest wait for prompts"
        else:
            units, reason = self.complement(prefill_share(peer)), "complement of prefill's share"
            if units > 0 and self.tail_share(peer, lens, units):
                units, reason = self.total, "prefill's batch ends early in this step: decode takes every unit"
        co_tokens = peer.tokens_in_flight if active else 0
        step = self.est.decode_time_for(lens, units if units > 0 else self.feasible[0], co_prefill_tokens=co_tokens)
        budget, tpots = decode_outlook(running, view.now, step, self.slo)
        if self.slo.tbt is not None:
            budget = min(budget, self.slo.tbt - step - (view.now - oldest_token(running, view.last_step_end)))
        predictions = Predictions(tpot_pred_p90_ms=percentile(tpots, self.percentile) * 1e3,
                                  pause_budget_ms=(budget if math.isfinite(budget) else 1e9) * 1e3,
                                  step_pred_ms=step * 1e3)
        if units <= 0:
            if budget > 0:
                return DecodeDecision(run=False, units=view.current_units, reason="paused for a prefill burst",
                                      predictions=predictions)
            units, reason = self.units_keeping_tpot(lens, co_tokens), "pause budget spent: run on the units that keep TPOT"
        at = bisect.bisect_left(self.feasible, units)  # the fewest feasible units >= units (else all)
        units = self.feasible[at] if at < len(self.feasible) else self.total
        return DecodeDecision(run=True, units=units, predicted_s=step, reason=reason, predictions=predictions)

    def tail_share(self, peer, lens: list[int], units: int) -> bool:
        """Whether prefill's batch is predicted to end within TAIL_FRACTION of this decode step on
        `units`, with nothing queued behind it: then decode starts the step on every unit — prefill's
        last layers share theirs for a moment — rather than on the complement, which would leave
        prefill's units idle from its batch's end to this step's (a decode step keeps its units to its
        end: a CUDA-graph replay on a GPU). Bullet §3.3: "partially sharing SMs between phases rather
        than idling unused resources"; found by the simulator's ledger on the measured H200, where decode
        ran alone on its share for a third of ShareGPT's busy time."""
        if not self.prefill_k or peer.queued_requests or peer.remaining_layers <= 0 or peer.step_pred_ms <= 0:
            return False
        groups = -(-peer.remaining_layers // self.prefill_k)
        tail = groups * peer.step_pred_ms / 1e3
        return tail <= TAIL_FRACTION * self.est.decode_time_for(lens, units, co_prefill_tokens=peer.tokens_in_flight)

    def units_keeping_tpot(self, lens: list[int], co_tokens: int) -> int:
        """The fewest units whose step is predicted within TPOT_MARGIN of the TPOT target (else every
        unit): a decode that can no longer pause runs a step it can afford, on units prefill holds —
        prefill's next share runs beside them (`BulletPrefillPolicy.beside_decode_step`). Before, it
        ran on the smallest share: on a GPU a few SMs (2 of an A100's 108: a 30 ms step took 490 ms),
        which spent the TPOT the pause had saved; in the simulator on the measured H200 the change
        took ShareGPT's goodput from 56.4 to 62.5 req/s (docs/sim/ledger.md)."""
        bound = self.slo.tpot * TPOT_MARGIN
        return next((u for u in self.feasible if self.est.decode_time_for(lens, u, co_prefill_tokens=co_tokens) <= bound),
                    self.total)

    def units_mid_step(self, peer, current_units: int) -> int | None:
        """`yield_at="layer"`: prefill has started (a prompt arrived) on units this step holds — decode
        took every unit while prefill was idle — so decode goes on with the complement of prefill's
        share from the next layer, as its next step would; the prompt does not share a unit with the
        rest of a decode step (on a CPU core that halves both)."""
        share = prefill_share(peer)
        if self.yield_at != "layer" or not prefill_active(peer) or not share:
            return None
        if share + current_units <= self.total:
            return None  # no unit is held twice, or would be once this step ends
        units = max(self.complement(share), self.feasible[0])
        return units if units < current_units else None

    def complement(self, peer_units: int) -> int:
        """Decode's share beside prefill's `peer_units`: the largest share that fits in the rest (0:
        none). Rounded down, not up: where shares are groups of SMs plus a remainder only the whole
        device holds (green contexts: 16 x 8 + 4 on an H200), rounding the rest up would reach into
        prefill's groups (prefill 8 leaves 124; 128 = the last 16 groups, one of them prefill's)."""
        return largest_at_most(self.feasible, self.total - peer_units) or 0

    def efficient_units(self, lens: list[int]) -> int | None:
        """The fewest units short of every unit whose step is within IDLE_SLACK of the step on all (None:
        every unit pays)."""
        bound = self.est.decode_time_for(lens, self.total) * (1.0 + IDLE_SLACK)
        return next((u for u in self.feasible[:-1] if self.est.decode_time_for(lens, u) <= bound), None)

    def observe(self, decision: DecodeDecision, seconds: float, view: DecodeView,
                peer_after: WorkerState | None = None) -> None:
        if self.learner is None or not view.running:
            return
        co = beside_size(view.peer, peer_after, "tokens_in_flight")  # beside prefill or alone: learnt apart
        self.learner.observe_decode(seq_lens(view.running), decision.units, seconds, co_prefill_tokens=co)
