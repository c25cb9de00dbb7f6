"""A worker process's loop: deliver the messages waiting on its socket to the loop core, run one
pass of the core, publish, and block on the socket for as long as the core said it can wait.

The core runs its steps on the model synchronously (`ModelExecutor`), so a pass that starts a
step returns once it has ended. A step that raises fails the requests in it, not the worker: every
other request goes on (a malformed message never gets this far: the socket layer drops it)."""

from __future__ import annotations

import logging
import traceback
from typing import Callable, Protocol

from bullet.loops.base import LoopCore, Wake, WakeKind
from bullet.types.messages import AbortRequest, Evict, FlushCache, GenerateRequest, Handoff, Recompute, Release
from bullet.types.roles import Role
from bullet.types.worker_state import HEARTBEAT_INTERVAL_S, WorkerFlags
from bullet.workers.outbox import request_from_generate, request_from_handoff, request_from_recompute

log = logging.getLogger("bullet.worker")
PEER_POLL_S = 0.002  # work waits on the peer (pages, a share): look again this soon


class Inbox(Protocol):
    def receive(self, timeout_s: float) -> list: ...


class WorkerDriver:
    def __init__(self, core: LoopCore, io: Inbox, should_stop: Callable[[], bool],
                 on_idle: Callable[[], None] = lambda: None, vet: Callable[[object], str | None] = lambda msg: None,
                 prefetch: Callable[[object], object] = lambda constraint: None,
                 fatal: Callable[[], bool] = lambda: False, heartbeat_s: float = HEARTBEAT_INTERVAL_S):
        self.core, self.io, self.should_stop, self.on_idle = core, io, should_stop, on_idle
        # An idle worker's longest sleep on its socket (`heartbeat_interval_s`): it wakes only to publish its
        # heartbeat, as a message or a signal (`WorkerIO.wake_on_signals`) ends the wait at once. On a small
        # VM each wake-up costs ~0.35 ms of CPU: 20 a second kept an idle worker at 1-3 % of a core.
        self.heartbeat_s = heartbeat_s
        self.vet = vet  # why a well-formed message must still be dropped (bullet.workers.vetting)
        # starts compiling a request's grammar as it arrives (in a background thread), so the step
        # that samples its first token here rarely waits for it (engines.grammar.Grammars.prefetch)
        self.prefetch = prefetch
        # after a failed step: whether the worker can run no other (its tensor-parallel ranks are out
        # of step), so it must exit and be restarted rather than fail every later step too
        self.fatal = fatal
        self.failed_steps = 0

    def run(self) -> None:
        core = self.core
        core.flags |= WorkerFlags.READY
        core.publish()
        wake = Wake.NOW
        while not self.should_stop():
            for msg in self.io.receive(self.timeout_s(wake)):
                self.deliver(msg)
            was_busy = not core.idle
            wake = self.iterate()
            core.publish()
            if was_busy and core.idle:
                self.on_idle()
        core.flags = (core.flags & ~WorkerFlags.READY) | WorkerFlags.STOPPED
        core.publish()

    def iterate(self) -> Wake:
        try:
            return self.core.iterate()
        except Exception as exc:
            self.failed_steps += 1
            failed = self.core.fail_current(f"internal error while running this request: {type(exc).__name__}: {exc}")
            log.error("a step of %d request(s) failed; they were ended with an error:\n%s", len(failed),
                      traceback.format_exc())
            if self.fatal():
                raise
            return Wake.NOW

    def timeout_s(self, wake: Wake) -> float:
        """How long to block on the socket before the next pass."""
        if wake.kind is WakeKind.NOW or wake.kind is WakeKind.BUSY:
            return 0.0
        if wake.kind is WakeKind.AT:
            return max(0.0, wake.at - self.core.now())
        return self.heartbeat_s if self.core.idle else PEER_POLL_S

    def deliver(self, msg) -> None:
        role = self.core.role
        reason = self.vet(msg)
        if reason is not None:
            log.warning("dropped a %s message: %s", type(msg).__name__, reason)
            if isinstance(msg, Handoff) and role is Role.DECODE:
                self.core.handoff_dropped()  # arrived all the same: prefill stops holding a slot for it
            return
        if isinstance(msg, (GenerateRequest, Recompute, Handoff)) and msg.params.constraint is not None:
            self.prefetch(msg.params.constraint)
        if isinstance(msg, AbortRequest):
            self.core.abort(msg.uid, msg.message)
        elif isinstance(msg, GenerateRequest) and role is not Role.DECODE:
            self.core.add(request_from_generate(msg))
        elif isinstance(msg, Recompute) and role is Role.PREFILL:
            self.core.add(request_from_recompute(msg))
        elif isinstance(msg, Handoff) and role is Role.DECODE:
            self.core.add(request_from_handoff(msg))
        elif isinstance(msg, Release) and role is Role.PREFILL:
            self.core.take_back(msg.uid, msg.token_ids, msg.page_table, msg.shared_pages)
        elif isinstance(msg, Evict) and role is Role.PREFILL:
            self.core.evict(msg.pages)
        elif isinstance(msg, FlushCache) and role is not Role.DECODE:
            self.core.flush_cache()
        else:
            log.warning("dropped a %s message: the %s worker does not take it", type(msg).__name__, role)
