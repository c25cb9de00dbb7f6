"""The decode worker on virtual time — `engines/workers/decode_loop.DecodeLoop` step for step:
hand-offs join the running batch at the next step, the policy (from `make_decode_policy`,
unchanged) decides to run or pause and on how many units, each running request gets a KV slot (a
new page when it crosses a page boundary), one token per request per step, finished requests free
their pages. A paused worker polls every millisecond, as the real loop does."""

from __future__ import annotations

import time

from bullet.page_allocator import OutOfPages
from bullet.request import Request
from bullet.schedulers.base import DecodeDecision, DecodeView
from bullet.schedulers.factory import initial_units, make_decode_policy
from bullet.sim.device import DecodeWork
from bullet.sim.worker import SimEnv, SimWorker
from bullet.state_buffer import WorkerFlags

PAUSED_POLL_S = 1e-3  # decode_loop.PAUSED_POLL_MS


class SimDecodeWorker(SimWorker):
    role = state_role = "decode"

    def __init__(self, env: SimEnv, estimator):
        super().__init__(env, "decode")
        feasible = self.partition.feasible_units()
        self.partition.apply(initial_units(env.args, max(feasible))[1])
        self.policy = make_decode_policy(env.args, feasible, estimator)
        self.inbox: list[Request] = []  # hand-offs not yet received by the loop
        self.running: list[Request] = []
        self.published: dict = {}
        self.paused = False
        self._was_paused = False
        self.last_step_ms = 0.0
        self.pauses = 0
        self.publish()

    def receive(self, req: Request) -> None:
        self.inbox.append(req)
        self.wake()

    # -- the loop body ----------------------------------------------------------------------------
    def iterate(self) -> None:
        self.running.extend(self.inbox)
        self.inbox.clear()
        if self.step():
            return
        self.publish()
        if self.paused:
            self.wake(PAUSED_POLL_S)
        elif self.running:  # a request was dropped for lack of pages: go round again
            self.wake()

    def step(self) -> bool:
        t_decide = time.perf_counter()
        view = DecodeView(now=self.now, running=self.running, peer=self.read_peer(),
                          total_units=self.partition.total_units, current_units=self.partition.current_units)
        decision = self.policy.decide(view)
        decide_us = (time.perf_counter() - t_decide) * 1e6
        self.published = decision.published
        self.paused = bool(self.running) and not decision.run
        if self.paused and not self._was_paused:
            self.pauses += 1
            self.timeline.record(view.now, 0, run=False, batch=len(self.running), reason=decision.reason,
                                 sched_us=round(decide_us, 1))
        self._was_paused = self.paused
        if not decision.run or not self.running:
            return False
        self.apply_units(decision.units)
        batch = [r for r in self.running if self._reserve_next_slot(r)]
        if not batch:  # every request is waiting for a page: drop one so the rest can go
            self.retire(self.running.pop(), aborted=True)
            return False
        work = DecodeWork(len(batch), sum(r.seq_len for r in batch))
        self.run_on_device(work, lambda elapsed: self._step_done(view, decision, batch, elapsed, decide_us))
        return True

    def _step_done(self, view: DecodeView, decision: DecodeDecision, batch: list[Request], elapsed: float,
                   decide_us: float) -> None:
        done = []
        for r in batch:
            r.num_cached += 1
            if self.emit_token(r):
                done.append(r)
        self.last_step_ms = elapsed * 1e3
        self.policy.observe(decision, elapsed, view)
        self.steps += 1
        self.timeline.record(view.now, self.partition.current_units, run=True, batch=len(batch),
                             context=sum(r.seq_len for r in batch), prefill_units=view.peer.compute_units,
                             pred_ms=decision.predicted_s * 1e3, obs_ms=elapsed * 1e3, reason=decision.reason,
                             sched_us=round(decide_us, 1))
        if done:
            finished = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in finished]
            for r in done:
                self.retire(r)
        self.publish()
        self.wake()

    def _reserve_next_slot(self, req: Request) -> bool:
        alloc = self.env.allocator
        need = alloc.pages_for(req.seq_len) - len(req.page_table)
        if need <= 0:
            return True
        try:
            req.page_table.extend(alloc.alloc(need, req.uid))
            return True
        except OutOfPages:
            return False  # skip this step; pages come back as other requests finish

    def counters(self) -> dict:
        return {"decode_pauses": self.pauses}

    def publish(self) -> None:
        if self.paused:
            self.flags |= WorkerFlags.PAUSED
        else:
            self.flags &= ~WorkerFlags.PAUSED
        fields = {"tpot_obs_ms": self.last_step_ms, **self.published}
        self.publish_state(idle=not self.running, batch_size=len(self.running),
                           tokens_in_flight=sum(r.seq_len for r in self.running), step_obs_ms=self.last_step_ms,
                           **fields)
