"""The prefill loop core: queue prompts, let the policy pick a batch and a compute share, run the
batch a few layers per step (returning to the scheduler between steps, Bullet §3.3), sample each
request's first token after the last layer, and hand the request to decode — only metadata
travels, its K/V pages are already in the shared pool."""

from __future__ import annotations

from typing import Sequence

from bullet.cache.prefix_cache import PrefixCache
from bullet.loops.base import LoopCore, LoopEnv, Wake
from bullet.policies.views import InflightPrefill, PrefillDecision, PrefillPolicy, PrefillView, beside_size
from bullet.shm.page_allocator import OutOfPages, PageAllocator
from bullet.types.finish import Abort, Length
from bullet.types.request import Request, Status, enqueue


def take_admitted(queue: list[Request], admit: Sequence[Request], allocator: PageAllocator,
                  cache: PrefixCache | None = None) -> list[Request]:
    """Give each admitted request the pages its prompt needs beyond its cached prefix, in order,
    until memory runs out — evicting unreferenced cached pages first (the rest stay queued: decode
    frees pages as requests finish); move the started ones out of the queue."""
    started = []
    alloc = cache.alloc if cache is not None else allocator.alloc
    for req in admit:
        if cache is not None:
            cache.rematch(req)
        try:
            req.page_table.extend(alloc(allocator.pages_for(req.seq_len) - len(req.page_table), req.uid))
        except OutOfPages:
            break
        started.append(req)
    for req in started:
        queue.remove(req)
        req.status = Status.RUNNING
    return started


