"""Runs a loop core's steps on the simulated device: the step's work is charged there (beside
whatever the other worker runs), and when it ends each request that the step samples gets a token —
a fixed id, with the same finish rules and virtual-time stamps a real token would get."""

from __future__ import annotations

from typing import Callable, Sequence

from bullet.loops.base import HybridItem, hybrid_shape
from bullet.loops.clock import Clock
from bullet.policies.views import InflightPrefill
from bullet.sim.device import DecodeWork, HybridWork, PrefillWork, SimulatedDevice
from bullet.sim.partition import SimulatedPartition
from bullet.types.finish import FinishChecker
from bullet.types.request import Request, total_seq_len
from bullet.types.roles import Role

SIM_TOKEN_ID = 0  # the token every simulated step "samples": not an EOS id of any shipped model


class SimExecutor:
    def __init__(self, role: Role, device: SimulatedDevice, partition: SimulatedPartition, clock: Clock,
                 finish: FinishChecker, on_step_end: Callable[[], None] = lambda: None,
                 token_times: dict[int, list[float]] | None = None):
        self.role, self.device, self.partition, self.clock, self.finish = role, device, partition, clock, finish
        self.on_step_end = on_step_end  # the driver goes round again once the core has taken the step's end
        # where each token's time goes, by request uid (the request log's, for its TBT); None: nowhere
        self.token_times = token_times
        # `FinishChecker.quiet_until` of each request it emitted for (forgotten when it ends one)
        self._quiet: dict[int, int] = {}

    def _run(self, work, sampled: Sequence[Request], on_done: Callable[[float], None]) -> None:
        def ended(seconds: float) -> None:
            if sampled:
                self.emit_tokens(sampled)
            on_done(seconds)
            self.on_step_end()

        self.device.start(self.role.value, work, self.partition.current_units, ended)

    def emit_token(self, req: Request) -> None:
        self.emit_tokens((req,))

    def emit_tokens(self, reqs: Sequence[Request]) -> None:
        """A token for each of `reqs`, all at this instant (a decode step samples every request). This
        runs for every token of a run: the finish rules are checked once a request holds as many
        tokens as `FinishChecker.quiet_until` says (before that they cannot end it — the same
        answers as checking every token, for a dictionary look-up per token instead of a call)."""
        now, stamps, quiet = self.clock.now(), self.token_times, self._quiet
        for req in reqs:
            output = req.output_ids
            output.append(SIM_TOKEN_ID)
            if req.first_token_time is None:
                req.first_token_time = now
            if stamps is not None:
                times = stamps.get(req.uid)
                if times is None:
                    stamps[req.uid] = [now]
                else:
                    times.append(now)
            until = quiet.get(req.uid)
            if until is None:
                until = quiet[req.uid] = self.finish.quiet_until(req, SIM_TOKEN_ID)
            if len(output) >= until:
                reason = self.finish.check(req)
                if reason is not None:
                    req.finish(reason, now)
                    del quiet[req.uid]

    def run_prefill(self, batch: InflightPrefill, layers: int, finishing: Sequence[Request] | None,
                    on_done: Callable[[float], None]) -> None:
        work = PrefillWork(tuple(batch.lengths), layers, include_head=finishing is not None, cached=tuple(batch.starts))
        self._run(work, finishing or (), on_done)

    def run_decode(self, batch: Sequence[Request], on_done: Callable[[float], None],
                   between_layers: Callable[[int], None] | None = None) -> None:
        # the simulated device charges a decode step as one piece: no layer boundary to yield at
        self._run(DecodeWork(len(batch), total_seq_len(batch)), batch, on_done)

    def run_hybrid(self, items: Sequence[HybridItem], on_done: Callable[[float], None]) -> None:
        self._run(hybrid_work(items), [req for req, _, _, _, _, sample in items if sample], on_done)


def hybrid_work(items: Sequence[HybridItem]) -> HybridWork:
    """What the device computes for a hybrid batch (`hybrid_shape`)."""
    chunks, decodes, context = hybrid_shape(items)
    return HybridWork(tuple(chunks), decodes, context)
