"""One request's state, shared by every loop (prefill, decode, the chunked baseline's unified
worker, the offline engine) and the simulator: its tokens, how many have K/V in the pool, its pages,
its outputs and timestamps.

The next tokens to compute are always `all_ids[num_cached:]` and the logits of the last one give
the next output token — one rule for a fresh prompt, a prefill chunk, a decode step and a
recomputation after preemption. Requests compare by identity: two requests with equal fields are
still two requests (and `in`/`remove` stay O(1) per comparison)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from operator import add, attrgetter

from bullet.types.finish import Abort, Length, Stop
from engines.sampling_params import SamplingParams

_uids = itertools.count(1)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str  # the client's id (reported back; not unique across time)
    prompt_ids: list[int]
    params: SamplingParams
    uid: int = field(default_factory=lambda: next(_uids))  # the server's id: unique per instance, owns pages
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # higher is admitted and prefilled first (`enqueue`); equal ones in arrival order
    output_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    # the first `shared_pages` of page_table belong to the prefix cache (pinned for this request, never
    # freed by it); `cached_tokens`: prompt tokens it found cached on arrival (reported to the client)
    shared_pages: int = 0
    cached_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: Stop | Length | Abort | None = None
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)  # per prompt position
    first_token_time: float | None = None
    finish_time: float | None = None
    reported: int = 0  # output tokens already reported to the frontend (a worker's outbox keeps it)
    # this process's grammar matcher for a constrained request (engines.grammar.Matcher), built when
    # it first samples here; never sent: a worker taking the request over rebuilds it from output_ids
    grammar: object | None = field(default=None, repr=False)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncomputed(self) -> int:
        return self.seq_len - self.num_cached

    @property
    def in_prompt(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: Stop | Length | Abort, now: float | None = None) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason
        self.finish_time = time.monotonic() if now is None else now

    def reset_for_recompute(self) -> None:
        """After preemption: its pages are gone, everything is recomputed on re-admission."""
        self.page_table, self.num_cached, self.status = [], 0, Status.WAITING
        self.shared_pages = 0


def enqueue(queue, req: Request, front: bool = False) -> None:
    """Put `req` in a waiting queue (a list or a deque) that every policy takes new requests from in
    order: higher `priority` first, and among equal priorities in the order they were queued — or,
    with `front`, ahead of its equals (a preempted request resumes before newer ones). With every
    priority equal (the default, 0) this is append / appendleft: today's first come, first served."""
    p = req.priority
    if front:
        i = 0
        while i < len(queue) and queue[i].priority > p:
            i += 1
    else:
        i = len(queue)
        while i and queue[i - 1].priority < p:
            i -= 1
    if i == len(queue):
        queue.append(req)
    else:
        queue.insert(i, req)


def priority_first(order: list[Request]) -> list[Request]:
    """A policy's own order of waiting requests (least predicted latency, ...) under the priority
    order: higher priorities first, the policy's order among equals (a stable sort)."""
    if len(order) < 2 or all(r.priority == order[0].priority for r in order):
        return order
    return sorted(order, key=lambda r: -r.priority)


_prompts, _outputs = attrgetter("prompt_ids"), attrgetter("output_ids")


def total_seq_len(reqs) -> int:
    """sum(r.seq_len for r in reqs), without a Python call per request (every decode step asks)."""
    return sum(map(len, map(_prompts, reqs))) + sum(map(len, map(_outputs, reqs)))


def seq_lens(reqs) -> list[int]:
    """[r.seq_len for r in reqs], likewise."""
    return list(map(add, map(len, map(_prompts, reqs)), map(len, map(_outputs, reqs))))
