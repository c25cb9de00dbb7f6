"""The CPU few-row kernel (`engines._cpu_gemv`, `engines.model.cpu_gemv`) against the definitions in float64:
every implementation this CPU has (portable C, AVX2, AVX-512), float32 and bfloat16, sizes that are whole
vector registers and ones that are not.

`linear`: 0 to 9 rows, with and without a bias; `float_linear` takes it for a bfloat16 decode step's
few rows only. `experts`: per token and pick, experts with one to nine rows (more than one pass of four
rows, more than one tile of weight rows) and experts with none; `experts_forward` takes it for
decode-sized CPU batches only. Both: a row's output does not depend on the rows beside it nor on the
thread count; bad input is an error, not a read past the weights."""

from __future__ import annotations

import pytest
import torch

from engines.model import cpu_gemv, moe
from tests.engines.moe_reference import experts_definition as _definition
from engines.model.layers import FloatLinear, float_linear

pytestmark = pytest.mark.skipif(cpu_gemv._ext is None, reason="engines._cpu_gemv is not built")
ISAS = range(cpu_gemv.kernel_isa() + 1) if cpu_gemv._ext is not None else []
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


def _case(tokens, hidden, width, experts, top_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, width, generator=gen) / width ** 0.5).to(dtype)
    weights, ids = moe.route(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, weights.to(dtype), ids, gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden,width", [(64, 32), (40, 24), (36, 13)], ids=["whole-512", "whole-256", "ragged"])
def test_every_implementation_computes_the_definition(dtype, hidden, width):
    # expert e < 9 gets e + 1 rows, expert 9 one, experts 10 and 11 none: the sorted picks, paired
    # half against half (no expert has 23 picks, so a token's two are distinct)
    picks = [e for e in range(9) for _ in range(e + 1)] + [9]
    ids = torch.tensor([[picks[i], picks[i + 23]] for i in range(23)])
    assert torch.bincount(ids.flatten(), minlength=12).tolist() == list(range(1, 10)) + [1, 0, 0]
    gen = torch.Generator().manual_seed(3)
    x, _, _, gate_up, down = _case(ids.shape[0], hidden, width, 12, 2, dtype)
    weights = torch.softmax(torch.randn(ids.shape, generator=gen), -1).to(dtype)
    want = _definition(x, weights, ids, gate_up, down)
    for isa in ISAS:
        got = cpu_gemv.experts(x, weights, ids, gate_up, down, isa=isa)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m: f"isa {isa}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_token_gets_the_same_output_alone_batched_and_on_any_thread_count(dtype):
    x, weights, ids, gate_up, down = _case(24, 64, 48, 16, 4, dtype, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.experts(x, weights, ids, gate_up, down)
        torch.set_num_threads(2)
        two = cpu_gemv.experts(x, weights, ids, gate_up, down)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for t in (0, 7, 23):
        alone = cpu_gemv.experts(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], one[t])


def test_bad_input_is_an_error_and_no_batch_is_nothing():
    x, weights, ids, gate_up, down = _case(3, 32, 16, 4, 2, torch.float32)
    for bad in (4, -1):
        wrong = ids.clone()
        wrong[1, 1] = bad
        with pytest.raises(ValueError, match="names expert"):
            cpu_gemv.experts(x, weights, wrong, gate_up, down)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_gemv.experts(x[:, :16], weights, ids, gate_up, down)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_gemv.experts(x, weights, ids, gate_up.to(torch.bfloat16), down)
    with pytest.raises(ValueError, match="instructions"):
        cpu_gemv.experts(x, weights, ids, gate_up, down, isa=cpu_gemv._ext.best_isa() + 1)
    assert cpu_gemv.experts(x[:0], weights[:0], ids[:0], gate_up, down).shape == (0, 32)


@pytest.mark.skipif(cpu_gemv._ext is not None and cpu_gemv.kernel_isa() == 0, reason="no vector kernel on this CPU")
def test_decode_sized_cpu_batches_take_the_kernel(monkeypatch):
    monkeypatch.setattr(moe, "KERNEL_EXPERT_ROWS", 0)  # the grouped path's own calls: the next test
    calls, limit = [], moe.CPU_KERNEL_TOKENS
    real = cpu_gemv.experts
    monkeypatch.setattr(cpu_gemv, "experts", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for tokens in (1, limit, limit + 1):
        x, weights, ids, gate_up, down = _case(tokens, 32, 16, 8, 2, torch.float32)
        torch.testing.assert_close(moe.experts_forward(x, weights, ids, gate_up, down),
                                   moe.grouped_experts(x, weights, ids, gate_up, down), atol=1e-5, rtol=1e-5)
    assert calls == [1, limit]  # a prefill-sized batch stays on the grouped GEMMs
    monkeypatch.setattr(moe, "CPU_KERNEL_TOKENS", 0)  # off
    moe.experts_forward(*_case(1, 32, 16, 8, 2, torch.float32))
    assert calls == [1, limit]
    # float16 is not the kernel's: the grouped path serves it
    x, weights, ids, gate_up, down = (t.to(torch.float16) if t.is_floating_point() else t
                                      for t in _case(2, 32, 16, 8, 2, torch.float32))
    assert not cpu_gemv.available(x, gate_up, down)


@pytest.mark.skipif(cpu_gemv._ext is not None and cpu_gemv.kernel_isa() == 0, reason="no vector kernel on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_large_batchs_few_row_experts_take_the_kernel_and_the_others_gemms(dtype, monkeypatch):
    """A prefill-sized batch stays on the grouped path, whose experts of at most `KERNEL_EXPERT_ROWS`
    rows go to the kernel in one call (each row a token of one pick); the output is the definition's,
    and the same with the kernel's share off."""
    rows_per_expert = [1, 2, 3, 4, 5, 9, 20, 0]  # some at the limit, some past it, one idle
    picks = [e for e, n in enumerate(rows_per_expert) for _ in range(n)]
    half = len(picks) // 2  # 22 tokens of two picks: sorted picks paired half against half (no expert has more)
    ids = torch.tensor([[picks[i], picks[i + half]] for i in range(half)])
    assert all(a != b for a, b in ids.tolist())
    assert torch.bincount(ids.flatten(), minlength=8).tolist() == rows_per_expert
    x, _, _, gate_up, down = _case(half, 48, 24, 8, 2, dtype, seed=7)
    weights = torch.softmax(torch.randn(ids.shape, generator=torch.Generator().manual_seed(8)), -1).to(dtype)
    monkeypatch.setattr(moe, "CPU_KERNEL_TOKENS", half - 1)  # so the batch takes the grouped path
    calls, real = [], cpu_gemv.experts
    monkeypatch.setattr(cpu_gemv, "experts", lambda *a, **k: calls.append(a[2].flatten().tolist()) or real(*a, **k))
    want = _definition(x, weights, ids, gate_up, down)
    got = moe.experts_forward(x, weights, ids, gate_up, down)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    assert calls == [[e for e, n in enumerate(rows_per_expert) for _ in range(n) if n <= moe.KERNEL_EXPERT_ROWS]]
    monkeypatch.setattr(moe, "KERNEL_EXPERT_ROWS", 0)
    calls.clear()
    torch.testing.assert_close(moe.experts_forward(x, weights, ids, gate_up, down).double(), want, **TOL[dtype])
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(64, 130), (40, 70), (37, 9)], ids=["whole-512", "whole-256", "ragged"])
def test_linear_computes_the_definition_on_every_implementation(dtype, k, n):
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    for rows in (0, 1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias):
            want = x.double() @ weight.double().T + (0 if b is None else b.double())
            for isa in ISAS:
                got = cpu_gemv.linear(x, weight, b, isa=isa)
                assert got.dtype == dtype and got.shape == (rows, n)
                torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m: f"isa {isa}: {m}")
    # leading dimensions kept: [2, 3, K] -> [2, 3, N]
    x = torch.randn(2, 3, k, generator=gen).to(dtype)
    torch.testing.assert_close(cpu_gemv.linear(x, weight).double(), x.double() @ weight.double().T, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_of_linear_is_the_same_alone_batched_and_on_any_thread_count(dtype):
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(300, 128, generator=gen).to(dtype)
    x = torch.randn(11, 128, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.linear(x, weight)
        torch.set_num_threads(2)
        two = cpu_gemv.linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for t in (0, 5, 10):
        assert torch.equal(cpu_gemv.linear(x[t:t + 1], weight)[0], one[t])


def test_linear_refuses_what_does_not_fit():
    weight = torch.randn(8, 16)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_gemv.linear(torch.randn(2, 15), weight)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_gemv.linear(torch.randn(2, 16), weight, torch.randn(7))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_gemv.linear(torch.randn(2, 16, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="instructions"):
        cpu_gemv.linear(torch.randn(2, 16), weight, isa=cpu_gemv._ext.best_isa() + 1)


@pytest.mark.skipif(cpu_gemv._ext is not None and cpu_gemv.kernel_isa() == 0, reason="no vector kernel on this CPU")
def test_float_linear_takes_the_kernel_for_a_bf16_decode_steps_rows_only(monkeypatch):
    calls = []
    real = cpu_gemv.linear
    monkeypatch.setattr(cpu_gemv, "linear", lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    layer = FloatLinear(64, 32, bias=True).to(torch.bfloat16)
    limit = cpu_gemv.LINEAR_ROWS
    for shape in ((1, 64), (limit, 64), (limit + 1, 64), (1, 1, 64)):
        x = torch.randn(shape).to(torch.bfloat16)
        torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, layer.weight, layer.bias).float(),
                                   atol=3e-2, rtol=2e-2)
    assert calls == [(1, 64), (limit, 64), (1, 1, 64)]  # more rows stay on torch's GEMM
    float_linear(torch.randn(2, 64), torch.randn(32, 64))  # float32: torch's GEMM
    assert len(calls) == 3
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}


def test_float_linear_takes_the_weights_first_form_for_a_few_more_bf16_rows(monkeypatch):
    """On a CPU with AMX (said to be one here, whatever this one is), bfloat16 batches of more rows than
    the kernel takes and at most `layers.WEIGHTS_FIRST_ROWS` are multiplied as (W @ x^T)^T: contiguous
    rows, bias added before the one rounding, results the definition's within bfloat16 rounding, as
    F.linear's are. More rows, float32, or a CPU without AMX take F.linear."""
    from engines.model import layers

    monkeypatch.setattr(layers, "cpu_has_amx", lambda: True)
    calls = []
    real = layers._weights_first
    monkeypatch.setattr(layers, "_weights_first", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    first = cpu_gemv.LINEAR_ROWS + 1 if cpu_gemv.linear_available(torch.ones(1, 64, dtype=torch.bfloat16), weight) else 1
    for shape in ((first, 64), (layers.WEIGHTS_FIRST_ROWS, 64), (2, layers.WEIGHTS_FIRST_ROWS // 2, 64)):
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        for b in (bias, None):
            got = layers.float_linear(x, weight, b)
            want = x.double() @ weight.double().T + (0 if b is None else b.double())
            assert got.shape == (*shape[:-1], 48) and got.is_contiguous() and got.dtype == torch.bfloat16
            err, ref = (got.double() - want).abs().max(), (torch.nn.functional.linear(x, weight, b).double() - want).abs().max()
            assert err <= 2 * ref + 1e-6, (shape, err, ref)  # one rounding of the same sums, like F.linear's
    assert calls == [(first, 64)] * 2 + [(layers.WEIGHTS_FIRST_ROWS, 64)] * 2 + [(2, layers.WEIGHTS_FIRST_ROWS // 2, 64)] * 2
    calls.clear()
    layers.float_linear(torch.randn(layers.WEIGHTS_FIRST_ROWS + 1, 64).to(torch.bfloat16), weight)
    layers.float_linear(torch.randn(first, 64), weight.float())
    monkeypatch.setattr(layers, "cpu_has_amx", lambda: False)
    layers.float_linear(torch.randn(first, 64).to(torch.bfloat16), weight)
    assert calls == []
