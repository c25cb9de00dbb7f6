"""The prefill worker on virtual time — `engines/workers/prefill_loop.PrefillLoop` step for step:
queue prompts, build a `PrefillView`, let the policy (from `make_prefill_policy`, unchanged) pick a
batch, a share and a number of layers, apply the share, run the layers on the simulated device,
feed the charged time back to the policy, and after the last layer emit each request's first token
and hand it to decode. Publishes the same fields as the real loop, at the same points."""

from __future__ import annotations

import time
from typing import Callable

from bullet.request import Request
from bullet.schedulers.base import InflightPrefill, PrefillDecision, PrefillView, take_admitted
from bullet.schedulers.factory import initial_units, make_prefill_policy
from bullet.sim.device import PrefillWork
from bullet.sim.worker import SimEnv, SimWorker


class SimPrefillWorker(SimWorker):
    role = state_role = "prefill"

    def __init__(self, env: SimEnv, estimator, batch_token_limit, hand_off: Callable[[Request], None]):
        super().__init__(env, "prefill")
        feasible = self.partition.feasible_units()
        self.partition.apply(initial_units(env.args, max(feasible))[0])
        self.policy = make_prefill_policy(env.args, feasible, env.num_layers, estimator, batch_token_limit)
        self.hand_off = hand_off
        self.queue: list[Request] = []
        self.inflight: InflightPrefill | None = None
        self.published: dict = {}
        self.last_ttft_ms = 0.0
        self.last_step_ms = 0.0
        self.yield_until = 0.0  # as the real loop: the policy yielded every unit to decode until then
        self.publish()
        env.board.on_publish("decode", self._peer_published)

    # -- messages -----------------------------------------------------------------------------------
    def receive(self, req: Request) -> None:
        self.queue.append(req)
        self.wake()

    def _peer_published(self) -> None:
        # the real loop re-decides continuously while it has queued work it could not start (e.g. no
        # free pages); what it waits for changes only when decode publishes
        if self.queue and self.inflight is None:
            self.wake()

    # -- the loop body ----------------------------------------------------------------------------
    def iterate(self) -> None:
        if not self.step():
            self.publish()

    def view(self) -> PrefillView:
        alloc = self.env.allocator
        return PrefillView(now=self.now, queue=self.queue, inflight=self.inflight, peer=self.read_peer(),
                           total_units=self.partition.total_units, current_units=self.partition.current_units,
                           free_pages=alloc.num_free(), page_size=alloc.page_size)

    def step(self) -> bool:
        """Decide and start a layer group; False when nothing was started."""
        if self.yield_until:
            if self.now < self.yield_until:
                self.wake(self.yield_until - self.now)
                return False
            self.yield_until = 0.0
        t_decide = time.perf_counter()
        view = self.view()
        decision = self.policy.decide(view)
        decide_us = (time.perf_counter() - t_decide) * 1e6
        self.published = decision.published
        if decision.yield_s > 0:
            self.yield_until = view.now + decision.yield_s
            self.timeline.record(view.now, 0, run=False, queue=len(self.queue), decode_batch=view.peer.batch_size,
                                 reason=decision.reason, sched_us=round(decide_us, 1))
            self.wake(decision.yield_s)
            return False
        if decision.num_layers <= 0:
            return False
        self.apply_units(decision.units)
        if self.inflight is None and not self._start(decision.admit):
            return False
        self.publish()  # as the real loop: decode sees the new share before the step runs
        inflight = self.inflight
        layers = min(decision.num_layers, inflight.remaining_layers)
        work = PrefillWork(tuple(len(r.prompt_ids) for r in inflight.requests), layers,
                           include_head=layers == inflight.remaining_layers)
        self.run_on_device(work, lambda elapsed: self._step_done(view, decision, layers, elapsed, decide_us))
        return True

    def _step_done(self, view: PrefillView, decision: PrefillDecision, layers: int, elapsed: float,
                   decide_us: float) -> None:
        inflight = self.inflight
        self.last_step_ms = elapsed * 1e3
        inflight.layers_done += layers
        self.policy.observe(decision, elapsed, view)
        self.steps += 1
        self.timeline.record(view.now, self.partition.current_units, run=True, layers=decision.num_layers,
                             batch=len(inflight.requests), tokens=inflight.num_tokens, queue=len(self.queue),
                             decode_batch=view.peer.batch_size, pred_ms=decision.predicted_s * 1e3,
                             obs_ms=elapsed * 1e3, reason=decision.reason, sched_us=round(decide_us, 1))
        if inflight.remaining_layers == 0:
            self._complete()
        self.publish()
        self.wake()  # the loop goes round again at once

    def _start(self, admit: list[Request]) -> bool:
        started = take_admitted(self.queue, admit, self.env.allocator)
        if not started:
            return False
        self.inflight = InflightPrefill(started, 0, self.env.num_layers, self.now)
        return True

    def _complete(self) -> None:
        reqs = self.inflight.requests
        self.inflight = None
        for req in reqs:
            req.num_cached = len(req.prompt_ids)
            if req.params.max_new_tokens == 0 or self.emit_token(req):
                self.retire(req)
            else:
                self.hand_off(req)
        if reqs and reqs[0].first_token_time is not None:
            self.last_ttft_ms = (reqs[0].first_token_time - reqs[0].arrival) * 1e3

    def without_first_token(self) -> list[Request]:
        return self.queue + (self.inflight.requests if self.inflight else [])

    def publish(self) -> None:
        inflight = self.inflight
        self.publish_state(
            idle=inflight is None or bool(self.yield_until), **self.published,
            batch_size=len(inflight.requests) if inflight else 0,
            queued_requests=len(self.queue), queued_tokens=sum(len(r.prompt_ids) for r in self.queue),
            tokens_in_flight=inflight.num_tokens if inflight else 0,
            remaining_layers=inflight.remaining_layers if inflight else 0,
            ttft_obs_ms=self.last_ttft_ms, step_obs_ms=self.last_step_ms)
