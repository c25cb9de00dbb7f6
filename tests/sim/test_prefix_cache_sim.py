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


def test_cache_under_memory_pressure_evicts_and_finishes_everything():
    requests = generated_shared_prefix(num_groups=6, prompts_per_group=8, system_prompt_len=2000,
                                       question_len=200, output_len=300, rate=20.0, seed=3)
    sim, result = run("bullet", True, requests, kv_memory_gb=0.9)  # about 7000 tokens of KV
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
