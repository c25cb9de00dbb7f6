"""The chunked-prefill baseline on virtual time — `engines/workers/unified_loop.UnifiedLoop` driving
`bullet.engine.Engine`: the real `HybridScheduler` picks each hybrid batch (decodes first, then
prompt chunks up to the token budget, preempting the newest request when pages run out), the
simulated device charges the step on every unit (`Estimator.hybrid_step_time`, where a chunk also
attends to — and re-reads — the part of its prompt already cached), and the step's outcome is
applied as `Engine.step` applies it."""

from __future__ import annotations

from bullet.request import Request
from bullet.schedulers.hybrid import HybridScheduler, Scheduled
from bullet.sim.device import HybridWork
from bullet.sim.worker import SimEnv, SimWorker


class SimUnifiedWorker(SimWorker):
    role = "unified"
    state_role = "prefill"  # WorkerContext.state_role: the single worker reports in prefill's block

    def __init__(self, env: SimEnv):
        super().__init__(env, "prefill")
        args = env.args
        self.scheduler = HybridScheduler(env.allocator, args.policy_arg, args.max_running_requests)
        self.partition.apply(self.partition.total_units)
        self.last_step_ms = 0.0
        self.publish()

    def receive(self, req: Request) -> None:
        self.scheduler.add(req)
        self.wake()

    def iterate(self) -> None:
        if self.scheduler.has_work() and self.step():
            return
        self.publish()

    def step(self) -> bool:
        queued = len(self.scheduler.waiting)
        batch = self.scheduler.schedule()
        if not batch:
            return False
        self.run_on_device(hybrid_work(batch), lambda elapsed: self._step_done(batch, queued, elapsed))
        return True

    def _step_done(self, batch: list[Scheduled], queued: int, elapsed: float) -> None:
        """`Engine.step` after the forward pass: advance each request by its tokens; a request whose
        tokens are all computed samples its next token; finished ones are released."""
        for s in batch:
            req = s.req
            req.num_cached += s.num_tokens
            if req.num_cached == req.seq_len:
                if req.params.max_new_tokens == 0 or self.emit_token(req):
                    self.scheduler.release(req)
                    self.retire(req)
        self.last_step_ms = elapsed * 1e3
        self.steps += 1
        self.timeline.record(self.now, self.partition.current_units, run=True, batch=len(self.scheduler.running),
                             queue=queued, obs_ms=elapsed * 1e3,
                             reason=f"hybrid batch, budget {self.scheduler.token_budget}",
                             tokens=sum(s.num_tokens for s in batch))
        self.publish()
        self.wake()

    def without_first_token(self) -> list[Request]:
        sched = self.scheduler
        return [r for r in list(sched.waiting) + sched.running if r.first_token_time is None]

    def counters(self) -> dict:
        return {"preemptions": self.scheduler.preemptions}

    def publish(self) -> None:
        sched = self.scheduler
        self.publish_state(batch_size=len(sched.running), queued_requests=len(sched.waiting),
                           queued_tokens=sum(r.num_uncomputed for r in sched.waiting), step_obs_ms=self.last_step_ms)


def hybrid_work(batch: list[Scheduled]) -> HybridWork:
    """What the device computes for a hybrid batch: a request whose next token follows a fully
    cached sequence is a decode (its context includes that token); anything else is a prompt chunk
    (or the recomputation of a preempted request) after `num_cached` cached tokens."""
    chunks, decodes, context = [], 0, 0
    for s in batch:
        req = s.req
        if s.num_tokens == 1 and req.num_cached == req.seq_len - 1 and req.num_cached >= len(req.prompt_ids):
            decodes += 1
            context += req.seq_len
        else:
            chunks.append((s.num_tokens, req.num_cached))
    return HybridWork(tuple(chunks), decodes, context)
