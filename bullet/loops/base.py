"""What every loop core shares, and the seams it is driven through.

A loop core (`PrefillCore`, `DecodeCore`, `UnifiedCore`) owns a worker's queue and batch and its
scheduling state, and runs one pass of the worker's loop per `iterate()`: read the peer's state →
decide (the policy) → apply the partition → start a step → (when the step ends) observe → publish →
record a timeline row. It is driven from outside:

* a **driver** delivers messages between steps (`add`, `abort`) and calls `iterate()`, then waits
  as the returned `Wake` says — `bullet.workers.driver` in a worker process (blocking on its
  socket), `bullet.sim.driver` in the simulator (on virtual time);
* an **executor** runs the steps the core starts and calls back when each ends —
  `bullet.workers.executor` on the model (synchronously: the callback runs before `iterate`
  returns), `bullet.sim.executor` on the simulated device (later, on virtual time);
* an **outbox** takes what the core emits (a request handed to decode, new tokens, a finished
  request) — ZMQ messages in a worker, the next core or the request log in the simulator.

So no step logic is written twice: the worker and the simulator run the same cores, and differ only
in how time passes, how steps execute and where outputs go."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple, Protocol, Sequence

from bullet.cache.prefix_cache import PrefixCache
from bullet.loops.clock import Clock
from bullet.loops.timeline import Timeline
from bullet.partition.base import PartitionBackend
from bullet.policies.views import InflightPrefill
from bullet.shm.page_allocator import PageAllocator
from bullet.types.finish import Abort
from bullet.types.request import Request
from bullet.types.roles import Role
from bullet.types.worker_state import Predictions, WorkerFlags, WorkerState

log = logging.getLogger("bullet.loop")


class StatePort(Protocol):
    """The state buffer as a core sees it: `bullet.shm.state_buffer.StateBuffer` in a worker,
    `bullet.sim.board.StateBoard` in the simulator."""

    def publish(self, role: str, state: WorkerState) -> object: ...

    def read(self, role: str) -> WorkerState: ...


class HybridItem(NamedTuple):
    """One request's share of a hybrid step: `num_tokens` new tokens after `start` cached ones;
    `completes`: they are the sequence's last uncomputed tokens (else a middle chunk of a prompt);
    `logits` is "all" (prompt logprobs), "last" or "none"; `sample`: the step samples its next
    token (it completes the sequence and wants output). Immutable, and a tuple: one is built per
    request per step."""

    req: Request
    start: int
    num_tokens: int
    completes: bool
    logits: str
    sample: bool


def hybrid_shape(items: Sequence[HybridItem]) -> tuple[list[tuple[int, int]], int, int]:
    """What a hybrid step computes, as the estimator prices one: (prompt chunks as (new tokens, cached
    tokens before them), decode rows, their context). An item whose one new token follows a fully
    cached sequence past its prompt is a decode (its context includes that token); anything else is a
    prompt chunk (or the recomputation of a preempted request) after `start` cached tokens. The
    simulated device charges this shape; a worker's timeline records it."""
    chunks, decodes, context = [], 0, 0
    for req, start, num_tokens, completes, _, _ in items:  # every request of every hybrid step
        if num_tokens == 1 and completes and start >= len(req.prompt_ids):
            decodes += 1
            context += start + 1
        else:
            chunks.append((num_tokens, start))
    return chunks, decodes, context


class Executor(Protocol):
    """Runs the steps a core starts; `on_done(seconds)` when the step has ended (the seconds the
    device spent, which the policy observes)."""

    def run_prefill(self, batch: InflightPrefill, layers: int, finishing: Sequence[Request] | None,
                    on_done: Callable[[float], None]) -> None:
        """The next `layers` layers of `batch` (from `batch.layers_done`). With `finishing`, these
        are the last layers: record prompt logprobs and sample the first token of each request in
        `finishing` (appending it, checking the finish rules)."""

    def run_decode(self, batch: Sequence[Request], on_done: Callable[[float], None],
                   between_layers: Callable[[int], None] | None = None) -> None:
        """One decode iteration: a token appended to each request (finish rules checked). Where the
        step runs layer by layer, `between_layers(layers_done)` runs after each layer but the last."""

    def run_hybrid(self, items: Sequence[HybridItem], on_done: Callable[[float], None]) -> None:
        """One hybrid step (the chunked baseline): every item's tokens, and a sampled token for
        each item with `sample`."""


