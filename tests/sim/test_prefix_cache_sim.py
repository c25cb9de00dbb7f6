"""The simulator models the prefix cache through the runtime's own code path (the same loop cores,
the same `PrefixCache`): on SGLang's shared-prefix workload the cache serves the system prompts,
TTFT drops, every page comes back, and the estimator charges a cached prefix's attention."""

from __future__ import annotations

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.config import device_estimator
from bullet.workloads.shared_prefix import generated_shared_prefix


def run(policy: str, cache: bool, requests, **overrides):
    sim = Simulation(SimConfig(policy=policy, radix_cache=cache, ttft_slo="1.5ms/token", tpot_slo="200ms",
                               **overrides), requests)
    return sim, sim.run()


@pytest.mark.parametrize("policy", ["bullet", "chunked:1024"])
def test_shared_system_prompts_hit_the_cache_and_cut_ttft(policy):
    requests = generated_shared_prefix(num_groups=4, prompts_per_group=12, system_prompt_len=1500,
                                       question_len=100, output_len=40, rate=8.0, seed=2)
    sim_off, off = run(policy, False, requests)
    sim_on, on = run(policy, True, requests)
    assert len(on.records) == len(off.records) == len(requests) and all(r.ok for r in on.records)
    assert "cache_hit_tokens" not in off.counters
    # at most every prompt but the first of each group finds its system prompt (whole pages of it)
    hits = on.counters["cache_hit_tokens"]
    assert 0.5 * (len(requests) - 4) * 1488 <= hits <= (len(requests) - 4) * 1500
    assert on.summary["mean_ttft_s"] < 0.7 * off.summary["mean_ttft_s"]
    alloc = sim_on.allocator
    cached, evictable = alloc.cache_pages()
    assert cached == evictable > 0 and alloc.num_free() + evictable == alloc.total_pages


@pytest.mark.parametrize("policy", ["bullet", "chunked:1024"])
def test_cache_under_memory_pressure_evicts_and_finishes_everything(policy):
    # six system prompts of 2000 tokens, a pool of about 7000: waiting requests' pinned prefixes alone
    # would fill it (they let go when nothing else can run)
    requests = generated_shared_prefix(num_groups=6, prompts_per_group=8, system_prompt_len=2000,
                                       question_len=200, output_len=300, rate=20.0, seed=3)
    sim, result = run(policy, True, requests, kv_memory_gb=0.9)
    assert len(result.records) == len(requests) and all(r.ok for r in result.records)
    assert result.counters["cache_evicted_pages"] > 0
    cached, evictable = sim.allocator.cache_pages()
    assert cached == evictable and sim.allocator.num_free() + evictable == sim.allocator.total_pages


def test_the_estimator_charges_new_tokens_plus_their_attention_to_the_prefix():
    est = device_estimator(SimConfig())
    cold = est.prefill_time([2100], 108)
    suffix = est.prefill_time([100], 108)
    warm = est.prefill_time([100], 108, cached=[2000])
    assert suffix < warm < 0.3 * cold


@pytest.mark.parametrize("policy", ["bullet", "chunked:256"])
def test_multi_turn_conversations_reuse_their_history(policy):
    from bullet.sim.conversations import ConversationSimulation
    from bullet.workloads.multiturn import synthetic_conversations

    convs = synthetic_conversations(12, rate=2.0, turns=4, user_tokens=300, answer_tokens=60, seed=1)
    results = {}
    for cache in (False, True):
        sim = ConversationSimulation(SimConfig(policy=policy, radix_cache=cache, ttft_slo="1.5ms/token",
                                               tpot_slo="200ms"), convs, think_s=0.5)
        results[cache] = sim.run()
        records = results[cache].records
        assert len(records) == 48 and all(r.ok for r in records)
        for c in range(12):  # each turn arrives after the previous one finished, and is longer
            turns = sorted((r for r in records if sim._turn[int(r.rid[1:])][0] == c), key=lambda r: r.arrival)
            assert [t.input_len for t in turns] == [300, 660, 1020, 1380]
            assert all(b.arrival >= a.finish_time + 0.5 - 1e-9 for a, b in zip(turns, turns[1:]))
    on = results[True]
    # every later turn finds its history's full pages (all but the last answer token's page)
    assert on.counters["cache_hit_tokens"] >= 36 * 300
    assert on.summary["mean_ttft_s"] < results[False].summary["mean_ttft_s"]
