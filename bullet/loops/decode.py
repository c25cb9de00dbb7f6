"""The decode loop core: continuous batching over requests handed over by prefill (they join the
running batch at the next step), one token per request per step, a KV slot reserved for each new
token (a new page when a sequence crosses a page boundary), pages freed when a request finishes or
is aborted — or, with the prefix cache on, sent back to the prefill worker, which owns the cache
(`Outbox.release`). When the pool runs short while the cache holds unreferenced pages, decode asks
prefill to evict them (`Outbox.want_pages`) and waits for them rather than handing a request back."""

from __future__ import annotations

import logging

from bullet.loops.base import LoopCore, LoopEnv, Wake
from bullet.policies.views import DecodeDecision, DecodePolicy, DecodeView, beside_size
from bullet.shm.page_allocator import OutOfPages
from bullet.types.finish import Abort
from bullet.types.request import Request, Status, total_seq_len
from bullet.types.worker_state import WorkerFlags

log = logging.getLogger("bullet.decode")
PAUSED_POLL_S = 1e-3  # a paused decode re-decides this often (prefill's share may change any time)
TOMBSTONE_TTL_S = 300.0  # how long an abort waits for a handoff it overtook


class DecodeCore(LoopCore):
    def __init__(self, env: LoopEnv, policy: DecodePolicy, remote_cache: bool = False,
                 yield_between_layers: bool = False):
        super().__init__(env)
        self.policy = policy
        self.remote_cache = remote_cache
        # the executor calls `between_layers` inside each step where it can (else a step runs its layers in one go)
        self._between_layers = self.between_layers if yield_between_layers else None
        self.asked_pages_at = -1  # the step at which decode last asked prefill to evict
        self.running: list[Request] = []
        # aborts that overtook their handoff (prefill sent it before the abort reached prefill), by uid
        self.tombstones: dict[int, float] = {}
        self.paused = False
        self._flag_paused = False  # whether self.flags holds PAUSED (only publish changes that bit)
        self._published_idle = True  # the last state published said no step runs (no batch)
        self.pauses = 0
        self.handed_back = 0  # requests given back to prefill when the pool ran out
        self.gave_way_after = 0  # layers the running step had done when it gave units to prefill (0: it did not)
        self.gave_way = 0  # steps that did
        self.last_step_end: float | None = None  # when the last step's tokens were out (policies bound the gap)
        self.received = 0  # hand-offs from prefill so far (published: prefill counts the ones still in flight)

    @property
    def idle(self) -> bool:
        return not self.running

    # -- messages -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.received += 1  # published with the batch that now holds it (or without it: aborted meanwhile)
        if self.tombstones.pop(req.uid, None) is not None:
            self._retire(req, Abort(message="aborted by the client"))
        else:
            self.running.append(req)

    def handoff_dropped(self) -> None:
        """A hand-off arrived that could not be taken (vetting dropped it): it counts as received."""
        self.received += 1
        self.publish()

    def abort(self, uid: int, message: str) -> None:
        now = self.now()
        for req in self.running:
            if req.uid == uid:
                self.running.remove(req)
                self._retire(req, Abort(message=message))
                break
        else:
            self.tombstones[uid] = now
        for key, t in list(self.tombstones.items()):
            if now - t > TOMBSTONE_TTL_S:
                del self.tombstones[key]

    # -- one pass of the loop -----------------------------------------------------------------------
    def iterate(self) -> Wake:
        env = self.env
        view = DecodeView(now=self.now(), running=self.running, peer=self.read_peer(),
                          total_units=env.partition.total_units, current_units=env.partition.current_units,
                          last_step_end=self.last_step_end)
        decision = self.decide_timed(self.policy.decide, view)
        self.predictions = decision.predictions
        was_paused, self.paused = self.paused, bool(self.running) and not decision.run
        if self.paused and not was_paused:
            self.pauses += 1
            self.record(view.now, 0, run=False, batch=len(self.running), reason=decision.reason)
        if self.paused:
            return Wake.until(view.now + PAUSED_POLL_S)
        if not self.running:
            return Wake.EVENT
        self.apply_units(decision.units)
        self._ask_for_pages()
        batch = self._reserve_next_slots(self.running)
        if not batch:
            if self.remote_cache and env.allocator.cache_pages()[1] > 0:
                return Wake.until(view.now + PAUSED_POLL_S)  # prefill is evicting cached pages for us
            self._hand_back(self.running.pop())  # every request waits for a page: the newest goes back
            return Wake.NOW
        if self._flag_paused or self._published_idle:
            # prefill reads whether decode runs a step (paused or idle last time it looked): say so before
            # it starts, not at its end — prefill takes the units of a decode it believes paused, and labels
            # its own step alone or beside decode by it (its online correction learns the two apart)
            self.publish()
        return self.launch(batch, lambda done: env.executor.run_decode(batch, done, self._between_layers),
                           lambda seconds: self._step_done(view, decision, batch, seconds))

    def _ask_for_pages(self) -> None:
        """With the cache in the prefill worker: ask it (once per step) to evict what this step's
        new pages lack."""
        if not self.remote_cache or self.asked_pages_at == self.steps:
            return
        allocator = self.env.allocator
        need = sum(max(0, allocator.pages_for(r.seq_len) - len(r.page_table)) for r in self.running)
        short = need - allocator.num_free()
        if short > 0 and allocator.cache_pages()[1] > 0:
            self.asked_pages_at = self.steps
            self.env.outbox.want_pages(short)

    def _reserve_next_slots(self, running: list[Request]) -> list[Request]:
        """The requests that have a KV slot for their next token, reserving a page for those that
        cross into a new one; a request that cannot get its page skips this step (pages come back as
        other requests finish)."""
        allocator = self.env.allocator
        page, batch = allocator.page_size, []
        for req in running:  # every request, every step: a page is due only when the sequence fills its pages
            tokens, table = len(req.prompt_ids) + len(req.output_ids), req.page_table  # req.seq_len
            if tokens > len(table) * page:
                try:
                    table.extend(allocator.alloc(allocator.pages_for(tokens) - len(table), req.uid))
                except OutOfPages:
                    continue
            batch.append(req)
        return batch

    def between_layers(self, layers_done: int) -> None:
        """Inside a running step (the executor calls this between layers, where it can): when the
        policy says so — prefill has started on units this step holds — go on with fewer units now
        rather than at the next step. Reading the state buffer must never fail the step."""
        try:
            units = self.policy.units_mid_step(self.read_peer(), self.env.partition.current_units)
        except Exception as exc:  # e.g. the peer died inside a publish; the next step re-reads
            log.debug("mid-step state read failed: %s", exc)
            return
        if units is not None:
            self.apply_units(units)
            if not self.gave_way_after:
                self.gave_way_after = layers_done
                self.gave_way += 1

    def _step_done(self, view: DecodeView, decision: DecodeDecision, batch: list[Request], seconds: float) -> None:
        done, finished = [], Status.FINISHED
        self.last_step_end = self.now()
        for r in batch:  # one pass over the batch: every step, every request (`r.finished`, inlined)
            r.num_cached += 1
            if r.status is finished:
                done.append(r)
        self.last_step_ms = seconds * 1e3
        reason, peer_after = decision.reason, self.read_peer()
        if self.gave_way_after:  # the step ran on two shares: its time fits neither, nothing to learn from
            reason += f"; gave units to prefill after layer {self.gave_way_after}"
            self.gave_way_after = 0
        else:
            self.policy.observe(decision, seconds, view, peer_after)
        self.steps += 1
        if self.env.timeline.enabled:  # prefill_units: at the decision; beside: what the step is learnt as
            self.record(view.now, self.env.partition.current_units, run=True, batch=len(batch),
                        context=total_seq_len(batch), prefill_units=view.peer.compute_units,
                        beside=beside_size(view.peer, peer_after, "tokens_in_flight"),
                        pred_ms=decision.predicted_s * 1e3, obs_ms=seconds * 1e3, reason=reason)
        if done:
            gone = set(done)
            self.running = [r for r in self.running if r not in gone]
            for r in done:
                self.free_pages(r)
        self.env.outbox.tokens(batch)
        self.publish()

    def _hand_back(self, req: Request) -> None:
        """Free `req`'s pages so the rest of the batch can grow; prefill recomputes it (prompt and
        outputs so far) when memory allows and it rejoins the batch — no admitted request is lost."""
        log.info("the KV pool is full: request %s (%d tokens) goes back to prefill to be recomputed",
                 req.rid, req.seq_len)
        self.free_own_pages(req)  # now (the batch needs them); prefill drops its prefix pin on arrival
        req.reset_for_recompute()
        self.handed_back += 1
        self.env.outbox.recompute(req)

    def _retire(self, req: Request, reason) -> None:
        req.finish(reason, self.now())
        self.free_pages(req)
        self.env.outbox.finished(req)

    def forget(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)

    # -- state ------------------------------------------------------------------------------------
    def counters(self) -> dict:
        return {"decode_pauses": self.pauses, "recomputed": self.handed_back, "decode_gave_way_mid_step": self.gave_way}

    def publish(self) -> None:
        if self.paused != self._flag_paused:  # flag arithmetic is slow: only when it changes
            self.flags = self.flags | WorkerFlags.PAUSED if self.paused else self.flags & ~WorkerFlags.PAUSED
            self._flag_paused = self.paused
        self._published_idle = not self.running
        self.publish_state(idle=not self.running, batch_size=len(self.running),
                           tokens_in_flight=total_seq_len(self.running), tpot_obs_ms=self.last_step_ms,
                           step_obs_ms=self.last_step_ms, handoffs_seen=self.received)