class Outbox(Protocol):
    """Where a core's outputs go."""

    def handed_off(self, req: Request) -> None:
        """Prefill is done with `req` (first token sampled, K/V in its pages): decode takes it."""

    def tokens(self, reqs: Sequence[Request]) -> None:
        """Each of `reqs` has new output tokens since it was last reported (finished ones carry
        their finish reason; their pages are already free)."""

    def finished(self, req: Request) -> None:
        """`req` ended without new tokens since last reported (aborted, dropped, scored only)."""

    def recompute(self, req: Request) -> None:
        """Decode gave up `req`'s pages (the pool ran out): prefill recomputes it and hands it back."""

    def release(self, req: Request) -> None:
        """Decode is done with `req`'s pages: the prefix cache (in the prefill worker) takes them."""

    def want_pages(self, num_pages: int) -> None:
        """Decode needs `num_pages` more free pages: the prefix cache's owner evicts that many."""


class WakeKind(Enum):
    NOW = "now"  # go round again at once
    EVENT = "event"  # nothing to do until a message arrives or the peer's state changes
    AT = "at"  # go round again at a clock time
    BUSY = "busy"  # a step is running; its end (the executor's callback) continues the loop


@dataclass(frozen=True)
class Wake:
    """What a driver waits for before the next `iterate()`."""

    kind: WakeKind
    at: float = 0.0  # clock time, for WakeKind.AT

    @staticmethod
    def until(t: float) -> "Wake":
        return Wake(WakeKind.AT, t)


Wake.NOW = Wake(WakeKind.NOW)
Wake.EVENT = Wake(WakeKind.EVENT)
Wake.BUSY = Wake(WakeKind.BUSY)


@dataclass
class LoopEnv:
    """What a core runs against, supplied by its driver."""

    role: Role
    clock: Clock
    state: StatePort
    allocator: PageAllocator
    partition: PartitionBackend
    timeline: Timeline
    executor: Executor
    outbox: Outbox
    pid: int = 0


