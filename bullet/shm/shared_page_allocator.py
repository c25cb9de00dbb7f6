"""KV-pool page allocator shared by the prefill and decode worker processes.

The free list and the owner of every page live in one shared-memory segment,
`/bullet-<instance_id>-pages`; a process-shared robust mutex in the same segment serializes
allocations and frees from both workers (Bullet §3.4.1: "an atomic lock serializes allocation and
deallocation transactions"). Hands out exactly the pages `LocalPageAllocator` would for the same
sequence of calls.

Layout, version 2 (little-endian; offsets in bytes; N = total_pages):

      0   8  magic         b"BULLETPA", stored last by the creator (release order)
      8   4  version       u32 = 1
     16   8  total_pages   u64 N
     24   8  page_size     u64 token slots per page
     32   8  free_count    u64 free pages; written under the lock, read lock-free by num_free()
     40   8  recoveries    u64 times the free list was rebuilt (lock found abandoned, or an
                           interrupted transaction)
     48   8  cached_pages  u64 pages the prefix cache holds (CACHE_OWNER), stored by the cache's owner
     56   8  evictable     u64 of those, pages no request references (the cache could free them now)
     64  64  mutex         pthread_mutex_t (process-shared, robust, error-checking)
    128  4N  free stack    i32 page ids; entries [0, free_count) are free, the top is handed out first
    128 + 8*ceil(4N/8)     owner table: i64 per page, the owning request id or -1 (free)

Crash safety: the owner table is the source of truth. Every transaction writes owners and the free
stack in an order such that, if a worker dies mid-way, rebuilding the free stack from the owner
table yields a consistent state; the next process to take the lock gets EOWNERDEAD from the robust
mutex and does exactly that rebuild. Pages a dead request still owns are reclaimed by free_owner()."""

from __future__ import annotations

import logging
import struct
import time

import numpy as np

from bullet._shmatomic import ROBUST_MUTEX_SIZE, RobustMutex, SharedRegion, robust_mutex_init
from bullet.shm.page_allocator import OutOfPages, PageAllocator
from bullet.shm.segments import Segment, attach_segment, create_segment

log = logging.getLogger(__name__)

MAGIC = b"BULLETPA"
LAYOUT_VERSION = 2
SEGMENT_ROLE = "pages"
FREE = -1
_HEADER = struct.Struct("<8sII QQ")  # magic, version, pad, total_pages, page_size
_FREE_COUNT, _RECOVERIES, _CACHED, _EVICTABLE, _MUTEX, _TABLES = 32, 40, 48, 56, 64, 128
assert ROBUST_MUTEX_SIZE <= _TABLES - _MUTEX


