"""The unified loop core: one worker runs both phases in hybrid batches on every unit — the
`chunked:<budget>` baseline (SGLang / Sarathi-Serve style) and the offline `bullet.LLM` engine.
Each step the `HybridScheduler` takes the running decodes and continuing chunks, then new prompt
chunks up to the token budget; a request whose tokens are all computed samples its next token."""

from __future__ import annotations

from bullet.loops.base import HybridItem, LoopCore, LoopEnv, Wake, hybrid_shape
from bullet.policies.hybrid import HybridScheduler, Scheduled
from bullet.types.finish import Abort, Length
from bullet.types.request import Request, Status


def hybrid_items(batch: list[Scheduled]) -> list[HybridItem]:
    # one item per request per step: built with tuple.__new__ (what HybridItem(...) does, minus the
    # named tuple's Python-level constructor call)
    items, make = [], tuple.__new__
    for req, n in batch:
        start, params, prompt = req.num_cached, req.params, len(req.prompt_ids)
        completes = start + n == prompt + len(req.output_ids)  # req.seq_len
        wants_all = params.prompt_logprobs and start < prompt
        logits = "all" if wants_all else ("last" if completes else "none")
        items.append(make(HybridItem, (req, start, n, completes, logits, completes and params.max_new_tokens > 0)))
    return items


class UnifiedCore(LoopCore):
    def __init__(self, env: LoopEnv, scheduler: HybridScheduler):
        super().__init__(env)
        self.scheduler = scheduler
        self.cache = scheduler.cache  # this worker owns the prefix cache, if there is one
        self.requests: dict[int, Request] = {}  # by uid: every request not yet finished
        self.apply_units(env.partition.total_units)

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_work()

    # -- messages -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.uid] = req
        self.scheduler.add(req)

    def abort(self, uid: int, message: str) -> None:
        req = self.requests.pop(uid, None)
        if req is None or req.finished:
            return
        self.scheduler.release(req)
        req.finish(Abort(message=message), self.now())
        self.env.outbox.finished(req)

    # -- one pass of the loop -----------------------------------------------------------------------
    def iterate(self) -> Wake:
        now, queued = self.now(), len(self.scheduler.waiting)
        batch = self.scheduler.schedule()
        if not batch:
            return Wake.EVENT
        items = hybrid_items(batch)
        # item[0]: item.req (by index: every request of every step)
        return self.launch([item[0] for item in items], lambda done: self.env.executor.run_hybrid(items, done),
                           lambda seconds: self._step_done(now, items, queued, seconds))

    def _step_done(self, t: float, items: list[HybridItem], queued: int, seconds: float) -> None:
        progressed, cache, finished = [], self.cache, Status.FINISHED
        for req, start, num_tokens, completes, _, _ in items:  # every request, every step
            req.num_cached += num_tokens
            if not completes:
                continue  # a middle chunk of its prompt: nothing to report yet
            if cache is not None and start < len(req.prompt_ids) and req.status is not finished:
                cache.insert_computed(req)  # its prompt is computed: later prompts may share it now
            if req.params.max_new_tokens == 0 and req.status is not finished:
                req.finish(Length(length=0), self.now())
            progressed.append(req)
            if req.status is finished:
                self.scheduler.release(req)
                self.requests.pop(req.uid, None)
        self.last_step_ms = seconds * 1e3
        self.steps += 1
        if self.env.timeline.enabled:
            # what the step computed, as the estimator prices it (`artifact.served_steps` reads it back)
            chunks, decodes, context = hybrid_shape(items)
            self.record(t, self.env.partition.current_units, run=True, batch=len(self.scheduler.running),
                        queue=queued, tokens=sum(i.num_tokens for i in items), chunks=chunks, decode_batch=decodes,
                        context=context, obs_ms=seconds * 1e3, reason=f"hybrid batch, budget {self.scheduler.token_budget}")
        self.env.outbox.tokens(progressed)
        self.publish()

    def forget(self, req: Request) -> None:
        self.requests.pop(req.uid, None)
        if not req.finished:
            self.scheduler.release(req)

    # -- state ------------------------------------------------------------------------------------
    def pending_first_token(self) -> list[Request]:
        sched = self.scheduler
        return [r for r in list(sched.waiting) + sched.running if r.first_token_time is None]

    def counters(self) -> dict:
        counters = {"preemptions": self.scheduler.preemptions}
        if self.cache is not None:
            counters.update(self.cache.counters())
        return counters

    def publish(self) -> None:
        sched = self.scheduler
        self.publish_state(batch_size=len(sched.running), queued_requests=len(sched.waiting),
                           queued_tokens=sum(r.num_uncomputed for r in sched.waiting), step_obs_ms=self.last_step_ms)
