"""The work bound: device-seconds a workload's requests need on the simulated A100, and the rates they allow."""

from __future__ import annotations

from artifact.work_bound import decode_cost_per_token, packed_prefill_seconds, work_bound
from bullet.sim import SimConfig
from bullet.sim.config import device_estimator


def test_packing_amortizes_prefill_and_decode_cost_falls_with_batch():
    est = device_estimator(SimConfig(policy="bullet"))
    prompts = [16] * 64
    alone = sum(est.prefill_time([p], est.hardware.units) for p in prompts)
    assert packed_prefill_seconds(est, prompts, 8192) < alone / 4  # tiny prompts: the weight reads dominate
    assert packed_prefill_seconds(est, prompts, 16) == sum(est.prefill_time([16], est.hardware.units) for _ in prompts)
    small_batch, small_cost = decode_cost_per_token(est, 500, 0.02, 10**6)
    big_batch, big_cost = decode_cost_per_token(est, 500, 0.15, 10**6)
    assert big_batch > small_batch and big_cost < small_cost
    capped, _ = decode_cost_per_token(est, 500, 0.15, 500 * 8)
    assert capped == 8  # the KV pool holds 8 such requests


def test_long_prompt_workload_is_bound_by_prefill_and_short_by_neither():
    arxiv, sharegpt = work_bound("arxiv", duration=60), work_bound("sharegpt", duration=60)
    for row in (arxiv, sharegpt):
        assert row["serial bound req/s"] < row["prefill bound req/s"]
    # arXiv: ~2.6k-token prompts leave a few req/s of prefill; ShareGPT's short prompts leave tens
    assert arxiv["prefill bound req/s"] < 10 < sharegpt["serial bound req/s"]
