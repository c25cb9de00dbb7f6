"""The MoE experts on AMX tiles (`csrc/cpu_amx.c` through `engines.model.cpu_gemv.experts(tile_rows=...)`)
against the definition in float64: experts whose row counts fill none, part of, one and several 16-row
blocks (odd and even counts of blocks), mixed in one call with experts below `tile_rows` that take the
dot-product path; the same batch gives the same bits on every run; what the tiles cannot run is refused
on every CPU; and `experts_forward` sends a prefill-sized bfloat16 batch to the tiles, in slices when
its sums would pass `moe.TILE_CALL_BYTES`. The tests that run the tiles need a CPU with AMX (and a
compiler that knows its instructions): elsewhere they skip and say so."""

from __future__ import annotations

import pytest
import torch

from engines.model import cpu_gemv, moe
from tests.engines.moe_reference import experts_definition as _definition

pytestmark = pytest.mark.skipif(cpu_gemv._ext is None, reason="engines._cpu_gemv is not built")
TOL = {"atol": 1e-2, "rtol": 1e-2}  # bfloat16 output, float32 sums
HIDDEN, WIDTH = 96, 64  # whole multiples of 32: three and two 32-element steps


def _tiles_here() -> bool:
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    return cpu_gemv._ext is not None and cpu_gemv.tiles_available(
        x, torch.zeros(1, 2 * WIDTH, HIDDEN, dtype=torch.bfloat16), torch.zeros(1, HIDDEN, WIDTH, dtype=torch.bfloat16))


needs_tiles = pytest.mark.skipif(not _tiles_here(), reason="no AMX tiles here (the CPU lacks AMX-BF16, the build lacks "
                                                           "the instructions, or the kernel cap is below AVX-512)")


def _batch(rows_per_expert: list[int], seed: int = 0):
    """Tokens of two distinct picks whose experts get exactly `rows_per_expert` rows (no expert more than
    half of all picks: the sorted picks paired half against half)."""
    picks = [e for e, n in enumerate(rows_per_expert) for _ in range(n)]
    half = len(picks) // 2
    ids = torch.tensor([[picks[i], picks[i + half]] for i in range(half)])
    assert all(a != b for a, b in ids.tolist())
    assert torch.bincount(ids.flatten(), minlength=len(rows_per_expert)).tolist() == rows_per_expert
    gen = torch.Generator().manual_seed(seed)
    experts = len(rows_per_expert)
    x = torch.randn(half, HIDDEN, generator=gen).to(torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * WIDTH, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(torch.bfloat16)
    down = (torch.randn(experts, HIDDEN, WIDTH, generator=gen) / WIDTH ** 0.5).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(ids.shape, generator=gen), -1).to(torch.bfloat16)
    return x, weights, ids, gate_up, down


# one row; a block less one, a block, a block and one (pairs: one block, two, two); two blocks and one
# (a pair and a lone block); 100 rows (seven blocks, the last partial); an idle expert; 64 and 40 rows
ROWS = [1, 15, 16, 17, 33, 100, 2, 0, 64, 40]


@needs_tiles
@pytest.mark.parametrize("tile_rows", [1, 16], ids=["all-tiles", "mixed"])
def test_the_tiles_compute_the_definition(tile_rows):
    x, weights, ids, gate_up, down = _batch(ROWS)
    got = cpu_gemv.experts(x, weights, ids, gate_up, down, tile_rows=tile_rows)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.double(), _definition(x, weights, ids, gate_up, down), **TOL)
    # gate values far past the exponential's range (|g| ~ 100s): silu saturates to 0 and to g, no inf or NaN
    big = (x.float() * 60).to(torch.bfloat16)
    want = _definition(big, weights, ids, gate_up, down)
    got = cpu_gemv.experts(big, weights, ids, gate_up, down, tile_rows=tile_rows)
    assert bool(got.isfinite().all()) and float(want.abs().max()) > 1e3
    torch.testing.assert_close(got.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)


