"""KV-pool page allocation behind one small interface.

Pages are the unit of the paged KV pool (`page_size` token slots each). Every allocation names an
`owner` (a request's integer id) so that a request's pages can be reclaimed in one call when it is
aborted or its worker dies — nothing else needs to remember which pages a dead request held.

Pages the prefix cache keeps (`bullet.cache`) belong to `CACHE_OWNER`, an id no request has (request
ids start at 1): a finished request's pages change owner with `transfer` instead of being freed, and
the cache frees them again when it evicts. The cache's owner publishes how many pages it holds and
how many of those it could evict (`set_cache_pages`), so any process can tell "free + evictable ==
total" (nothing leaked) without seeing the tree.

`LocalPageAllocator` serves one process (the offline `bullet.LLM` and the chunked baseline); the
two-process runtime uses a shared-memory implementation with the same interface."""

from __future__ import annotations

from abc import ABC, abstractmethod


CACHE_OWNER = 0  # owner of the pages the prefix cache keeps; request ids are >= 1


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated."""


class PageAllocator(ABC):
    total_pages: int
    page_size: int

    @abstractmethod
    def alloc(self, n: int, owner: int) -> list[int]:
        """Allocate `n` pages for `owner`, all or nothing (raises OutOfPages)."""

    @abstractmethod
    def free(self, pages: list[int], owner: int) -> None:
        """Return pages held by `owner`; freeing a page `owner` does not hold raises ValueError."""

    @abstractmethod
    def free_owner(self, owner: int) -> int:
        """Return every page `owner` holds; returns how many were freed (0 if none)."""

    @abstractmethod
    def transfer(self, pages: list[int], owner: int, new_owner: int) -> None:
        """Give pages held by `owner` to `new_owner` (all or nothing; ValueError as in free)."""

    @abstractmethod
    def num_free(self) -> int: ...

    @abstractmethod
    def set_cache_pages(self, cached: int, evictable: int) -> None:
        """Published by the prefix cache's owner: pages it holds, and how many it could evict now."""

    @abstractmethod
    def cache_pages(self) -> tuple[int, int]:
        """(cached, evictable) as last published (0, 0 without a cache)."""

    def num_available(self) -> int:
        """Pages an allocation could get: free now, or after evicting unreferenced cached pages."""
        return self.num_free() + self.cache_pages()[1]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class LocalPageAllocator(PageAllocator):
    """In-process allocator: a free list plus an owner per page."""

    FREE = -1

    def __init__(self, total_pages: int, page_size: int):
        if total_pages <= 0 or page_size <= 0:
            raise ValueError("total_pages and page_size must be positive")
        self.total_pages, self.page_size = total_pages, page_size
        self._free = list(range(total_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._owner = [self.FREE] * total_pages
        self._cache = (0, 0)

    def alloc(self, n: int, owner: int) -> list[int]:
        if owner < 0:
            raise ValueError("owner ids are non-negative")
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.total_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, pages: list[int], owner: int) -> None:
        if len(set(pages)) != len(pages):  # a repeated page would enter the free list twice
            raise ValueError(f"pages {pages} contain duplicates")
        for p in pages:
            if not 0 <= p < self.total_pages or self._owner[p] != owner:
                raise ValueError(f"page {p} is not held by owner {owner}")
        for p in pages:
            self._owner[p] = self.FREE
            self._free.append(p)

    def free_owner(self, owner: int) -> int:
        mine = [p for p, o in enumerate(self._owner) if o == owner]
        self.free(mine, owner)
        return len(mine)

    def transfer(self, pages: list[int], owner: int, new_owner: int) -> None:
        if new_owner < 0:
            raise ValueError("owner ids are non-negative")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} contain duplicates")
        for p in pages:
            if not 0 <= p < self.total_pages or self._owner[p] != owner:
                raise ValueError(f"page {p} is not held by owner {owner}")
        for p in pages:
            self._owner[p] = new_owner

    def num_free(self) -> int:
        return len(self._free)

    def set_cache_pages(self, cached: int, evictable: int) -> None:
        self._cache = (cached, evictable)

    def cache_pages(self) -> tuple[int, int]:
        return self._cache
