"""Prefill on a cached prefix gives what a cold run gives: the real model, greedy, token for token
(and logprobs within a float tolerance) — a prefix that ends on a page boundary, one that ends
mid-page (its partial page is recomputed), a whole prompt already cached, and a prefix evicted
between two turns. In one process (the unified loop the chunked baselines serve with); the served
tests cover the two-worker path."""

from __future__ import annotations

import pytest

from tests.launcher.test_two_process_runtime import TEXT

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def cold():
    import bullet

    return bullet.LLM(dtype="float32", max_total_tokens=4096)


@pytest.fixture(scope="module")
def engine():
    import bullet

    # a small pool: a few conversations fill it and the cache must evict
    return bullet.LLM(dtype="float32", max_total_tokens=1024, prefix_cache=True)


@pytest.fixture()
def warm(engine):
    engine.engine.cache.flush()  # each test starts on an empty cache
    assert engine.allocator.num_free() == engine.allocator.total_pages
    return engine


def same(a, b):
    assert a.output_ids == b.output_ids
    assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-3)


def test_second_turn_reuses_the_first_and_matches_a_cold_run(cold, warm):
    ids = cold.encode(TEXT * 3)
    first = ids[:100]  # 6 full pages and 4 tokens
    out1 = warm.generate([first], GREEDY)[0]
    assert out1.cached_tokens == 0
    # turn 2: the history (prompt + answer) plus a new message
    second = first + out1.output_ids + ids[200:230]
    out2 = warm.generate([second], GREEDY)[0]
    # turn 1 computed K/V for its prompt and all but its last output token: full pages of that
    assert out2.cached_tokens == (len(first) + len(out1.output_ids) - 1) // 16 * 16
    same(out2, cold.generate([second], GREEDY)[0])
    assert warm.allocator.cache_pages()[0] > 0


@pytest.mark.parametrize("length", [96, 100, 111])  # on a page boundary, just past one, just before the next
def test_prefixes_on_and_off_page_boundaries(cold, warm, length):
    ids = cold.encode(TEXT * 3)
    warm.generate([ids[:length]], {"temperature": 0, "max_new_tokens": 1})
    prompt = ids[:length] + ids[300:317]
    out = warm.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == (length // 16) * 16  # full pages only (the last token of turn 1 has K/V too)
    same(out, cold.generate([prompt], GREEDY)[0])


def test_a_fully_cached_prompt_recomputes_its_last_token(cold, warm):
    ids = cold.encode(TEXT * 3)[:64]  # exactly four pages
    warm.generate([ids], GREEDY)
    out = warm.generate([ids], GREEDY)[0]
    assert out.cached_tokens == 48  # never the last page's last token: its logits give the answer
    same(out, cold.generate([ids], GREEDY)[0])


def test_a_prefix_evicted_between_turns(cold, warm):
    ids = cold.encode(TEXT * 3)
    convo = ids[:200]
    warm.generate([convo], {"temperature": 0, "max_new_tokens": 1})
    assert warm.engine.cache.cached_prefix(convo + [1]) == 192
    # other traffic fills the pool (1024 tokens): the conversation's pages are evicted
    for k in range(4):
        warm.generate([ids[250 + 60 * k: 250 + 60 * k + 240]], {"temperature": 0, "max_new_tokens": 1})
    assert warm.engine.cache.cached_prefix(convo + [1]) < 192
    prompt = convo + ids[500:520]
    out = warm.generate([prompt], GREEDY)[0]
    assert out.cached_tokens < 192
    same(out, cold.generate([prompt], GREEDY)[0])
    cached, evictable = warm.allocator.cache_pages()
    assert cached == evictable and warm.allocator.num_free() + evictable == warm.allocator.total_pages


def test_concurrent_requests_sharing_a_prefix_match_cold_runs(cold, warm):
    ids = cold.encode(TEXT * 3)
    system = ids[:80]
    warm.generate([system + ids[90:95]], {"temperature": 0, "max_new_tokens": 1})
    prompts = [system + ids[100 + 7 * k: 100 + 7 * k + 5 + k] for k in range(6)]
    outs = warm.generate(prompts, GREEDY)
    assert all(o.cached_tokens == 80 for o in outs)
    for o, e in zip(outs, cold.generate(prompts, GREEDY)):
        same(o, e)