class LoopCore:
    def __init__(self, env: LoopEnv):
        self.env = env
        self.flags = WorkerFlags(0)
        self.steps = 0
        self.busy = False  # a step is running on the executor
        self.current: list[Request] = []  # the requests of the step running now
        self.predictions = Predictions()
        self.last_step_ms = 0.0
        self.decide_us = 0.0  # wall time the last decision took (scheduler overhead)
        self.decisions = 0  # policy decisions so far, and how many changed the compute share (published
        self.repartitions = 0  # for /metrics)
        # the prefix cache, in the core that owns it (prefill, unified); None when off or elsewhere
        self.cache: PrefixCache | None = None
        self.remote_cache = False  # decode with a cache in the prefill worker: pages go back there

    @property
    def role(self) -> Role:
        return self.env.role

    def now(self) -> float:
        return self.env.clock.now()

    @property
    def idle(self) -> bool:
        """Holds no request at all (a driver may block for long)."""
        raise NotImplementedError

    def iterate(self) -> Wake:
        raise NotImplementedError

    def add(self, req: Request) -> None:
        raise NotImplementedError

    def abort(self, uid: int, message: str) -> None:
        raise NotImplementedError

    def fail_current(self, message: str) -> list[Request]:
        """The running step raised: end its requests with an error (pages freed, outputs sent) and
        forget the step, so the loop goes on with everything else. Returns the failed requests."""
        failed, self.current, self.busy = self.current, [], False
        for req in failed:
            self.forget(req)
            if not req.finished:
                req.finish(Abort(message=message), self.now())
            try:  # failing a request must not fail the loop (its pages may be what went wrong)
                self.free_pages(req)
            except ValueError as exc:
                log.error("request %s: its pages could not be freed: %s", req.rid, exc)
                req.page_table = []
            self.env.outbox.finished(req)
        return failed

    def forget(self, req: Request) -> None:
        """Drop `req` from this core's queue and batch (it is being failed)."""
        raise NotImplementedError

    def pending_first_token(self) -> list[Request]:
        """Requests held here that have not produced their first token."""
        return []

    def counters(self) -> dict:
        return {}

    # -- shared mechanics ---------------------------------------------------------------------------
    def read_peer(self) -> WorkerState:
        return self.env.state.read(self.role.peer)

    def apply_units(self, units: int) -> None:
        if units != self.env.partition.current_units:
            self.env.partition.apply(units)
            self.repartitions += 1

    def decide_timed(self, decide, view):
        """policy.decide(view), timing the scheduler's own overhead in wall time."""
        t0 = time.perf_counter()
        decision = decide(view)
        self.decide_us = (time.perf_counter() - t0) * 1e6
        self.decisions += 1
        return decision

    def launch(self, reqs: Sequence[Request], run: Callable[[Callable[[float], None]], None],
               done: Callable[[float], None]) -> Wake:
        """Start a step of `reqs` on the executor; `done(seconds)` runs when it ends (maybe before
        this returns)."""
        self.busy, self.current = True, list(reqs)

        def finished(seconds: float) -> None:
            self.busy, self.current = False, []
            done(seconds)

        run(finished)
        return Wake.BUSY if self.busy else Wake.NOW

    def publish_state(self, idle: bool = False, **fields) -> None:
        """Publish this worker's state; an idle worker reports no units (it uses none)."""
        partition = self.env.partition
        # set field by field: a 22-field constructor called by keyword costs more (twice a step)
        state = WorkerState()
        state.pid, state.step, state.flags = self.env.pid, self.steps, int(self.flags)
        state.decisions, state.repartitions = self.decisions, self.repartitions
        for name, value in fields.items():
            setattr(state, name, value)
        self.predictions.write_to(state)
        if not idle:
            state.set_unit_mask(partition.unit_mask())  # the layout's mask holds ids 0-191
            state.compute_units = partition.current_units  # the count holds them all (H100: 132)
        self.env.state.publish(self.role.block, state)

    def publish(self) -> None:
        raise NotImplementedError

    def record(self, t: float, units: int, **fields) -> None:
        """A timeline row for a decision taken at clock time `t`."""
        self.env.timeline.record(t, units, **fields, sched_us=round(self.decide_us, 1))

    def free_pages(self, req: Request) -> None:
        """This core is done with `req`'s pages: the prefix cache keeps what it can of them (the
        full pages of tokens with computed K/V), the rest are freed."""
        if self.cache is not None:
            self.cache.release_request(req)
        elif self.remote_cache:
            if req.page_table:
                self.env.outbox.release(req)
            req.page_table, req.shared_pages = [], 0
        else:
            self.free_own_pages(req)

    def free_own_pages(self, req: Request) -> None:
        """Free the pages `req` owns (not the prefix cache's it started on)."""
        own = req.page_table[req.shared_pages:]
        if own:
            self.env.allocator.free(own, req.uid)
        req.page_table, req.shared_pages = [], 0

    # -- the prefix cache's messages (its owner: prefill or unified) --------------------------------
    def take_back(self, uid: int, tokens: list[int], pages: list[int], shared: int) -> None:
        """Decode is done with request `uid`'s pages (`Release`)."""
        if self.cache is not None:
            self.cache.release(uid, tokens, pages, shared)
        else:  # the cache was turned off meanwhile (cannot happen in one server): free what it owns
            self.env.allocator.free(list(pages)[shared:], uid)

    def evict(self, num_pages: int) -> None:
        """Decode needs pages (`Evict`)."""
        if self.cache is not None:
            self.cache.evict(num_pages)

    def flush_cache(self) -> int:
        """/flush_cache: every unreferenced cached page back to the free list."""
        return self.cache.flush() if self.cache is not None else 0

    def free_pages_view(self) -> int:
        """Pages an allocation here can get: free, or cached and unreferenced (evicted on demand)."""
        free = self.env.allocator.num_free()
        return free + self.cache.num_evictable if self.cache is not None else free
