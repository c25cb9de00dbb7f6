"""Drives a loop core on virtual time — what `bullet.workers.driver.WorkerDriver` does in a worker
process, as event callbacks: messages wait in an inbox until the core's next pass (a process reads
its socket only between steps), a pass runs when something wakes the worker (a message, the end of
its step, a timer the core asked for, or — while it waits on its peer — the peer's next publish),
and the core's `Wake` says when the next pass is due."""

from __future__ import annotations

from typing import Mapping

from bullet.loops.base import LoopCore, WakeKind
from bullet.sim.board import StateBoard
from bullet.sim.events import EventLoop
from bullet.sim.metrics import RequestLog
from bullet.types.messages import Evict, Release
from bullet.types.request import Request, Status
from bullet.types.roles import Role


class SimDriver:
    def __init__(self, core: LoopCore, loop: EventLoop, board: StateBoard):
        self.core, self.loop = core, loop
        # arrivals and hand-offs the core has not taken yet, in order; and the prefix cache's messages
        # from decode, taken at the same point of its loop as a worker's socket would
        self.inbox: list[Request | Release | Evict] = []
        self.waiting_on_peer = False
        self._wake_at: float | None = None
        self._generation = 0
        board.on_publish(core.role.peer, self._peer_published)

    def deliver(self, item: Request | Release | Evict) -> None:
        """A request or a prefix-cache message for the core, taken at its next pass."""
        self.inbox.append(item)
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
        for item in inbox:  # as `bullet.workers.driver.WorkerDriver.deliver` takes the same messages
            if isinstance(item, Request):
                self.core.add(item)
            elif isinstance(item, Release):
                self.core.take_back(item.uid, item.token_ids, item.page_table, item.shared_pages)
            else:
                self.core.evict(item.pages)
        wake = self.core.iterate()
        if wake.kind is WakeKind.BUSY:
            return  # published before the step; the step's end continues the loop
        self.core.publish()
        if wake.kind is WakeKind.NOW:
            self.wake()
        elif wake.kind is WakeKind.AT:
            self.wake(max(0.0, wake.at - self.loop.clock.now()))
        elif not self.core.idle:
            self.waiting_on_peer = True  # queued work it could not start (pages, a share)

    def _peer_published(self) -> None:
        if self.waiting_on_peer and not self.core.busy:
            self.wake()


class SimOutbox:
    """Where a simulated worker's outputs go: prefill hands requests to the decode driver, decode hands
    requests it cannot keep back, and the prefix cache's messages, to the prefill driver (each after a
    metadata delay, if any); finished requests are logged. `drivers` is the simulation's drivers by
    role — the two workers send to each other, so each looks its peer up when it sends."""

    def __init__(self, log: RequestLog, loop: EventLoop, drivers: Mapping[Role, SimDriver], delay_s: float = 0.0):
        self.log, self.loop, self.drivers, self.delay_s = log, loop, drivers, delay_s

    def _send(self, role: Role, item: Request | Release | Evict) -> None:
        driver = self.drivers[role]
        if self.delay_s <= 0:
            driver.deliver(item)
        else:
            self.loop.at(self.loop.clock.now() + self.delay_s, driver.deliver, item)

    def handed_off(self, req) -> None:
        self._send(Role.DECODE, req)

    def recompute(self, req) -> None:
        self._send(Role.PREFILL, req)

    def release(self, req) -> None:
        # a snapshot: the request object lives on (its page table is cleared once this returns); built
        # unvalidated, as nothing here came from outside the process
        self._send(Role.PREFILL, Release.model_construct(uid=req.uid, token_ids=req.all_ids[:req.num_cached],
                                                         page_table=list(req.page_table),
                                                         shared_pages=req.shared_pages))

    def want_pages(self, num_pages: int) -> None:
        self._send(Role.PREFILL, Evict.model_construct(pages=num_pages))

    def tokens(self, reqs) -> None:
        finished = Status.FINISHED
        for req in reqs:  # every request of every step: `req.finished`, inlined
            if req.status is finished:
                self.log.finished(req)

    def finished(self, req) -> None:
        self.log.finished(req)
