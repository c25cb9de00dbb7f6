"""The prefix cache in the KV pool: the radix tree plus the page moves around it, for the one
process that owns the tree (the prefill worker, or the unified worker of `chunked`/`sglang`).

A request's life with the cache:
* `match` when it arrives: the pages of its longest cached prefix (full pages only, and never its
  last token, whose logits it needs) start its page table, owned by the cache and pinned for it; its
  `num_cached` starts there, so prefill computes only the rest (and every policy sees only the rest);
* the loop allocates its other pages as usual, owned by the request; before it starts, `rematch`
  moves it onto a longer prefix if one was cached since it arrived;
* `insert_computed` once its prompt is computed: its full pages join the tree at once (requests
  arriving while it decodes find them), still pinned for it;
* `release` when it is done with its pages (finished, aborted, failed): the full pages of the tokens
  whose K/V it computed join the tree (`transfer` to `CACHE_OWNER`), the rest are freed, and its pin
  goes; the decode worker sends the pages back in a message for this (`Release`);
* `evict` takes unreferenced pages back to the free list, least recently used first, whenever an
  allocation would otherwise fail (`ensure_free`) or decode asks for pages (`Evict`).

Pages are either free, held by one request, or the cache's (shared by every request that pins
them), so "free + evictable == total" once nothing runs. The counts are published in the allocator
for the other processes (`set_cache_pages`)."""

from __future__ import annotations

import logging
from typing import Sequence

from bullet.cache.radix import Node, RadixTree
from bullet.shm.page_allocator import CACHE_OWNER, OutOfPages, PageAllocator
from bullet.types.request import Request

log = logging.getLogger("bullet.cache")


class PrefixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.tree = RadixTree(allocator.page_size)
        self.pins: dict[int, Node] = {}  # request uid -> the node its matched prefix ends at
        self.matched_tokens = 0  # prompt tokens served from the cache, and looked up, since start
        self.looked_up_tokens = 0
        self.evicted_pages = 0
        self._publish()

    # -- requests -----------------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """Start `req` on its cached prefix (it holds no pages yet); returns the tokens matched."""
        if req.page_table or req.uid in self.pins:
            raise RuntimeError(f"request {req.rid} already holds pages or a pin")
        self.looked_up_tokens += len(req.prompt_ids)
        if req.params.prompt_logprobs:
            return 0  # it needs the logits of every prompt position: compute them all
        # never the last token: its logits give the next one
        node = self.tree.match(req.all_ids, (req.seq_len - 1) // self.page_size)
        if node is self.tree.root:
            return 0
        self.tree.pin(node)
        self.pins[req.uid] = node
        req.page_table = node.path_pages()
        req.shared_pages = len(req.page_table)
        req.num_cached = req.shared_pages * self.page_size
        req.cached_tokens = min(req.num_cached, len(req.prompt_ids))
        self.matched_tokens += req.cached_tokens
        self._publish()
        return req.num_cached

    def rematch(self, req: Request) -> None:
        """Before `req` starts: if a longer prefix of it was cached since it arrived, start it there
        (it holds only the cache's pages while it waits)."""
        if req.params.prompt_logprobs or len(req.page_table) != req.shared_pages:
            return
        if self.tree.depth(req.all_ids, (req.seq_len - 1) // self.page_size) <= req.shared_pages:
            return
        self.unmatch(req)
        self.looked_up_tokens -= len(req.prompt_ids)  # one lookup per request in the hit rate
        self.match(req)

    def unmatch(self, req: Request) -> bool:
        """A waiting request gives up its cached prefix (it holds only the cache's pages): its pin
        goes, so those pages may be evicted; `rematch` finds them again if they are still there when
        it starts. Waiting requests' pins must not keep the pool full while nothing runs (nothing
        would ever free a page). Returns whether it had a prefix."""
        if not req.shared_pages or len(req.page_table) != req.shared_pages:
            return False
        self.unpin(req.uid)
        self.matched_tokens -= req.cached_tokens
        req.page_table, req.shared_pages, req.num_cached, req.cached_tokens = [], 0, 0, 0
        return True

    def insert_computed(self, req: Request) -> None:
        """`req`'s K/V are computed up to `num_cached`: its full pages beyond its cached prefix join
        the tree now (they become the cache's, pinned for it: `shared_pages` grows), so prompts that
        arrive while it decodes can use them. Stops at a page the tree already holds elsewhere."""
        ps = self.page_size
        full = min(req.num_cached // ps, len(req.page_table))
        start = req.shared_pages
        if full <= start or req.params.prompt_logprobs:
            return
        node = self.pins.get(req.uid, self.tree.root)
        deepest = self.tree.extend(node, req.all_ids[start * ps:full * ps], req.page_table[start:full])
        if deepest is node:
            return
        added = len(deepest.path_pages()) - start
        self.allocator.transfer(req.page_table[start:start + added], req.uid, CACHE_OWNER)
        self.tree.pin(deepest)  # before the old pin goes: the path never looks unreferenced
        old = self.pins.get(req.uid)
        if old is not None:
            self.tree.unpin(old)
        self.pins[req.uid] = deepest
        req.shared_pages = start + added
        self._publish()

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` the cache holds now (full pages), without touching anything."""
        return self.tree.depth(tokens, max(0, len(tokens) - 1) // self.page_size) * self.page_size

    def alloc(self, n: int, owner: int) -> list[int]:
        """`n` pages for `owner`, evicting unreferenced cached pages first if too few are free."""
        self.ensure_free(n)
        return self.allocator.alloc(n, owner)

    def release(self, uid: int, tokens: Sequence[int], pages: Sequence[int], shared: int, insert: bool = True) -> None:
        """Request `uid` is done with `pages` (its page table: the first `shared` are the cache's, the
        rest its own). With `insert`, the full pages of `tokens` (whose K/V are all computed) join the
        tree; the request's other pages are freed; its pin goes."""
        pages = list(pages)
        own = pages[shared:]
        keep: set[int] = set()
        if insert and own:
            full = min(len(tokens) // self.page_size, len(pages))
            adopted, _ = self.tree.insert(tokens[:full * self.page_size], pages[:full])
            if adopted:
                self.allocator.transfer(adopted, uid, CACHE_OWNER)
                keep = set(adopted)
        rest = [p for p in own if p not in keep]
        if rest:
            self.allocator.free(rest, uid)
        self.unpin(uid)

    def release_request(self, req: Request, insert: bool = True) -> None:
        """`release` for a request this process holds: its computed tokens are `all_ids[:num_cached]`."""
        tokens = req.all_ids[:req.num_cached] if insert else ()
        self.release(req.uid, tokens, req.page_table, req.shared_pages, insert)
        req.page_table, req.shared_pages = [], 0

    def unpin(self, uid: int) -> None:
        """Drop `uid`'s pin, if it has one (its pages were freed elsewhere, e.g. decode handed it back)."""
        node = self.pins.pop(uid, None)
        if node is not None:
            self.tree.unpin(node)
        self._publish()

    # -- memory -------------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unreferenced cached pages (LRU); returns how many were freed."""
        pages = self.tree.evict(num_pages)
        if pages:
            self.allocator.free(pages, CACHE_OWNER)
            self.evicted_pages += len(pages)
            self._publish()
        return len(pages)

    def ensure_free(self, num_pages: int) -> None:
        """Evict until `num_pages` are free, or raise OutOfPages (evicting nothing) if even all
        unreferenced cached pages would not be enough."""
        short = num_pages - self.allocator.num_free()
        if short <= 0:
            return
        if short > self.tree.num_evictable:
            raise OutOfPages(f"need {num_pages} pages, {self.allocator.num_free()} free and "
                             f"{self.tree.num_evictable} evictable of {self.allocator.total_pages}")
        self.evict(short)

    def flush(self) -> int:
        """Drop every unreferenced page (pinned prefixes stay: requests are using them)."""
        freed = self.evict(self.tree.num_evictable)
        log.info("prefix cache flushed: %d pages freed, %d still pinned", freed, self.tree.num_pages)
        return freed

    @property
    def num_evictable(self) -> int:
        return self.tree.num_evictable

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0

    def counters(self) -> dict:
        return {"cache_pages": self.tree.num_pages, "cache_evictable_pages": self.tree.num_evictable,
                "cache_hit_tokens": self.matched_tokens, "cache_lookup_tokens": self.looked_up_tokens,
                "cache_evicted_pages": self.evicted_pages}

    def _publish(self) -> None:
        self.allocator.set_cache_pages(self.tree.num_pages, self.tree.num_evictable)
