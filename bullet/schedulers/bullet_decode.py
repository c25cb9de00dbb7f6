"""Bullet's decode scheduler: each step it predicts the next step's latency, publishes the P90 of
its requests' TPOT and its pause budget, and follows the split the prefill scheduler published —
all units when prefill is idle, the complement of prefill's share otherwise, a pause when prefill
took everything, unless the pause budget is spent (then it runs anyway, sharing units)."""

from __future__ import annotations

import math

from bullet.core.slo import SLO
from bullet.core.worker_state import Predictions
from bullet.schedulers.predict import LearningPredictor, Predictor, p90, pause_budget, tpot_after_next_step
from bullet.schedulers.views import DecodeDecision, DecodePolicy, DecodeView


def prefill_active(peer) -> bool:
    return peer.remaining_layers > 0 or peer.queued_requests > 0


class BulletDecodePolicy(DecodePolicy):
    name = "bullet"

    def __init__(self, est: Predictor, slo: SLO, feasible_units: list[int]):
        self.est, self.slo, self.feasible = est, slo, sorted(feasible_units)
        self.learner: LearningPredictor | None = est if hasattr(est, "observe_decode") else None
        self.total = self.feasible[-1]

    def decide(self, view: DecodeView) -> DecodeDecision:
        running, peer = view.running, view.peer
        if not running:
            return DecodeDecision(run=False, units=view.current_units or self.total,
                                  predictions=Predictions(pause_budget_ms=1e9))
        active = prefill_active(peer)
        if not active:
            units, reason = self.total, "prefill idle: decode takes every unit"
        else:
            units, reason = self.total - peer.compute_units, "complement of prefill's share"
        lens = [r.seq_len for r in running]
        co_tokens = peer.tokens_in_flight if active else 0
        step = self.est.decode_time_for(lens, units if units > 0 else self.feasible[0], co_prefill_tokens=co_tokens)
        budget = pause_budget(running, view.now, step, self.slo)
        predictions = Predictions(tpot_pred_p90_ms=p90([tpot_after_next_step(r, view.now, step) for r in running]) * 1e3,
                                  pause_budget_ms=(budget if math.isfinite(budget) else 1e9) * 1e3,
                                  step_pred_ms=step * 1e3)
        if units <= 0:
            if budget > 0:
                return DecodeDecision(run=False, units=view.current_units, reason="paused for a prefill burst",
                                      predictions=predictions)
            units, reason = self.feasible[0], "pause budget spent: run on a shared unit"
        units = next((f for f in self.feasible if f >= units), self.total)
        return DecodeDecision(run=True, units=units, predicted_s=step, reason=reason, predictions=predictions)

    def observe(self, decision: DecodeDecision, seconds: float, view: DecodeView) -> None:
        if self.learner is None or not view.running:
            return
        co = view.peer.tokens_in_flight if prefill_active(view.peer) else 0
        self.learner.observe_decode([r.seq_len for r in view.running], decision.units, seconds, co_prefill_tokens=co)
