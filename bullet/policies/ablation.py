"""Bullet's two halves alone, for the paper's ablation (Fig. 23):

* `partition-only` ("w/ Partition"): the dynamic compute split, without request scheduling —
  prompts in arrival order, no preemption, prefill never yields a step and decode never pauses.
* `scheduler-only` ("w/ Scheduler"): request scheduling — SLO-aware ordering and batching,
  preemption, prefill yielding a decode step, decode pausing for a prefill burst — without the
  split: whichever worker runs uses every unit (the workers share them in time, as `naive` does).

Both are the full Bullet policies with one half switched off, so they differ from `bullet` in
nothing else."""

from __future__ import annotations

from bullet.policies.bullet_decode import BulletDecodePolicy, prefill_active
from bullet.policies.bullet_prefill import BulletPrefillPolicy
from bullet.policies.views import DecodeDecision, DecodeView, PrefillView
from bullet.types.request import Request, seq_lens

ABLATIONS = ("partition-only", "scheduler-only")


class PartitionOnlyPrefill(BulletPrefillPolicy):
    name = "partition-only"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "preemption": False})

    def order_queue(self, view: PrefillView, remaining: float, costs: dict[Request, float]) -> list[Request]:
        return list(view.queue)  # first come, first served

    def split(self, view: PrefillView, batch_lens: list[int], *args, **kwargs) -> tuple[int, str]:
        """Yielding a step to decode, or taking every unit while decode pauses, is scheduling: while
        decode has requests both always run, each on its share. Where Bullet would yield, decode gets
        the most a split leaves it (prefill its least). Where decode would pause for a burst, decode
        keeps the fewest units that hold its TPOT, as Bullet's own split gives it when TPOT has slack —
        not the least: on the simulated A100 that left decode steps of ~330 ms on 2 of 108 SMs, the
        burst done in a few ms and the other 106 idle (partition-only's ledger: 11-21 % of its
        unit-seconds idle and co-run work lost on every workload)."""
        units, reason = super().split(view, batch_lens, *args, **kwargs)
        peer = view.peer
        if peer.batch_size and units == 0:
            return self.feasible[0], "partition only: both run, prefill on the least"
        if peer.batch_size and units >= self.total:
            d = self.decode_units_with_slack(peer.batch_size, peer.tokens_in_flight, sum(batch_lens))
            return self._prefill_share(self.total - d), "partition only: both run, decode on the units that keep TPOT"
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
        """Pausing for a prefill burst is scheduling: decode runs instead, on the units its TPOT needs
        beside the burst — the share Bullet's own decode takes once it can no longer pause (it ran on
        the smallest share before; see `PartitionOnlyPrefill.split` for what that cost)."""
        decision = super().decide(view)
        if view.running and not decision.run:
            lens, co = seq_lens(view.running), view.peer.tokens_in_flight if prefill_active(view.peer) else 0
            units = self.units_keeping_tpot(lens, co)
            return DecodeDecision(run=True, units=units, predicted_s=self.est.decode_time_for(lens, units, co_prefill_tokens=co),
                                  reason="partition only: no pause, on the units that keep TPOT",
                                  predictions=decision.predictions)
        return decision


class SchedulerOnlyDecode(BulletDecodePolicy):
    name = "scheduler-only"

    def decide(self, view: DecodeView) -> DecodeDecision:
        decision = super().decide(view)
        if not decision.run:
            return decision
        return DecodeDecision(run=True, units=self.total, predicted_s=decision.predicted_s,
                              reason="scheduler only: every unit", predictions=decision.predictions)
