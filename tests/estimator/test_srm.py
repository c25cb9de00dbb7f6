"""SM-scaling roofline (Eq. 1): compute scales with units, bandwidth saturates at N_d, waves stretch compute."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.ops import ExecutionState, Op, head_ops, layer_ops
from estimator.srm import compute_time, is_compute_bound, memory_time, srm_time
from estimator.tiling import HeuristicTiling


def no_overhead(hw):
    return hw.model_copy(update={"kernel_overhead_s": 0.0})


def test_bandwidth_saturates_at_the_inflection(a100):
    assert a100.bandwidth_inflection == 30
    assert a100.bandwidth(15) == pytest.approx(a100.peak_bandwidth / 2)
    assert a100.bandwidth(30) == a100.bandwidth(54) == a100.bandwidth(108) == a100.peak_bandwidth


def test_memory_bound_kernel_stops_speeding_up_past_n_d(a100):
    hw = no_overhead(a100)
    copy = Op("residual_add", flops=1e6, bytes=1e9, grid=0, size=1)
    assert not is_compute_bound(copy, 108, hw)
    assert srm_time(copy, 30, hw) == srm_time(copy, 54, hw) == srm_time(copy, 108, hw)
    assert srm_time(copy, 15, hw) == pytest.approx(2 * srm_time(copy, 30, hw))


def test_compute_bound_kernel_scales_linearly_with_units(a100):
    hw = no_overhead(a100)
    # a grid that divides evenly on both unit counts: no wave effect
    gemm = Op("gate_up_proj", flops=1e13, bytes=1e8, grid=108 * 54 * 4, size=8192)
    assert is_compute_bound(gemm, 54, hw)
    assert srm_time(gemm, 54, hw) == pytest.approx(2 * srm_time(gemm, 108, hw))
    assert srm_time(gemm, 108, hw) == pytest.approx(1e13 / 312e12)


def test_wave_quantization_stretches_compute_only(a100):
    hw = no_overhead(a100)
    gemm = Op("o_proj", flops=1e12, bytes=1e6, grid=128, size=1024)  # 2 waves, 20 SMs in the last
    assert compute_time(gemm, 108, hw) == pytest.approx(1e12 / 312e12 * 216 / 128)
    wide = Op("o_proj", flops=1e6, bytes=1e10, grid=128, size=1024)
    assert memory_time(wide, 108, hw) == srm_time(wide, 108, hw)  # bandwidth is not quantized


def test_prefill_is_compute_bound_and_decode_memory_bound(llama3_8b, a100):
    tiling = HeuristicTiling(108)
    prefill = {op.name: op for op in layer_ops(llama3_8b, ExecutionState(prefill_lens=(4096,)), tiling=tiling)}
    decode = {op.name: op for op in layer_ops(llama3_8b, ExecutionState(decode_ctx_lens=(2000,) * 8), tiling=tiling)}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attn_prefill"):
        assert is_compute_bound(prefill[name], 108, a100)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attn_decode", "input_norm", "act"):
        assert not is_compute_bound(decode[name], 108, a100)


def test_kernel_overhead_is_paid_per_launch(a100):
    tiny = Op("residual_add", flops=0.0, bytes=8.0, grid=0, size=1, count=2)
    assert srm_time(tiny, 108, a100) == pytest.approx(2 * (a100.kernel_overhead_s + 8 / a100.peak_bandwidth))


@given(tokens=st.integers(1, 20_000), decode=st.booleans())
def test_every_kernel_is_monotone_in_units(llama3_8b, a100, tokens, decode):
    state = ExecutionState(decode_ctx_lens=(512,) * tokens) if decode else ExecutionState(prefill_lens=(tokens,))
    tiling = HeuristicTiling(108)
    for op in layer_ops(llama3_8b, state, tiling=tiling) + head_ops(llama3_8b, state, tiling=tiling):
        times = [srm_time(op, units, a100) for units in a100.partition_sizes()]
        assert all(a >= b * (1 - 1e-12) for a, b in zip(times, times[1:])), op.name  # equal up to rounding


def test_units_out_of_range_are_refused(a100):
    op = Op("act", 1.0, 1.0, 0, 1)
    with pytest.raises(ValueError):
        srm_time(op, 0, a100)
    with pytest.raises(ValueError):
        srm_time(op, 109, a100)
