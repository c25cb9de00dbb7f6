"""What the simulator added to the estimator: prefill chunks attending to a cached prefix (the
chunked baseline's KV reloads), the hybrid-step fast path, and the analytic co-run model."""

from __future__ import annotations

import pytest

from bullet.sim.config import SimConfig, device_estimator
from engines.model_config import ModelConfig
from estimator import Estimator, ExecutionState, HardwareSpec
from estimator.analytic_contention import AnalyticContention
from estimator.ops import chunk_attention_pairs, chunked_prefill_attention, layer_ops, prefill_attention

MODEL = ModelConfig.builtin("llama-3.1-8b")


@pytest.fixture(scope="module")
def est():
    return device_estimator(SimConfig())


def test_chunks_attend_to_their_prefix():
    assert chunk_attention_pairs([3], [0]) == 6  # causal triangle 1+2+3
    assert chunk_attention_pairs([2], [5]) == 2 * 5 + 3
    # chunking a prompt does not change the total attention work, only splits it
    whole = prefill_attention(MODEL, [1000])
    parts = [chunked_prefill_attention(MODEL, [250], [p]) for p in range(0, 1000, 250)]
    assert sum(op.flops for op in parts) == pytest.approx(whole.flops)
    # but every chunk reads the cached prefix back
    assert sum(op.bytes for op in parts) > whole.bytes
    assert chunked_prefill_attention(MODEL, [1000], [0]) == whole


def test_prefix_changes_the_layer_inventory():
    plain = {op.name: op for op in layer_ops(MODEL, ExecutionState(prefill_lens=(512,)))}
    chunk = {op.name: op for op in layer_ops(MODEL, ExecutionState(prefill_lens=(512,), prefill_prefix_lens=(1024,)))}
    assert chunk["attn_prefill"].flops > plain["attn_prefill"].flops
    assert chunk["qkv_proj"] == plain["qkv_proj"]
    with pytest.raises(ValueError):
        ExecutionState(prefill_lens=(1, 2), prefill_prefix_lens=(3,))


def test_hybrid_step_fast_path_equals_the_reference_model():
    """Without phase calibration, hybrid_step_time is step_time (kernel by kernel) exactly."""
    bare = Estimator(MODEL, HardwareSpec.builtin("a100"))
    for chunks, decode in [([(700, 0)], []), ([(256, 1024), (40, 0)], [900] * 30), ([], [2000] * 64)]:
        state = ExecutionState(prefill_lens=tuple(c for c, _ in chunks), decode_ctx_lens=tuple(decode),
                               prefill_prefix_lens=tuple(p for _, p in chunks))
        fast = bare.hybrid_step_time(chunks, len(decode), sum(decode), 54)
        assert fast == pytest.approx(bare.step_time(state, 54), rel=1e-9)


def test_hybrid_steps_match_the_two_worker_phases(est):
    assert est.hybrid_step_time([], 64, 64 * 1500) == pytest.approx(est.decode_time(64, 64 * 1500, 108))
    assert est.hybrid_step_time([(3000, 0)], 0, 0) == pytest.approx(est.prefill_time([3000], 108))
    # a chunk carried by a decode batch costs more than the decodes alone, less than both apart
    mixed = est.hybrid_step_time([(512, 2048)], 64, 64 * 1500)
    assert est.decode_time(64, 64 * 1500, 108) < mixed
    assert mixed < est.decode_time(64, 64 * 1500, 108) + est.hybrid_step_time([(512, 2048)], 0, 0)


def test_one_hbm_two_memory_bound_phases_slow_each_other(est):
    c = AnalyticContention(est, floor=1.0, prefill_slowdown=0.0)  # only the bandwidth effect
    peak = est.hardware.peak_bandwidth
    assert c.bandwidth_slowdowns(0.3 * peak, 54, 0.6 * peak, 54) == (1.0, 1.0)
    slow_p, slow_d = c.bandwidth_slowdowns(peak, 54, peak, 54)
    assert slow_p == pytest.approx(2.0) and slow_d == pytest.approx(2.0)
    # a light prefill keeps what it needs; decode gets the rest
    slow_p, slow_d = c.bandwidth_slowdowns(0.1 * peak, 88, peak, 20)
    assert slow_p == 1.0 and slow_d == pytest.approx(1 / 0.9)


def test_interference_grows_with_the_prefill_and_is_off_at_floor_one(est):
    c = AnalyticContention(est)
    fractions = [c.pressure_fraction(sl, 88) for sl in (16, 64, 256, 4096)]
    assert fractions == sorted(fractions, reverse=True) and fractions[-1] < 1.0
    assert c.pressure_fraction(4096, 108) == pytest.approx(c.floor)
    assert AnalyticContention(est, floor=1.0).pressure_fraction(4096, 108) == 1.0
    with pytest.raises(ValueError):
        AnalyticContention(est, floor=0.0)


def test_contention_table_reaches_the_policy_estimator(est):
    table = AnalyticContention(est).contention_table([20, 54])
    aware = Estimator(est.model, est.hardware, est.calibration.model_copy(deep=True), table, est.dtype)
    assert aware.decode_time(64, 64000, 20, co_prefill_tokens=2048) > est.decode_time(64, 64000, 20)
    assert aware.prefill_time([2048], 88, co_decode_batch=64) > est.prefill_time([2048], 88)
