"""The prefill worker: queue incoming prompts, let the policy pick a batch and a compute share,
run it a few layers per step (returning to the scheduler between steps, Bullet §3.3), sample each
request's first token, and hand the request to decode — only metadata travels, its K/V pages are
already in the shared pool."""

from __future__ import annotations

import logging
import time

from bullet.messages import Abort, GenerateRequest, Handoff, RequestOutput
from bullet.request import Request
from bullet.schedulers.base import InflightPrefill, PrefillView, take_admitted
from bullet.schedulers.factory import make_prefill_policy
from bullet.state_buffer import WorkerFlags
from bullet.token_step import record_prompt_logprobs, sample_next
from engines.runner import LayerwiseState, SeqChunk
from engines.workers.context import WorkerContext

log = logging.getLogger("bullet.prefill")
IDLE_POLL_MS = 50


class PrefillLoop:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.policy = make_prefill_policy(ctx.spec.args, ctx.partition.feasible_units(),
                                          ctx.runner.model.num_layers, ctx.estimator, ctx.batch_token_limit)
        self.published: dict = {}
        self.queue: list[Request] = []
        self.inflight: InflightPrefill | None = None
        self.layers: LayerwiseState | None = None
        self.aborted: set[str] = set()  # in-flight requests aborted mid-batch
        self.last_ttft_ms = 0.0
        self.last_step_ms = 0.0
        self.yield_until = 0.0  # the policy yielded every unit to decode until then (clock time)

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.ctx.flags |= WorkerFlags.READY
        self._publish()
        while not self.ctx.should_stop():
            idle = not self.queue and self.inflight is None
            wait_ms = IDLE_POLL_MS if idle else 0
            if self.yield_until:  # sleep through the yield, but take messages as they come
                wait_ms = max(1, int((self.yield_until - self.ctx.clock.now()) * 1e3))
            for msg in self.ctx.io.receive(wait_ms):
                self._handle(msg)
            busy = not (not self.queue and self.inflight is None)
            self.step()
            self._publish()
            if busy and not self.queue and self.inflight is None:
                self.ctx.became_idle()
        self.ctx.flags = (self.ctx.flags & ~WorkerFlags.READY) | WorkerFlags.STOPPED
        self._publish()

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self.queue.append(Request(rid=msg.rid, prompt_ids=msg.input_ids, params=msg.params, uid=msg.uid,
                                      arrival=msg.arrival))
        elif isinstance(msg, Abort):
            for req in self.queue:
                if req.rid == msg.rid:
                    self.queue.remove(req)
                    self._send_final(req, {"type": "abort", "message": msg.message})
                    return
            if self.inflight and any(r.rid == msg.rid for r in self.inflight.requests):
                self.aborted.add(msg.rid)

    # -- one scheduling step ---------------------------------------------------------------------
    def view(self) -> PrefillView:
        ctx = self.ctx
        return PrefillView(now=ctx.clock.now(), queue=self.queue, inflight=self.inflight, peer=ctx.read_peer(),
                           total_units=ctx.partition.total_units, current_units=ctx.partition.current_units,
                           free_pages=ctx.allocator.num_free(), page_size=ctx.allocator.page_size)

    def step(self) -> None:
        if self.yield_until:
            if self.ctx.clock.now() < self.yield_until:
                return
            self.yield_until = 0.0
        t_decide = time.perf_counter()  # scheduler overhead: reading the peer's state + deciding
        view = self.view()
        decision = self.policy.decide(view)
        self.decide_us = (time.perf_counter() - t_decide) * 1e6
        self.published = decision.published
        if decision.yield_s > 0:
            self.yield_until = view.now + decision.yield_s
            self.ctx.timeline.record(view.now, 0, run=False, queue=len(self.queue), decode_batch=view.peer.batch_size,
                                     reason=decision.reason, sched_us=round(self.decide_us, 1))
            return
        if decision.num_layers <= 0:
            return
        self.ctx.apply_units(decision.units)
        if self.inflight is None and not self._start(decision.admit):
            return
        self._publish()  # before the step: decode sees a new share (a burst, a hand-back) at once
        t0 = time.perf_counter()
        done = self.ctx.runner.run_layers(self.layers, decision.num_layers)
        elapsed = time.perf_counter() - t0
        self.last_step_ms = elapsed * 1e3
        self.inflight.layers_done = self.layers.next_layer
        self.policy.observe(decision, elapsed, view)
        self.ctx.step += 1
        self.ctx.timeline.record(view.now, self.ctx.partition.current_units, run=True, layers=decision.num_layers,
                                 batch=len(self.inflight.requests), tokens=self.inflight.num_tokens,
                                 queue=len(self.queue), decode_batch=view.peer.batch_size,
                                 pred_ms=decision.predicted_s * 1e3, obs_ms=elapsed * 1e3, reason=decision.reason,
                            sched_us=round(self.decide_us, 1))
        if done:
            self._complete()

    def _start(self, admit: list[Request]) -> bool:
        started = take_admitted(self.queue, admit, self.ctx.allocator)
        if not started:
            return False
        chunks = [SeqChunk(r.prompt_ids, 0, r.page_table, "all" if r.params.prompt_logprobs else "last") for r in started]
        self.layers = self.ctx.runner.start(chunks)
        self.inflight = InflightPrefill(started, 0, self.ctx.runner.model.num_layers, self.ctx.clock.now())
        return True

    def _complete(self) -> None:
        out = self.ctx.runner.finish(self.layers)
        reqs = self.inflight.requests
        self.inflight, self.layers = None, None
        for i, req in enumerate(reqs):
            if i in out.all_logits:
                record_prompt_logprobs(req, 0, out.all_logits[i])
            req.num_cached = len(req.prompt_ids)
        live = [i for i, r in enumerate(reqs) if r.rid not in self.aborted and r.params.max_new_tokens > 0]
        if live:
            sample_next(out.last_logits[live], [reqs[i] for i in live], self.ctx.finish)
        for req in reqs:
            if req.rid in self.aborted:
                self.aborted.discard(req.rid)
                self._send_final(req, {"type": "abort", "message": "aborted by the client"})
            elif req.params.max_new_tokens == 0:
                self._send_final(req, {"type": "length", "length": 0})
            elif req.finished:
                self._send_final(req, req.finish_reason)
            else:
                self._hand_off(req)
        if reqs and reqs[0].first_token_time is not None:
            self.last_ttft_ms = (reqs[0].first_token_time - reqs[0].arrival) * 1e3

    def _hand_off(self, req: Request) -> None:
        # decode first: once the frontend has the first token, decode already has the request
        self.ctx.io.send_handoff(Handoff(
            rid=req.rid, uid=req.uid, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
            page_table=req.page_table, params=req.params, arrival=req.arrival,
            first_token_time=req.first_token_time, output_logprobs=req.output_logprobs,
            output_top_logprobs=req.output_top_logprobs))
        self.ctx.io.send_outputs([self._output(req, None)])

    def _send_final(self, req: Request, reason: dict) -> None:
        if not req.finished:
            req.finish(reason)
        if req.page_table:
            self.ctx.allocator.free_owner(req.uid)
            req.page_table = []
        self.ctx.io.send_outputs([self._output(req, req.finish_reason)])

    def _output(self, req: Request, reason: dict | None) -> RequestOutput:
        return RequestOutput(
            rid=req.rid, start=0, token_ids=list(req.output_ids), logprobs=list(req.output_logprobs),
            top_logprobs=list(req.output_top_logprobs),
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs else None,
            prompt_tokens=len(req.prompt_ids), finish_reason=reason, worker="prefill")

    def _publish(self) -> None:
        inflight = self.inflight
        self.ctx.publish(
            idle=inflight is None or bool(self.yield_until), **self.published,
            batch_size=len(inflight.requests) if inflight else 0,
            queued_requests=len(self.queue), queued_tokens=sum(len(r.prompt_ids) for r in self.queue),
            tokens_in_flight=inflight.num_tokens if inflight else 0,
            remaining_layers=inflight.remaining_layers if inflight else 0,
            ttft_obs_ms=self.last_ttft_ms, step_obs_ms=self.last_step_ms)
