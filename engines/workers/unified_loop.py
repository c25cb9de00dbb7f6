"""The chunked-prefill baseline as a server (`--policy chunked:<budget>`): one process runs both
phases in hybrid batches (decodes first, then prefill chunks up to the token budget) on every
unit — the SGLang / Sarathi-Serve default that Bullet is compared against. Same model code, same
sampler, same finish rules and the same shared page allocator as the two-worker runtime."""

from __future__ import annotations

import logging
import time

from bullet.engine import Engine, RequestError
from bullet.messages import Abort, GenerateRequest, RequestOutput
from bullet.schedulers.hybrid import HybridScheduler
from bullet.state_buffer import WorkerFlags
from engines.workers.context import WorkerContext

log = logging.getLogger("bullet.unified")
IDLE_POLL_MS = 50


class UnifiedLoop:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        args = ctx.spec.args
        self.scheduler = HybridScheduler(ctx.allocator, args.policy_arg, args.max_running_requests)
        self.engine = Engine(ctx.runner, self.scheduler, ctx.finish)
        self.sent: dict[str, int] = {}  # rid -> output tokens already sent
        self.last_step_ms = 0.0

    def run(self) -> None:
        self.ctx.apply_units(self.ctx.partition.total_units)
        self.ctx.flags |= WorkerFlags.READY
        self._publish()
        while not self.ctx.should_stop():
            idle = not self.engine.has_work()
            for msg in self.ctx.io.receive(IDLE_POLL_MS if idle else 0):
                self._handle(msg)
            if self.engine.has_work():
                self.step()
                if not self.engine.has_work():
                    self.ctx.became_idle()
            self._publish()
        self.ctx.flags = (self.ctx.flags & ~WorkerFlags.READY) | WorkerFlags.STOPPED
        self._publish()

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg.input_ids, msg.params, rid=msg.rid, uid=msg.uid, arrival=msg.arrival)
                self.sent[msg.rid] = 0
            except RequestError as exc:  # the frontend validates first; this is a safety net
                self._send(msg.rid, 0, [], {"type": "abort", "message": str(exc)}, len(msg.input_ids))
        elif isinstance(msg, Abort):
            req = self.engine.abort(msg.rid, msg.message)
            if req is not None:
                self.sent.pop(msg.rid, None)
                self._send(req.rid, len(req.output_ids), [], req.finish_reason, len(req.prompt_ids))

    def step(self) -> None:
        t0 = time.perf_counter()
        queued = len(self.scheduler.waiting)
        progressed = self.engine.step()
        elapsed = time.perf_counter() - t0
        self.last_step_ms = elapsed * 1e3
        self.ctx.step += 1
        self.ctx.timeline.record(self.ctx.clock.now(), self.ctx.partition.current_units, run=True,
                                 batch=len(self.scheduler.running), queue=queued, obs_ms=elapsed * 1e3,
                                 reason=f"hybrid batch, budget {self.scheduler.token_budget}")
        outputs = []
        for req in progressed:
            start = self.sent.get(req.rid, 0)
            outputs.append(RequestOutput(
                rid=req.rid, start=start, token_ids=req.output_ids[start:],
                logprobs=req.output_logprobs[start:], top_logprobs=req.output_top_logprobs[start:],
                prompt_logprobs=req.prompt_logprobs if (start == 0 and req.params.prompt_logprobs) else None,
                prompt_tokens=len(req.prompt_ids), finish_reason=req.finish_reason, worker="unified"))
            if req.finished:
                self.sent.pop(req.rid, None)
            else:
                self.sent[req.rid] = len(req.output_ids)
        self.ctx.io.send_outputs(outputs)

    def _send(self, rid, start, tokens, reason, prompt_tokens) -> None:
        self.ctx.io.send_outputs([RequestOutput(rid=rid, start=start, token_ids=tokens, prompt_tokens=prompt_tokens,
                                                finish_reason=reason, worker="unified")])

    def _publish(self) -> None:
        sched = self.scheduler
        self.ctx.publish(batch_size=len(sched.running), queued_requests=len(sched.waiting),
                         queued_tokens=sum(r.num_uncomputed for r in sched.waiting),
                         step_obs_ms=self.last_step_ms)