class PrefillCore(LoopCore):
    def __init__(self, env: LoopEnv, policy: PrefillPolicy, num_layers: int, cache: PrefixCache | None = None,
                 max_running: int = 1 << 30):
        super().__init__(env)
        self.policy, self.num_layers, self.max_running = policy, num_layers, max_running
        # requests handed to decode so far; those decode has not said it received (`handoffs_seen`)
        # are in flight between the two: counted against --max-running-requests though neither batch holds
        # them. `sent_before`: hand-offs sent before the decode process now running (pid `decode_pid`) started
        self.handed_total, self.sent_before, self.decode_pid = 0, 0, 0
        self.cache = cache
        self.queue: list[Request] = []
        self.inflight: InflightPrefill | None = None
        self.suspended: InflightPrefill | None = None  # preempted at a layer boundary; resumes after `inflight`
        self.aborted: set[Request] = set()  # in-flight requests aborted mid-batch
        self.preemptions = 0
        self.last_ttft_ms = 0.0
        self.yield_until = 0.0  # the policy yielded every unit to decode until then (clock time)
        self.claimed_units = 0  # the share the policy chose while the step runs on fewer (published)

    @property
    def idle(self) -> bool:
        return not self.queue and self.inflight is None and self.suspended is None

    # -- messages -----------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """A new prompt, or a request decode handed back: it starts on its longest cached prefix
        (pinned while it is here), so the policy sees, and prefill computes, only the rest."""
        if self.cache is not None:
            self.cache.unpin(req.uid)  # handed back: the pin of its first admission goes
            self.cache.match(req)
        enqueue(self.queue, req)  # by priority, then arrival: the order every prefill policy starts from

    def abort(self, uid: int, message: str) -> None:
        for req in self.queue:
            if req.uid == uid:
                self.queue.remove(req)
                self._finish(req, Abort(message=message))
                return
        for batch in (self.inflight, self.suspended):
            if batch is not None:
                self.aborted.update(r for r in batch.requests if r.uid == uid)

    # -- one pass of the loop -----------------------------------------------------------------------
    def view(self) -> PrefillView:
        env = self.env
        peer = self.read_peer()
        return PrefillView(now=self.now(), queue=self.queue, inflight=self.inflight, peer=peer,
                           total_units=env.partition.total_units, current_units=env.partition.current_units,
                           free_pages=self.free_pages_view(), page_size=env.allocator.page_size,
                           suspended=self.suspended, free_slots=self.free_slots(peer))

    def free_slots(self, peer) -> int:
        """Prompts that may start under `--max-running-requests`, as SGLang counts it: every request
        decoding, handed over and not yet decoding, or in a prefill batch holds a slot (so a capped
        server queues prompts before their first token instead of stretching every request's TPOT)."""
        held = peer.batch_size + peer.queued_requests + self.handoffs_in_flight(peer)
        held += sum(len(b.requests) for b in (self.inflight, self.suspended) if b is not None)
        return max(0, self.max_running - held)

    def handoffs_in_flight(self, peer) -> int:
        """Requests handed to decode that it has not received yet, counted exactly: a count of what was
        sent against decode's published count of what arrived. (It used to be a guess — a hand-off was
        taken as received after two more decode publishes — and under load a message slower than two
        publishes let a capped server start a prompt beside a request still on its way to decode.) A
        decode that (re)started counts from zero and never gets what was sent to the one before it: the
        launcher fails those requests. Prefill sees decode's pid before it hands anything over (it reads
        this before each admission, and no request is routed before both workers publish); a restarted
        prefill, beside a decode that has received many, starts from that decode's count."""
        if peer.pid != self.decode_pid:  # a decode process seen for the first time: count from here
            self.decode_pid, self.sent_before = peer.pid, self.handed_total - peer.handoffs_seen
        return max(0, self.handed_total - self.sent_before - peer.handoffs_seen)

    def iterate(self) -> Wake:
        """Decide, and start a layer group when the decision runs one."""
        if self.yield_until:
            if self.now() < self.yield_until:
                return Wake.until(self.yield_until)
            self.yield_until = 0.0
        view = self.view()
        decision = self.decide_timed(self.policy.decide, view)
        self.predictions = decision.predictions
        self.claimed_units = decision.claimed_units if decision.num_layers > 0 and decision.yield_s <= 0 else 0
        if decision.yield_s > 0:
            self.yield_until = view.now + decision.yield_s
            self.record(view.now, 0, run=False, queue=len(self.queue), decode_batch=view.peer.batch_size,
                        reason=decision.reason)
            return Wake.until(self.yield_until)
        if decision.num_layers <= 0:
            if self._unpin_waiting(view):
                return Wake.NOW  # the pages they pinned may be evicted now: decide again
            return Wake.EVENT
        self.apply_units(decision.units)
        if decision.preempt and self.inflight is not None and self.suspended is None:
            self.suspended, self.inflight = self.inflight, None
            if not self._start(decision.admit):  # decode took the pages meanwhile: go on with the batch
                self.inflight, self.suspended = self.suspended, None
                return Wake.NOW
            self.preemptions += 1
        if self.inflight is None and not self._start(decision.admit):
            return Wake.EVENT  # no pages for the batch yet: decode frees them as requests finish
        self.publish()  # before the step: decode sees a new share (a burst, a hand-back) at once
        inflight = self.inflight
        layers = min(decision.num_layers, inflight.remaining_layers)
        finishing = None
        if layers == inflight.remaining_layers:  # the last group: sample who still wants a token
            finishing = [r for r in inflight.requests if r not in self.aborted and r.params.max_new_tokens > 0]
        return self.launch(inflight.requests, lambda done: self.env.executor.run_prefill(inflight, layers, finishing, done),
                           lambda seconds: self._step_done(view, decision, layers, seconds))

    def _unpin_waiting(self, view: PrefillView) -> bool:
        """Nothing runs anywhere and nothing can start: the queue's pinned prefixes fill the pool
        (only running requests free pages). Let them go; each request re-matches when it starts."""
        if self.cache is None or self.inflight or self.suspended or not self.queue or view.peer.batch_size:
            return False
        return sum(self.cache.unmatch(r) for r in self.queue) > 0

    def _start(self, admit: list[Request]) -> bool:
        started = take_admitted(self.queue, admit, self.env.allocator, self.cache)
        if not started:
            return False
        self.inflight = InflightPrefill(started, 0, self.num_layers, self.now(),
                                        starts=[r.num_cached for r in started])
        return True

    def _step_done(self, view: PrefillView, decision: PrefillDecision, layers: int, seconds: float) -> None:
        inflight = self.inflight
        self.last_step_ms = seconds * 1e3
        inflight.layers_done += layers
        peer_after = self.read_peer()
        self.policy.observe(decision, seconds, view, peer_after)
        self.steps += 1
        if self.env.timeline.enabled:  # decode_batch: at the decision; beside: what the step is learnt as
            self.record(view.now, self.env.partition.current_units, run=True, layers=decision.num_layers,
                        batch=len(inflight.requests), tokens=inflight.num_tokens, queue=len(self.queue),
                        decode_batch=view.peer.batch_size, beside=beside_size(view.peer, peer_after, "batch_size"),
                        pred_ms=decision.predicted_s * 1e3, obs_ms=seconds * 1e3, reason=decision.reason)
        if inflight.remaining_layers == 0:
            self._complete(inflight)
        self.publish()

    def _complete(self, batch: InflightPrefill) -> None:
        self.inflight, self.suspended, reqs = self.suspended, None, batch.requests  # a preempted batch resumes
        handed = 0
        for req, start, computed in zip(reqs, batch.starts, batch.lengths):
            req.num_cached = start + computed
            if req in self.aborted:
                self.aborted.discard(req)
                self._finish(req, Abort(message="aborted by the client"))
            elif req.params.max_new_tokens == 0:
                self._finish(req, Length(length=0))
            elif req.finished:  # its first token already ended it
                self._finish(req, req.finish_reason)
            else:
                if self.cache is not None:  # its prompt's pages are the cache's from now on (decode keeps them)
                    self.cache.insert_computed(req)
                self.env.outbox.handed_off(req)
                handed += 1
        self.handed_total += handed
        if reqs and reqs[0].first_token_time is not None:
            self.last_ttft_ms = (reqs[0].first_token_time - reqs[0].arrival) * 1e3

    def _finish(self, req: Request, reason) -> None:
        if not req.finished:
            req.finish(reason, self.now())
        self.free_pages(req)
        self.env.outbox.finished(req)

    def forget(self, req: Request) -> None:
        if req in self.queue:
            self.queue.remove(req)
        if self.inflight is not None and req in self.inflight.requests:
            # the whole batch failed with it (its layers ran together); a preempted one resumes
            self.inflight, self.suspended = self.suspended, None
        self.aborted.discard(req)

    # -- state ------------------------------------------------------------------------------------
    def pending_first_token(self) -> list[Request]:
        held = [b.requests for b in (self.inflight, self.suspended) if b is not None]
        return self.queue + [r for reqs in held for r in reqs if r.first_token_time is None]

    def counters(self) -> dict:
        counters = {"prefill_preemptions": self.preemptions}
        if self.cache is not None:
            counters.update(self.cache.counters())
        return counters

    def publish(self) -> None:
        inflight = self.inflight
        idle = inflight is None or bool(self.yield_until)
        self.publish_state(
            idle=idle, claimed_units=0 if idle else self.claimed_units,
            batch_size=len(inflight.requests) if inflight else 0,
            queued_requests=len(self.queue) + (len(self.suspended.requests) if self.suspended else 0),
            queued_tokens=sum(r.num_uncomputed for r in self.queue) + (self.suspended.num_tokens if self.suspended else 0),
            tokens_in_flight=inflight.num_tokens if inflight else 0,
            remaining_layers=inflight.remaining_layers if inflight else 0,
            ttft_obs_ms=self.last_ttft_ms, step_obs_ms=self.last_step_ms)
