"""Bullet's two halves alone, for the paper's ablation (Fig. 23):

* `partition-only` ("w/ Partition"): the dynamic compute split, without request scheduling —
  prompts in arrival order, no preemption, prefill never yields a step and decode never pauses.
* `scheduler-only` ("w/ Scheduler"): request scheduling — SLO-aware ordering and batching,
  preemption, prefill yielding a decode step, decode pausing for a prefill burst — without the
  split: whichever worker runs uses every unit (the workers share them in time, as `naive` does).

Both are the full Bullet policies with one half switched off, so they differ from `bullet` in
nothing else."""

from __future__ import annotations

from bullet.policies.bullet_decode import BulletDecodePolicy
from bullet.policies.bullet_prefill import BulletPrefillPolicy
from bullet.policies.views import DecodeDecision, DecodeView, PrefillView
from bullet.types.request import Request

ABLATIONS = ("partition-only", "scheduler-only")


class PartitionOnlyPrefill(BulletPrefillPolicy):
    name = "partition-only"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "preemption": False})

    def order_queue(self, view: PrefillView, remaining: float, costs: dict[Request, float]) -> list[Request]:
        return list(view.queue)  # first come, first served

    def split(self, view: PrefillView, *args, **kwargs) -> tuple[int, str]:
        units, reason = super().split(view, *args, **kwargs)
        # yielding a step to decode, or taking every unit while decode pauses, is scheduling: while
        # decode has requests both always run, each on its share — where Bullet would yield, decode
        # gets the most a split leaves it (prefill its least); where decode would pause, the least
        if view.peer.batch_size and units == 0:
            return self.feasible[0], "partition only: both run, prefill on the least"
        if view.peer.batch_size and units >= self.total:
            return self._prefill_share(self.total - self.decode_feasible[0]), "partition only: both run, decode on the least"
        return units, reason


class SchedulerOnlyPrefill(BulletPrefillPolicy):
    name = "scheduler-only"

    def split(self, *args, **kwargs) -> tuple[int, str]:
        units, reason = super().split(*args, **kwargs)
        if units == 0:  # a yielded step: decode runs alone
            return 0, reason
        return self.total, "scheduler only: every unit"


class PartitionOnlyDecode(BulletDecodePolicy):
    name = "partition-only"

    def decide(self, view: DecodeView) -> DecodeDecision:
        decision = super().decide(view)
        if view.running and not decision.run:  # pausing for prefill is scheduling: run on the least
            return DecodeDecision(run=True, units=self.feasible[0], predicted_s=decision.predicted_s,
                                  reason="partition only: no pause", predictions=decision.predictions)
        return decision


class SchedulerOnlyDecode(BulletDecodePolicy):
    name = "scheduler-only"

    def decide(self, view: DecodeView) -> DecodeDecision:
        decision = super().decide(view)
        if not decision.run:
            return decision
        return DecodeDecision(run=True, units=self.total, predicted_s=decision.predicted_s,
                              reason="scheduler only: every unit", predictions=decision.predictions)
