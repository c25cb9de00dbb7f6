"""Drives a loop core on virtual time — what `bullet.workers.driver.WorkerDriver` does in a worker
process, as event callbacks: messages wait in an inbox until the core's next pass (a process reads
its socket only between steps), a pass runs when something wakes the worker (a message, the end of
its step, a timer the core asked for, or — while it waits on its peer — the peer's next publish),
and the core's `Wake` says when the next pass is due."""

from __future__ import annotations

from bullet.core.request import Request, Status
from bullet.loops.base import LoopCore
from bullet.sim.board import StateBoard
from bullet.sim.events import EventLoop
from bullet.sim.metrics import RequestLog


class SimDriver:
    def __init__(self, core: LoopCore, loop: EventLoop, board: StateBoard):
        self.core, self.loop = core, loop
        # arrivals and hand-offs the core has not taken yet, in order; and calls on the core (the prefix
        # cache's messages from decode), made at the same point of its loop as a worker's socket would
        self.inbox: list = []
        self.waiting_on_peer = False
        self._wake_at: float | None = None
        self._generation = 0
        board.on_publish(core.role.peer, self._peer_published)

    def deliver(self, req: Request) -> None:
        """A request for the core, taken at its next pass."""
        self.inbox.append(req)
        self.wake()

    def deliver_call(self, method: str, *args) -> None:
        """`core.<method>(*args)` at the core's next pass (a message other than a request)."""
        self.inbox.append((method, args))
        self.wake()

    def pending_arrivals(self) -> list[Request]:
        return [r for r in self.inbox if isinstance(r, Request)]

    def wake(self, delay: float = 0.0) -> None:
        """Run a pass after `delay` (unless a step is running, or an earlier pass is due)."""
        if self.core.busy:
            return
        when = self.loop.clock.now() + delay
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._generation += 1
        self._wake_at = when
        self.loop.at(when, self._on_wake, self._generation)

    def step_ended(self) -> None:
        """The executor's step ended and the core has taken it: go round again at once."""
        self._generation += 1  # a pass scheduled before the step began is superseded
        self._wake_at = None
        self.wake()

    def _on_wake(self, generation: int) -> None:
        if generation != self._generation or self.core.busy:
            return
        self._wake_at = None
        self.waiting_on_peer = False
        inbox, self.inbox = self.inbox, []
        for item in inbox:
            if isinstance(item, Request):
                self.core.add(item)
            else:
                method, args = item
                getattr(self.core, method)(*args)
        wake = self.core.iterate()
        if wake.kind == "busy":
            return  # published before the step; the step's end continues the loop
        self.core.publish()
        if wake.kind == "now":
            self.wake()
        elif wake.kind == "at":
            self.wake(max(0.0, wake.at - self.loop.clock.now()))
        elif not self.core.idle:
            self.waiting_on_peer = True  # queued work it could not start (pages, a share)

    def _peer_published(self) -> None:
        if self.waiting_on_peer and not self.core.busy:
            self.wake()


class SimOutbox:
    """Where a simulated worker's outputs go: prefill hands requests to the decode driver, decode hands
    requests it cannot keep back to the prefill driver (each after a metadata delay, if any); finished
    requests are logged."""

    def __init__(self, log: RequestLog, loop: EventLoop, hand_off_to: SimDriver | None = None, delay_s: float = 0.0):
        self.log, self.loop, self.hand_off_to, self.delay_s = log, loop, hand_off_to, delay_s
        self.recompute_to: SimDriver | None = None

    def _send(self, driver: SimDriver, req) -> None:
        if self.delay_s <= 0:
            driver.deliver(req)
        else:
            self.loop.at(self.loop.clock.now() + self.delay_s, driver.deliver, req)

    def handed_off(self, req) -> None:
        self._send(self.hand_off_to, req)

    def recompute(self, req) -> None:
        self._send(self.recompute_to, req)

    def _call(self, method: str, *args) -> None:
        if self.delay_s <= 0:
            self.recompute_to.deliver_call(method, *args)
        else:
            self.loop.at(self.loop.clock.now() + self.delay_s, self.recompute_to.deliver_call, method, *args)

    def release(self, req) -> None:
        # a snapshot: the request object lives on (its page table is cleared once this returns)
        self._call("take_back", req.uid, req.all_ids[:req.num_cached], list(req.page_table), req.shared_pages)

    def want_pages(self, num_pages: int) -> None:
        self._call("evict", num_pages)

    def tokens(self, reqs) -> None:
        finished = Status.FINISHED
        for req in reqs:  # every request of every step: `req.finished`, inlined
            if req.status is finished:
                self.log.finished(req)

    def finished(self, req) -> None:
        self.log.finished(req)
