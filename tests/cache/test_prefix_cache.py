"""The prefix cache over a real page allocator (local and shared): what a request starts on, what
joins the tree when it is done, eviction when an allocation would fail, and no page ever leaked."""

from __future__ import annotations

import pytest

from bullet.cache.prefix_cache import PrefixCache
from bullet.shm.page_allocator import CACHE_OWNER, LocalPageAllocator, OutOfPages
from bullet.shm.segments import new_instance_id
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.types.request import Request
from engines.sampling_params import SamplingParams

PS = 4
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def request(tokens: list[int], uid: int, **params) -> Request:
    return Request(rid=f"r{uid}", prompt_ids=list(tokens), uid=uid,
                   params=SamplingParams(max_new_tokens=4, temperature=0.0, **params))


def run(cache: PrefixCache, req: Request) -> None:
    """What a loop does with a request: match, allocate the rest, compute it all, release."""
    cache.match(req)
    alloc = cache.allocator
    req.page_table += cache.alloc(alloc.pages_for(req.seq_len) - len(req.page_table), req.uid)
    req.num_cached = req.seq_len
    cache.release_request(req)


def accounted(alloc) -> bool:
    cached, evictable = alloc.cache_pages()
    return alloc.num_free() + evictable == alloc.total_pages and cached == evictable


PROMPT = list(range(1, 11))  # 10 tokens: two full pages and a half page


def test_a_second_request_starts_on_the_full_pages_of_the_first():
    alloc = LocalPageAllocator(16, PS)
    cache = PrefixCache(alloc)
    run(cache, request(PROMPT, 1))
    assert alloc.cache_pages() == (2, 2) and alloc.num_free() == 14  # the half page was freed
    second = request(PROMPT + [42, 43], 2)
    assert cache.match(second) == 8  # the prefix ends mid-page: its full pages only
    assert second.shared_pages == 2 and second.cached_tokens == 8 and second.num_uncomputed == 4
    assert alloc.cache_pages() == (2, 0)  # pinned while it runs
    second.page_table += cache.alloc(1, second.uid)
    second.num_cached = second.seq_len
    cache.release_request(second)
    assert alloc.cache_pages() == (3, 3) and accounted(alloc)


def test_never_the_last_token_and_never_for_prompt_logprobs():
    alloc = LocalPageAllocator(16, PS)
    cache = PrefixCache(alloc)
    run(cache, request(PROMPT[:8], 1))
    again = request(PROMPT[:8], 2)  # exactly two cached pages: the last token's logits are needed
    assert cache.match(again) == 4 and again.num_uncomputed == 4
    cache.release_request(again, insert=False)
    assert cache.match(request(PROMPT[:8], 3, prompt_logprobs=True)) == 0
    assert cache.cached_prefix(PROMPT) == 8
    assert accounted(alloc)


def test_evicts_unreferenced_pages_when_an_allocation_would_fail():
    alloc = LocalPageAllocator(6, PS)
    cache = PrefixCache(alloc)
    run(cache, request(list(range(100, 112)), 1))  # 3 pages cached
    run(cache, request(list(range(200, 208)), 2))  # 2 more
    assert alloc.num_free() == 1 and alloc.cache_pages() == (5, 5)
    pinned = request(list(range(200, 208)) + [7], 3)
    cache.match(pinned)  # pins the second request's 2 pages
    got = cache.alloc(3, 9)  # evicts just enough of the first request's (least recently used) pages
    assert len(got) == 3 and alloc.cache_pages() == (3, 1) and alloc.num_free() == 0
    with pytest.raises(OutOfPages):
        cache.alloc(2, 9)  # only one page is unpinned: nothing is evicted for a request that cannot fit
    assert alloc.cache_pages() == (3, 1)
    alloc.free(got, 9)
    cache.release_request(pinned, insert=False)
    assert accounted(alloc) and cache.flush() == 3 and alloc.num_free() == alloc.total_pages


def test_decode_side_release_with_a_duplicate_page():
    """Two requests with the same prompt computed at once: the second's copy is freed on release."""
    alloc = LocalPageAllocator(16, PS)
    cache = PrefixCache(alloc)
    a, b = request(PROMPT, 1), request(PROMPT, 2)
    for r in (a, b):
        cache.match(r)
        r.page_table += cache.alloc(3, r.uid)
        r.num_cached = r.seq_len
    cache.release(a.uid, a.all_ids, a.page_table, a.shared_pages)
    cache.release(b.uid, b.all_ids, b.page_table, b.shared_pages)
    assert alloc.cache_pages() == (2, 2) and alloc.num_free() == 14
    assert alloc.pages_for(1) == 1 and accounted(alloc)


def test_shared_allocator_transfer_and_published_counts():
    alloc = SharedPageAllocator.create(new_instance_id(), 8, PS)
    try:
        other = SharedPageAllocator.attach(alloc.name.split("-")[1])
        cache = PrefixCache(alloc)
        run(cache, request(PROMPT, 1))
        assert alloc.pages_of(CACHE_OWNER) == [0, 1] and other.cache_pages() == (2, 2)
        with pytest.raises(ValueError):
            alloc.transfer([0], 1, 5)  # not request 1's any more
        assert other.num_available() == 8
        cache.flush()
        assert alloc.num_free() == 8 and other.cache_pages() == (0, 0)
        alloc.check_invariants()
        other.close()
    finally:
        alloc.close()
        alloc.unlink()


def test_a_prefilled_prompt_is_shared_while_its_request_still_decodes():
    alloc = LocalPageAllocator(16, PS)
    cache = PrefixCache(alloc)
    a = request(PROMPT, 1)
    cache.match(a)
    a.page_table += cache.alloc(3, a.uid)
    a.num_cached = len(PROMPT)  # prefilled
    cache.insert_computed(a)
    assert a.shared_pages == 2  # its two full pages are the cache's now; the partial one stays its own
    assert alloc.cache_pages() == (2, 0)  # pinned for a while it decodes
    b = request(PROMPT + [50], 2)
    assert cache.match(b) == 8  # found while a still runs
    # decode finishes a (its partial page is its own) and sends the pages back
    a.output_ids += [60, 61, 62]
    a.num_cached = a.seq_len - 1
    cache.release(a.uid, a.all_ids[:a.num_cached], a.page_table, a.shared_pages)
    assert alloc.cache_pages() == (3, 1)  # the third page (prompt tail + outputs) joined; b pins two
    cache.release_request(b, insert=False)
    assert accounted(alloc)


def test_a_waiting_request_can_let_its_prefix_go_and_find_it_again():
    alloc = LocalPageAllocator(16, PS)
    cache = PrefixCache(alloc)
    run(cache, request(PROMPT, 1))
    waiting = request(PROMPT + [7, 8], 2)
    cache.match(waiting)
    assert cache.unmatch(waiting) and waiting.num_cached == 0 and not waiting.page_table
    assert alloc.cache_pages() == (2, 2) and not cache.unmatch(waiting)
    cache.rematch(waiting)
    assert waiting.cached_tokens == 8 and waiting.shared_pages == 2 and alloc.cache_pages() == (2, 0)
    assert cache.hit_rate == pytest.approx(8 / (len(PROMPT) + len(PROMPT) + 2))
    cache.release_request(waiting, insert=False)
    assert accounted(alloc)
