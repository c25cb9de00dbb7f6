"""The op inventory: FLOPs, bytes and grids of one layer follow from the model's shapes."""

from __future__ import annotations

import pytest

from estimator.ops import ExecutionState, decode_attention, head_ops, layer_ops, prefill_attention
from estimator.tiling import FixedTiling, HeuristicTiling


def by_name(ops):
    return {op.name: op for op in ops}


@pytest.mark.parametrize("model", ["llama3_8b", "llama2"])
def test_gemms_do_two_flops_per_weight_per_token_and_read_weights_once(model, request):
    cfg = request.getfixturevalue(model)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    gemm_params = h * (q + 2 * kv) + q * h + 3 * h * i
    linear = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    at = lambda tokens: by_name(layer_ops(cfg, ExecutionState(prefill_lens=(tokens,))))
    assert sum(at(777)[n].flops for n in linear) == 2 * 777 * gemm_params
    # bytes are affine in tokens; the constant part is the weights, 2 bytes each in bf16
    weights = sum(2 * at(1)[n].bytes - at(2)[n].bytes for n in linear)
    assert weights == 2 * gemm_params


def test_llama2_shapes(llama2):
    assert (llama2.hidden_size, llama2.intermediate_size, llama2.num_key_value_heads, llama2.vocab_size) == (
        4096, 11008, 32, 32000)
    ops = by_name(layer_ops(llama2, ExecutionState(prefill_lens=(10,))))
    assert ops["qkv_proj"].flops == 2 * 10 * 4096 * 3 * 4096
    assert ops["gate_up_proj"].flops == 2 * 10 * 4096 * 2 * 11008


def test_layer_order_and_attention_kinds(llama3_8b):
    hybrid = ExecutionState(prefill_lens=(100, 50), decode_ctx_lens=(300, 400, 500))
    names = [op.name for op in layer_ops(llama3_8b, hybrid)]
    assert names == ["input_norm", "qkv_proj", "rope", "attn_prefill", "attn_decode", "o_proj",
                     "post_attn_norm", "gate_up_proj", "act", "down_proj", "residual_add"]
    assert hybrid.tokens == 153
    ops = by_name(layer_ops(llama3_8b, hybrid))
    assert ops["qkv_proj"].size == 153 and ops["residual_add"].count == 2
    head = by_name(head_ops(llama3_8b, hybrid))
    assert head["lm_head"].size == 5  # last token of each prefill + each decode request
    assert head["lm_head"].flops == 2 * 5 * 4096 * 128256


def test_prefill_attention_is_causal_and_sums_over_sequences(llama3_8b):
    h, d = llama3_8b.num_attention_heads, llama3_8b.head_dim
    one = prefill_attention(llama3_8b, [1024])
    assert one.flops == 2 * h * d * 1024 * 1025  # QK^T and PV over the lower triangle
    two = prefill_attention(llama3_8b, [1024, 1024])
    assert two.flops == 2 * one.flops and two.grid == 2 * one.grid
    assert one.grid == h * 8  # 128-query tiles x heads
    assert prefill_attention(llama3_8b, [2048]).flops > two.flops  # quadratic, not linear


def test_decode_attention_reads_the_kv_cache(llama3_8b):
    op = decode_attention(llama3_8b, batch=64, sum_ctx=64 * 4000)
    kv_bytes = 64 * 4000 * 2 * llama3_8b.kv_size * 2
    assert kv_bytes < op.bytes < 1.01 * kv_bytes
    assert op.flops == 4 * llama3_8b.num_attention_heads * llama3_8b.head_dim * 64 * 4000
    assert op.grid >= 64 * llama3_8b.num_key_value_heads


def test_dtype_bytes_scale_traffic(llama3_8b):
    state = ExecutionState(decode_ctx_lens=(1000,) * 8)
    bf16 = by_name(layer_ops(llama3_8b, state, dtype_bytes=2))
    fp32 = by_name(layer_ops(llama3_8b, state, dtype_bytes=4))
    for name in bf16:
        assert fp32[name].bytes == pytest.approx(2 * bf16[name].bytes)
        assert fp32[name].flops == bf16[name].flops


def test_heuristic_tiling_prefers_small_tiles_for_short_inputs():
    tiling = HeuristicTiling(device_units=108)
    assert tiling.gemm_tile(64, 4096)[0] == 64  # 128-row tiles would leave half of each tile empty
    assert tiling.gemm_tile(16384, 6144) in {(128, 256), (256, 128), (128, 128), (64, 128), (64, 64)}
    assert FixedTiling().gemm_tile(64, 4096) == (128, 256)
