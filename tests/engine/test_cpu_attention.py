"""The CPU decode-attention kernel that reads the paged KV pool in place (engines._cpu_attention):
every implementation this CPU runs agrees with the torch reference on ragged contexts and every
pool dtype, a row's output does not depend on the batch, bad tables are refused, and the runner
uses it for the int8 model only (the fp32 reference keeps the gather path)."""

from __future__ import annotations

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model import cpu_attention as ca
from engines.model.paged_attention import TorchPagedKernels, build_tables
from engines.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(ca._ext is None, reason="engines._cpu_attention is not built")

KVH, HEADS, D, PS, PAGES = 3, 9, 64, 16, 160
CONTEXTS = [1, 15, 16, 17, 95, 300, 523]


def _pool(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(KVH, PAGES * PS, D, generator=g) * 2).to(dtype)
    v = torch.randn(KVH, PAGES * PS, D, generator=g).to(dtype)
    perm = torch.randperm(PAGES, generator=g).tolist()
    tables, used = [], 0
    for n in CONTEXTS:
        m = -(-n // PS)
        tables.append(perm[used : used + m])
        used += m
    return k, v, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_implementation_matches_the_reference(dtype):
    k, v, tables = _pool(dtype)
    b = len(CONTEXTS)
    # q is a view with rows further apart than H x D, as the layer's fused QKV output gives it
    qkv = torch.randn(b + 2, HEADS + 2 * KVH, D, generator=torch.Generator().manual_seed(1))
    q = qkv[:, :HEADS]
    rows = [i + 1 for i in range(b)]  # rows 0 and b + 1 are not decode rows
    ref = TorchPagedKernels().decode(q[1 : b + 1].contiguous(), k, v, build_tables(tables, CONTEXTS, [1] * b, PS, "cpu"),
                                     0.125)
    plan = ca.plan_in_place(rows, CONTEXTS, tables, PS, b + 2, PAGES)
    for isa in range(ca.kernel_isa() + 1):
        out = torch.full((b + 2, HEADS, D), 7.0)
        ca.decode_in_place(q, k, v, plan, 0.125, out, isa=isa)
        torch.testing.assert_close(out[1 : b + 1], ref, atol=2e-5, rtol=1e-4, msg=f"implementation {isa}")
        assert (out[0] == 7).all() and (out[b + 1] == 7).all()  # rows outside the plan are left alone


def test_a_row_is_bit_identical_alone_and_batched():
    k, v, tables = _pool(torch.float32)
    b = len(CONTEXTS)
    q = torch.randn(b, HEADS, D, generator=torch.Generator().manual_seed(2))
    batched = ca.decode_in_place(q, k, v, ca.plan_in_place(list(range(b)), CONTEXTS, tables, PS, b, PAGES), 0.1)
    for i in range(b):
        alone = ca.decode_in_place(q[i : i + 1], k, v, ca.plan_in_place([0], [CONTEXTS[i]], [tables[i]], PS, 1, PAGES), 0.1)
        assert torch.equal(alone[0], batched[i])


def test_bad_tables_are_refused_before_the_kernel_runs():
    _, _, tables = _pool(torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        ca.plan_in_place([0], [20], [[PAGES, 1]], PS, 1, PAGES)  # a page past the pool
    with pytest.raises(ValueError, match="out of range"):
        ca.plan_in_place([3], [20], [tables[3]], PS, 2, PAGES)  # a row past the batch
    with pytest.raises(ValueError, match="cover fewer"):
        ca.plan_in_place([0], [40], [[1, 2]], PS, 1, PAGES)
    k, v, _ = _pool(torch.float32)
    plan = ca.plan_in_place([0], [20], [[1, 2]], PS, 1, PAGES)
    with pytest.raises(ValueError, match="another batch"):
        ca.decode_in_place(torch.zeros(2, HEADS, D), k, v, plan, 0.1)
    with pytest.raises(ValueError, match="float32"):
        ca.decode_in_place(torch.zeros(1, HEADS, D, dtype=torch.bfloat16), k, v, plan, 0.1)


def test_the_int8_model_decodes_through_the_kernel_and_float_models_keep_the_gather(llm32, monkeypatch):
    """A small random Llama (head dim 64, GQA 3:1, a 64-wide down_proj block), quantized as the server
    quantizes the GGUF: its decode logits through the kernel equal the gather path's."""
    from engines.model.build import build_model
    from engines.model_config import ModelConfig
    from engines.quant import quantize_state
    from engines.weights.dummy import dummy_weights

    assert not llm32.runner.in_place_decode  # the fp32 reference: unchanged, bit for bit
    config = ModelConfig(name="small", hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, vocab_size=300,
                         max_position_embeddings=1024)
    model = build_model(config, quantize_state(config, dummy_weights(config, torch.float32, seed=3)))
    kv = KVPool(config, 64, PS, torch.float32)
    kernel = ModelRunner(model, kv)
    monkeypatch.setenv(ca.ENV, "gather")
    gather = ModelRunner(model, kv)
    assert kernel.in_place_decode and not gather.in_place_decode
    prompts = [[(7 * i) % 299 + 1 for i in range(50)], [(5 * i) % 299 + 1 for i in range(17)], [11]]
    tables = [list(range(0, 4)), list(range(4, 6)), [6]]
    kernel.forward([SeqChunk(p, 0, t, "none") for p, t in zip(prompts, tables)])
    step = [SeqChunk([42], len(p), t) for p, t in zip(prompts, tables)]
    reference = gather.forward(step).last_logits
    torch.testing.assert_close(kernel.forward(step).last_logits, reference, atol=1e-4, rtol=0)
    # --kv-cache-dtype float16: the same steps over a half-width pool, through the kernel and through the
    # gather path (float queries over a float16 pool)
    monkeypatch.delenv(ca.ENV)
    for quantized in (True, False):
        m = model if quantized else build_model(config, dummy_weights(config, torch.float32, seed=3))
        half = ModelRunner(m, KVPool(config, 64, PS, torch.float16))
        assert half.in_place_decode == quantized
        half.forward([SeqChunk(p, 0, t, "none") for p, t in zip(prompts, tables)])
        got = half.forward(step).last_logits
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        if quantized:
            torch.testing.assert_close(got, reference, atol=5e-2, rtol=0)


def test_kv_cache_dtype_names():
    from engines.device import resolve_kv_dtype

    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="fp8"):
        resolve_kv_dtype("fp8_e5m2", torch.float32)
