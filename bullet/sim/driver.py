"""Drives a loop core on virtual time — what `bullet.workers.driver.WorkerDriver` does in a worker
process, as event callbacks: messages wait in an inbox until the core's next pass (a process reads
its socket only between steps), a pass runs when something wakes the worker (a message, the end of
its step, a timer the core asked for, or — while it waits on its peer — the peer's next publish),
and the core's `Wake` says when the next pass is due."""

from __future__ import annotations

from bullet.core.request import Request
from bullet.loops.base import LoopCore
from bullet.sim.board import StateBoard
from bullet.sim.events import EventLoop
from bullet.sim.metrics import RequestLog


class SimDriver:
    def __init__(self, core: LoopCore, loop: EventLoop, board: StateBoard):
        self.core, self.loop = core, loop
        self.inbox: list[Request] = []  # arrivals and hand-offs the core has not taken yet, in order
        self.waiting_on_peer = False
        self._wake_at: float | None = None
        self._generation = 0
        board.on_publish(core.role.peer, self._peer_published)

    def deliver(self, req: Request) -> None:
        """A request for the core, taken at its next pass."""
        self.inbox.append(req)
        self.wake()

    def pending_arrivals(self) -> list[Request]:
        return self.inbox

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
        for req in inbox:
            self.core.add(req)
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

    def tokens(self, reqs) -> None:
        for req in reqs:
            if req.finished:
                self.log.finished(req)

    def finished(self, req) -> None:
        self.log.finished(req)
