"""One process, both phases, chunked prefill — the two ways single-process engines batch:

* mixed (`chunked:<budget>`, Sarathi-Serve, SGLang with `--enable-mixed-chunk`, and the offline
  `bullet.LLM`): every step takes all running decodes first (one token each), then fills the rest of
  a fixed token budget with prefill chunks in arrival order (higher `priority` first);
* prefill first (`sglang:<budget>`, SGLang's default): a step runs prefill chunks only — the
  continuation of a chunked prompt, then new prompts — up to the budget whenever there are any, and
  a decode-only step otherwise.
A prompt longer than what is left of the budget is split across steps. Memory: pages are allocated
per step; when a sequence cannot get a page, unreferenced prefix-cache pages are evicted, then the
most recently admitted request is preempted and later recomputed.

With a prefix cache a request starts, on arrival, on its longest cached prefix (`num_cached` past
it: only the rest is scheduled, and its chunks attend to the cached pages); when it finishes or is
aborted its computed pages join the cache. A preempted request's pages are freed, not cached: it
was preempted to free memory."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from bullet.cache.prefix_cache import PrefixCache
from bullet.shm.page_allocator import OutOfPages, PageAllocator
from bullet.types.request import Request, Status, enqueue


class Scheduled(NamedTuple):
    """A request's part of the next step (a tuple: one is built per running request per step)."""

    req: Request
    num_tokens: int  # tokens computed for it this step (from req.num_cached)


class HybridScheduler:
    def __init__(self, allocator: PageAllocator, token_budget: int, max_running: int, mixed: bool = True,
                 cache: PrefixCache | None = None):
        if token_budget < 1 or max_running < 1:
            raise ValueError("token budget and max running requests must be positive")
        self.allocator, self.token_budget, self.max_running, self.mixed = allocator, token_budget, max_running, mixed
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: prefilling (possibly chunked) or decoding
        self.preemptions = 0

    def add(self, req: Request) -> None:
        if self.cache is not None:
            self.cache.match(req)
        enqueue(self.waiting, req)  # by priority, then arrival (admission takes the head)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, num_tokens: int) -> None:
        need = self.allocator.pages_for(req.num_cached + num_tokens) - len(req.page_table)
        if need > 0:
            alloc = self.cache.alloc if self.cache is not None else self.allocator.alloc
            req.page_table.extend(alloc(need, req.uid))

    def release(self, req: Request, keep: bool = True) -> None:
        """`req` leaves the scheduler (finished, aborted, preempted): with `keep`, the prefix cache
        takes its computed pages."""
        if self.cache is not None:
            self.cache.release_request(req, insert=keep)
        elif req.page_table:
            self.allocator.free(req.page_table, req.uid)
            req.page_table = []
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _preempt_newest(self, keep: Request) -> bool:
        for victim in reversed(self.running):
            if victim is not keep:
                self.release(victim, keep=False)
                victim.reset_for_recompute()
                enqueue(self.waiting, victim, front=True)
                self.preemptions += 1
                return True
        return False

    def _unpin_waiting(self, keep: Request) -> bool:
        """Memory ran out with nothing left to preempt: the prefixes waiting requests pin are all it
        could come from. They let go (each re-matches when admitted); returns whether any did."""
        if self.cache is None:
            return False
        return sum(self.cache.unmatch(r) for r in self.waiting if r is not keep) > 0

    @staticmethod
    def decoding(req: Request) -> bool:
        """Its next step computes one token after a fully cached sequence past its prompt."""
        return req.num_uncomputed == 1 and not req.in_prompt

    def schedule(self) -> list[Scheduled]:
        if self.mixed:
            return self._schedule(None, admit=True)
        prefill = self._schedule(False, admit=True)
        return prefill if prefill else self._schedule(True, admit=False)

    def _schedule(self, decodes: bool | None, admit: bool) -> list[Scheduled]:
        """Running requests — the decodes (`decodes` True), the others (False: continuing chunks,
        recomputations) or all of them (None) — then, with `admit`, new prompts, while the token
        budget and memory last."""
        batch: list[Scheduled] = []
        budget = self.token_budget
        page, running, make = self.allocator.page_size, Status.RUNNING, tuple.__new__
        # 1. running requests: decodes (1 token) and the continuation of chunked prefills; this loop
        # visits every running request every step, so it reads each field once (`decoding`, inlined)
        for req in list(self.running):
            # preempted while making room for an earlier one (a status check is O(1))
            if req.status is not running:
                continue
            cached, prompt = req.num_cached, len(req.prompt_ids)
            n = prompt + len(req.output_ids) - cached  # req.num_uncomputed
            if decodes is not None and (n == 1 and cached >= prompt) is not decodes:
                continue
            if n > budget:
                n = budget
            if n == 0:
                continue
            if cached + n > len(req.page_table) * page:  # it needs a page (`_grow`)
                while True:
                    try:
                        self._grow(req, n)
                        break
                    except OutOfPages:
                        if not (self._preempt_newest(keep=req) or self._unpin_waiting(keep=req)):
                            raise
            batch.append(make(Scheduled, (req, n)))  # Scheduled(req, n)
            budget -= n
        # 2. new prompts, in queue order (priority, then first come first served), while budget and memory last
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.cache is not None:
                self.cache.rematch(req)  # a longer prefix may have been cached since it arrived
            n = min(req.num_uncomputed, budget)
            try:
                self._grow(req, n)
            except OutOfPages:
                if self.running or batch:
                    break
                if not self._unpin_waiting(keep=req):
                    raise  # nothing will ever free memory: the caller rejects this request
                continue
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append(Scheduled(req, n))
            budget -= n
        return batch