@needs_tiles
def test_the_same_batch_gives_the_same_bits_and_thread_counts_agree():
    x, weights, ids, gate_up, down = _batch(ROWS, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = [cpu_gemv.experts(x, weights, ids, gate_up, down, tile_rows=1) for _ in range(3)]
        torch.set_num_threads(1)
        one = cpu_gemv.experts(x, weights, ids, gate_up, down, tile_rows=1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two[0], two[1]) and torch.equal(two[0], two[2])
    # the threads' sums are added in another order: equal up to the last bit of the bfloat16 result
    torch.testing.assert_close(one, two[0], atol=1e-2, rtol=1e-2)


def test_what_the_tiles_cannot_run_is_refused_on_every_cpu():
    x, weights, ids, gate_up, down = _batch([2, 2, 0, 2])
    with pytest.raises(ValueError, match="AMX tiles need"):  # float32 is not the tiles'
        cpu_gemv.experts(x.float(), weights.float(), ids, gate_up.float(), down.float(), tile_rows=1)
    with pytest.raises(ValueError, match="AMX tiles need"):  # a hidden size that is not whole steps
        cpu_gemv.experts(x[:, :48], weights, ids, gate_up[:, :, :48].contiguous(), down[:, :48].contiguous(), tile_rows=1)
    if not _tiles_here():  # and nothing at all where there are no tiles
        with pytest.raises(ValueError, match="AMX tiles need"):
            cpu_gemv.experts(x, weights, ids, gate_up, down, tile_rows=1)
    assert not cpu_gemv.tiles_available(x.float(), gate_up.float(), down.float())


@needs_tiles
def test_a_prefill_sized_batch_takes_the_tiles_in_slices(monkeypatch):
    """More than `CPU_KERNEL_TOKENS` bfloat16 tokens go to the tiles, as many calls as TILE_CALL_BYTES
    allows; a decode-sized batch keeps the decode kernel (no tiles), and TILE_EXPERT_ROWS = 0 the grouped
    path. Every way gives the definition."""
    gen = torch.Generator().manual_seed(6)
    tokens, experts = moe.CPU_KERNEL_TOKENS + 7, 8
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * WIDTH, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(torch.bfloat16)
    down = (torch.randn(experts, HIDDEN, WIDTH, generator=gen) / WIDTH ** 0.5).to(torch.bfloat16)
    weights, ids = moe.route(torch.randn(tokens, experts, generator=gen), 2, True)
    want = _definition(x, weights, ids, gate_up, down)
    calls, real = [], cpu_gemv.experts
    monkeypatch.setattr(cpu_gemv, "experts", lambda *a, **k: calls.append((a[0].shape[0], k.get("tile_rows", 0)))
                        or real(*a, **k))
    torch.testing.assert_close(moe.experts_forward(x, weights, ids, gate_up, down).double(), want, **TOL)
    assert calls == [(tokens, moe.TILE_EXPERT_ROWS)]
    calls.clear()
    per_call = 20
    monkeypatch.setattr(moe, "TILE_CALL_BYTES", per_call * torch.get_num_threads() * HIDDEN * 4)
    torch.testing.assert_close(moe.experts_forward(x, weights, ids, gate_up, down).double(), want, **TOL)
    sizes = [per_call] * (tokens // per_call) + [tokens % per_call]
    assert calls == [(n, moe.TILE_EXPERT_ROWS) for n in sizes if n]
    calls.clear()
    torch.testing.assert_close(moe.experts_forward(x[:8], weights[:8], ids[:8], gate_up, down).double(), want[:8], **TOL)
    assert calls == [(8, 0)]  # decode: the decode kernel
    calls.clear()
    monkeypatch.setattr(moe, "TILE_EXPERT_ROWS", 0)
    torch.testing.assert_close(moe.experts_forward(x, weights, ids, gate_up, down).double(), want, **TOL)
    assert all(rows == 0 for _, rows in calls)  # the grouped path (its few-row experts in the decode kernel)


@needs_tiles
def test_a_bfloat16_moe_prefill_runs_its_experts_on_the_tiles(tmp_path, monkeypatch):
    """The tiny Qwen3-MoE (hidden 64, experts of width 32: whole steps) in bfloat16, one 150-token prompt
    through the engine's runner: every sparse layer's experts take the tiles, and each layer's output is
    the definition's on that layer's own inputs. (Whole-model logits are not compared with the grouped
    path's: bfloat16 rounding that differs by a unit flips a few tokens' top-2 picks in the second layer.)"""
    from engines.kv_pool import KVPool
    from engines.model.build import build_model
    from engines.runner import ModelRunner, SeqChunk
    from engines.weights.resolve import load_weights
    from tests.engines import tiny_checkpoints as tiny

    tiny.save("Qwen3MoeForCausalLM", tmp_path)
    loaded = load_weights(str(tmp_path), dtype=torch.bfloat16)
    runner = ModelRunner(build_model(loaded.config, loaded.state), KVPool(loaded.config, 16, 16, torch.bfloat16))
    prompt = torch.randint(0, tiny.VOCAB, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    calls, layers = [], []
    real_kernel, real_forward = cpu_gemv.experts, moe.experts_forward
    monkeypatch.setattr(cpu_gemv, "experts", lambda *a, **k: calls.append(k.get("tile_rows", 0)) or real_kernel(*a, **k))
    monkeypatch.setattr(moe, "experts_forward", lambda *a: layers.append((a, real_forward(*a))) or layers[-1][1])
    out = runner.forward([SeqChunk(prompt, 0, list(range(10)), logits="all")]).all_logits[0]
    assert out.shape == (150, tiny.VOCAB) and bool(out.isfinite().all())
    assert calls == [moe.TILE_EXPERT_ROWS] * len(loaded.config.moe_layers) == [1, 1]
    for inputs, got in layers:
        assert got.dtype == torch.bfloat16
        want = _definition(*inputs)
        # the activation is rounded to bfloat16 (2^-9 relative) before down sums it: the error scales
        # with the layer's largest outputs (here ~10), not with each element
        torch.testing.assert_close(got.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)
