"""The decode worker: continuous batching over requests handed over by prefill (they join the
running batch at the next step), one token per request per step, pages allocated as sequences
grow and freed when they finish or are aborted. Tokens go straight to the frontend."""

from __future__ import annotations

import logging
import time

from bullet.messages import Abort, Handoff, RequestOutput
from bullet.page_allocator import OutOfPages
from bullet.request import Request, Status
from bullet.schedulers.base import DecodeView
from bullet.schedulers.factory import make_decode_policy
from bullet.state_buffer import WorkerFlags
from bullet.token_step import sample_next
from engines.runner import SeqChunk
from engines.workers.context import WorkerContext

log = logging.getLogger("bullet.decode")
IDLE_POLL_MS = 50
PAUSED_POLL_MS = 1
TOMBSTONE_TTL_S = 300.0


class DecodeLoop:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.policy = make_decode_policy(ctx.spec.args, ctx.partition.feasible_units(), ctx.estimator)
        self.published: dict = {}
        self.running: list[Request] = []
        # aborts that overtook their handoff (prefill sent it before the abort reached prefill)
        self.tombstones: dict[str, float] = {}
        self.paused = False
        self._was_paused = False
        self.last_step_ms = 0.0

    def run(self) -> None:
        self.ctx.flags |= WorkerFlags.READY
        self._publish()
        while not self.ctx.should_stop():
            wait = IDLE_POLL_MS if not self.running else (PAUSED_POLL_MS if self.paused else 0)
            for msg in self.ctx.io.receive(wait):
                self._handle(msg)
            busy = not (not self.running)
            self.step()
            self._publish()
            if busy and not self.running:
                self.ctx.became_idle()
        self.ctx.flags = (self.ctx.flags & ~WorkerFlags.READY) | WorkerFlags.STOPPED
        self._publish()

    def _handle(self, msg) -> None:
        now = self.ctx.clock.now()
        if isinstance(msg, Handoff):
            req = Request(rid=msg.rid, prompt_ids=msg.prompt_ids, params=msg.params, uid=msg.uid, arrival=msg.arrival,
                          output_ids=list(msg.output_ids), page_table=list(msg.page_table),
                          num_cached=len(msg.prompt_ids), status=Status.RUNNING,
                          output_logprobs=list(msg.output_logprobs), output_top_logprobs=list(msg.output_top_logprobs),
                          first_token_time=msg.first_token_time)
            if self.tombstones.pop(msg.rid, None) is not None:
                self._retire(req, {"type": "abort", "message": "aborted by the client"})
            else:
                self.running.append(req)
        elif isinstance(msg, Abort):
            for req in self.running:
                if req.rid == msg.rid:
                    self.running.remove(req)
                    self._retire(req, {"type": "abort", "message": msg.message})
                    return
            self.tombstones[msg.rid] = now
        for rid, t in list(self.tombstones.items()):
            if now - t > TOMBSTONE_TTL_S:
                del self.tombstones[rid]

    def step(self) -> None:
        ctx = self.ctx
        t_decide = time.perf_counter()  # scheduler overhead: reading the peer's state + deciding
        view = DecodeView(now=ctx.clock.now(), running=self.running, peer=ctx.read_peer(),
                          total_units=ctx.partition.total_units, current_units=ctx.partition.current_units)
        decision = self.policy.decide(view)
        self.decide_us = (time.perf_counter() - t_decide) * 1e6
        self.published = decision.published
        self.paused = bool(self.running) and not decision.run
        if self.paused and not self._was_paused:
            ctx.timeline.record(view.now, 0, run=False, batch=len(self.running), reason=decision.reason,
                            sched_us=round(self.decide_us, 1))
        self._was_paused = self.paused
        if not decision.run or not self.running:
            return
        ctx.apply_units(decision.units)
        batch = [r for r in self.running if self._reserve_next_slot(r)]
        if not batch:  # every request is waiting for a page: free one request's pages so the rest can go
            victim = self.running.pop()
            self._retire(victim, {"type": "abort", "message": "the KV cache is full; request dropped"})
            return
        chunks = [SeqChunk([r.output_ids[-1]], r.seq_len - 1, r.page_table) for r in batch]
        t0 = time.perf_counter()
        out = ctx.runner.forward(chunks)
        for r in batch:
            r.num_cached += 1
        done = set(id(r) for r in sample_next(out.last_logits, batch, ctx.finish))
        elapsed = time.perf_counter() - t0
        self.last_step_ms = elapsed * 1e3
        self.policy.observe(decision, elapsed, view)
        ctx.step += 1
        ctx.timeline.record(view.now, ctx.partition.current_units, run=True, batch=len(batch),
                            context=sum(r.seq_len for r in batch), prefill_units=view.peer.compute_units,
                            pred_ms=decision.predicted_s * 1e3, obs_ms=elapsed * 1e3, reason=decision.reason,
                            sched_us=round(self.decide_us, 1))
        outputs = []
        for r in batch:
            n = len(r.output_ids) - 1
            outputs.append(RequestOutput(
                rid=r.rid, start=n, token_ids=[r.output_ids[-1]],
                logprobs=r.output_logprobs[n:] if r.output_logprobs else [],
                top_logprobs=r.output_top_logprobs[n:] if r.output_top_logprobs else [],
                prompt_tokens=len(r.prompt_ids), finish_reason=r.finish_reason if id(r) in done else None,
                worker="decode"))
            if id(r) in done:
                self.running.remove(r)
                self._free(r)
        ctx.io.send_outputs(outputs)

    def _reserve_next_slot(self, req: Request) -> bool:
        need = self.ctx.allocator.pages_for(req.seq_len) - len(req.page_table)
        if need <= 0:
            return True
        try:
            req.page_table.extend(self.ctx.allocator.alloc(need, req.uid))
            return True
        except OutOfPages:
            return False  # skip this step; pages come back as other requests finish

    def _free(self, req: Request) -> None:
        if req.page_table:
            self.ctx.allocator.free_owner(req.uid)
            req.page_table = []

    def _retire(self, req: Request, reason: dict) -> None:
        req.finish(reason)
        self._free(req)
        self.ctx.io.send_outputs([RequestOutput(rid=req.rid, start=len(req.output_ids), prompt_tokens=len(req.prompt_ids),
                                                finish_reason=reason, worker="decode")])

    def _publish(self) -> None:
        if self.paused:
            self.ctx.flags |= WorkerFlags.PAUSED
        else:
            self.ctx.flags &= ~WorkerFlags.PAUSED
        fields = {"tpot_obs_ms": self.last_step_ms, **self.published}
        self.ctx.publish(idle=not self.running, batch_size=len(self.running),
                         tokens_in_flight=sum(r.seq_len for r in self.running), step_obs_ms=self.last_step_ms,
                         **fields)