def _table_offsets(total_pages: int) -> tuple[int, int, int]:
    owner_offset = _TABLES + -(-4 * total_pages // 8) * 8
    return _TABLES, owner_offset, owner_offset + 8 * total_pages


class SharedPageAllocator(PageAllocator):
    def __init__(self, segment: Segment):
        self._segment = segment
        self._region = SharedRegion(segment.mm)
        _, _, _, self.total_pages, self.page_size = _HEADER.unpack_from(segment.mm, 0)
        stack_offset, owner_offset, end = _table_offsets(self.total_pages)
        view = memoryview(segment.mm)
        # memoryviews for the per-page work of small transactions (cheaper than numpy per element),
        # numpy views of the same memory for whole-table scans.
        self._stack = view[stack_offset:owner_offset].cast("i")
        self._owner = view[owner_offset:end].cast("q")
        self._owner_np = np.frombuffer(segment.mm, np.int64, self.total_pages, owner_offset)
        self._stack_np = np.frombuffer(segment.mm, np.int32, self.total_pages, stack_offset)
        view.release()
        self._mutex = RobustMutex(self._region, _MUTEX)

    @classmethod
    def create(cls, instance_id: str, total_pages: int, page_size: int) -> SharedPageAllocator:
        if total_pages <= 0 or page_size <= 0:
            raise ValueError("total_pages and page_size must be positive")
        if total_pages >= 2**31:
            raise ValueError("page ids are stored as int32")
        seg = create_segment(instance_id, SEGMENT_ROLE, _table_offsets(total_pages)[2])
        _HEADER.pack_into(seg.mm, 0, b"\0" * 8, LAYOUT_VERSION, 0, total_pages, page_size)
        stack_offset, owner_offset, _ = _table_offsets(total_pages)
        # Same order as LocalPageAllocator: the top of the stack (handed out first) is page 0.
        np.frombuffer(seg.mm, np.int32, total_pages, stack_offset)[:] = np.arange(total_pages - 1, -1, -1)
        np.frombuffer(seg.mm, np.int64, total_pages, owner_offset)[:] = FREE
        region = SharedRegion(seg.mm)
        robust_mutex_init(region, _MUTEX)
        region.store_u64(_FREE_COUNT, total_pages)
        region.store_u64(0, int.from_bytes(MAGIC, "little"))  # release: publishes everything above
        region.release()
        return cls(seg)

    @classmethod
    def attach(cls, instance_id: str, timeout: float = 1.0) -> SharedPageAllocator:
        seg = attach_segment(instance_id, SEGMENT_ROLE)
        region = SharedRegion(seg.mm)
        try:
            deadline = time.monotonic() + timeout
            while region.load_u64(0) == 0 and time.monotonic() < deadline:
                time.sleep(0.001)  # the creator is still initializing
            magic = region.load_u64(0).to_bytes(8, "little")
            version = _HEADER.unpack_from(seg.mm, 0)[1]
            if magic != MAGIC or version != LAYOUT_VERSION:
                raise RuntimeError(f"{seg.name} is not a Bullet page allocator of layout version {LAYOUT_VERSION} "
                                   f"(magic {magic!r}, version {version})")
        except BaseException:
            region.release()
            seg.close()
            raise
        region.release()
        return cls(seg)

    # -- PageAllocator -------------------------------------------------------------------------

    def alloc(self, n: int, owner: int) -> list[int]:
        if owner < 0:
            raise ValueError("owner ids are non-negative")
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        self._lock()
        try:
            top = self._region.load_u64(_FREE_COUNT)
            if n > top:
                raise OutOfPages(f"need {n} pages, {top} free of {self.total_pages}")
            stack, owners = self._stack, self._owner
            pages = [stack[i] for i in range(top - 1, top - 1 - n, -1)]
            try:
                for p in pages:  # owners first: a death before the count update leaves them allocated
                    owners[p] = owner
                self._region.store_u64(_FREE_COUNT, top - n)
            except BaseException:  # e.g. KeyboardInterrupt mid-loop: the caller never gets the pages
                for p in pages:
                    owners[p] = FREE
                self._rebuild_free_stack("an allocation was interrupted")
                raise
            return pages
        finally:
            self._mutex.release()

    def free(self, pages: list[int], owner: int) -> None:
        pages = _distinct(pages)
        self._lock()
        try:
            self._check_held(pages, owner)
            self._push_free(pages)
        finally:
            self._mutex.release()

    def free_owner(self, owner: int) -> int:
        self._lock()
        try:
            mine = np.flatnonzero(self._owner_np == owner).tolist()
            self._push_free(mine)
            return len(mine)
        finally:
            self._mutex.release()

    def transfer(self, pages: list[int], owner: int, new_owner: int) -> None:
        if new_owner < 0:
            raise ValueError("owner ids are non-negative")
        pages = _distinct(pages)
        self._lock()
        try:
            self._check_held(pages, owner)
            owners = self._owner
            for p in pages:  # no free-list change: a death mid-way leaves each page with one owner or the other
                owners[p] = new_owner
        finally:
            self._mutex.release()

    def _check_held(self, pages: list[int], owner: int) -> None:
        """Under the lock: every page exists and belongs to `owner`."""
        owners, total = self._owner, self.total_pages
        for p in pages:
            if not 0 <= p < total or owners[p] != owner:
                raise ValueError(f"page {p} is not held by owner {owner}")

    def num_free(self) -> int:
        return self._region.load_u64(_FREE_COUNT)

    def set_cache_pages(self, cached: int, evictable: int) -> None:
        # single writer (the cache's owner); two separate atomic stores: a reader may see one update
        # ahead of the other, which only ever matters for a moment's estimate
        self._region.store_u64(_CACHED, cached)
        self._region.store_u64(_EVICTABLE, evictable)

    def cache_pages(self) -> tuple[int, int]:
        return self._region.load_u64(_CACHED), self._region.load_u64(_EVICTABLE)

    # -- inspection ----------------------------------------------------------------------------

    def pages_of(self, owner: int) -> list[int]:
        return np.flatnonzero(self._owner_np == owner).tolist()

    @property
    def recoveries(self) -> int:
        return self._region.load_u64(_RECOVERIES)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless the free stack holds exactly the pages the owner table marks free."""
        self._lock()
        try:
            top = self._region.load_u64(_FREE_COUNT)
            stacked = np.sort(self._stack_np[:top])
            free = np.flatnonzero(self._owner_np == FREE)
            if not np.array_equal(stacked, free):
                raise RuntimeError(f"free stack ({top} entries) disagrees with the owner table ({free.size} free)")
        finally:
            self._mutex.release()

    # -- internals -----------------------------------------------------------------------------

    def _lock(self) -> None:
        if self._mutex.acquire():
            self._rebuild_free_stack("a process died holding the allocator lock")

    def _push_free(self, pages: list[int]) -> None:
        # Owners first: if we die (or are interrupted) before the count update, the owner table
        # already says free and the rebuild puts the pages back on the stack.
        stack, owners = self._stack, self._owner
        top = self._region.load_u64(_FREE_COUNT)
        try:
            for i, p in enumerate(pages):
                owners[p] = FREE
                stack[top + i] = p
            self._region.store_u64(_FREE_COUNT, top + len(pages))
        except BaseException:
            self._rebuild_free_stack("a free was interrupted")
            raise

    def _rebuild_free_stack(self, why: str) -> None:
        free = np.flatnonzero(self._owner_np == FREE)
        self._stack_np[: free.size] = free[::-1]  # lowest page id on top, as after create()
        self._region.store_u64(_FREE_COUNT, free.size)
        self._region.fetch_add_u64(_RECOVERIES, 1)
        log.warning("%s: %s; rebuilt the free list from the owner table (%d free)", self._segment.name, why,
                    free.size)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._segment.name

    def close(self) -> None:
        for view in (self._stack, self._owner):
            view.release()
        self._owner_np = self._stack_np = None  # drop their exports of the mmap so it can close
        self._region.release()
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()

    def __enter__(self) -> SharedPageAllocator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _distinct(pages) -> list[int]:
    pages = list(pages)
    if len(set(pages)) != len(pages):
        raise ValueError(f"pages {pages} contain duplicates")
    return pages

