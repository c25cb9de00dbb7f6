"""The block-scaled FP8 GEMM of 128 x 128 block checkpoints: its layouts against torch's own contract
(the meta registration of `F.scaled_mm`, which checks shapes and strides on a CPU), its arithmetic
against the dequantized product (in float64, the recipe's documented sum), and on a Hopper GPU the
real call against the dequantized one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines import kernel_fallbacks
from engines.quant import fp8, fp8_blockwise as bw


def block_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight, its e4m3 form in 128 x 128 blocks and the row scales `Fp8Linear` keeps."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    wq, rows = bw.quantize_blocks(w)
    blocks = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / fp8.FP8_MAX  # [nb, kb]
    assert torch.equal(rows, fp8.block_scales(blocks, (n, k), (128, 128)))  # a checkpoint's scales, per row
    return w, wq, rows


@pytest.mark.parametrize("m,k,n", [(1, 512, 384), (5, 384, 256), (64, 1024, 768)])
def test_the_layouts_are_the_ones_torch_checks(m, k, n):
    _, wq, rows = block_weight(n, k)
    b = bw.weight_scales(rows, n, k, 128)
    l4 = -(-(k // 128) // 4) * 4
    assert tuple(b.shape) == (l4, n // 128) and b.stride() == (1, l4)
    assert torch.equal(b[: k // 128], rows[::128].t())  # [kb, nb] = the scale of W's block (nb, kb)
    xq, a = bw.quantize_groups(torch.randn(m, k))
    assert tuple(a.shape) == (m, k // 128) and a.stride() == (1, m) and xq.dtype == fp8.FP8
    meta = lambda t: t.to("meta") if t.dim() < 2 or t.is_contiguous() else t.t().to("meta").t()  # noqa: E731
    y = F.scaled_mm(meta(xq), meta(wq).t(), meta(a), F.ScalingType.BlockWise1x128, meta(b),
                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    assert tuple(y.shape) == (m, n)
    if m == 1:
        return  # a one-row scale tensor has no other layout
    with pytest.raises(RuntimeError, match="stride"):  # the same scales laid out row-major are refused
        F.scaled_mm(meta(xq), meta(wq).t(), a.contiguous().to("meta"), F.ScalingType.BlockWise1x128, meta(b),
                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def test_the_recipes_sum_is_the_dequantized_product():
    w, wq, rows = block_weight(256, 384, seed=1)
    x = torch.randn(7, 384, generator=torch.Generator().manual_seed(2))
    xq, a = bw.quantize_groups(x)
    got = bw.reference_product(xq, a, wq, bw.weight_scales(rows, 256, 384, 128))
    x_back = (xq.double().view(7, 3, 128) * a.double().unsqueeze(-1)).view(7, 384)
    w_back = fp8.dequantize_rows(wq, rows, 128, torch.float64)
    assert torch.allclose(got, x_back @ w_back.t(), rtol=1e-6, atol=1e-6)  # the layout read as the recipe reads it
    # (the dequantized weight is rounded to float32 on its way: 1e-6, not float64's 1e-15)
    exact = x.double() @ w.double().t()
    assert F.cosine_similarity(got.flatten(), exact.flatten(), dim=0) > 0.998  # e4m3's error on both operands
    # a transposed reading of the weight's scales (blocks (kb, nb)) is a different product
    wrong = bw.reference_product(xq, a, wq, torch.flip(bw.weight_scales(rows, 256, 384, 128), dims=(1,)))
    assert not torch.allclose(wrong, got)


def test_weights_not_in_128_blocks_keep_the_dequantized_gemm():
    _, _, rows = block_weight(256, 256)
    assert bw.weight_scales(rows, 256, 256, 64) is None  # other blocks
    assert bw.weight_scales(rows[:, :1].contiguous(), 256, 256, 256) is None  # per-row scales
    fused = torch.cat([rows[:64], rows[:192] * 2])  # q (64 rows) and k/v fused: the blocks no longer align
    assert bw.weight_scales(fused, 256, 256, 128) is None


def test_a_cpu_keeps_the_dequantized_gemm_and_gets_its_result():
    w, wq, rows = block_weight(256, 256)
    layer = fp8.Fp8Linear(256, 256, bk=128)
    layer.weight.copy_(wq)
    layer.weight_scale_inv.copy_(rows)
    layer.prepare()
    assert layer.block_scales is None and not bw.works_on(torch.device("cpu"))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, fp8.dequantize_rows(wq, rows, 128, torch.bfloat16)))


def _hopper() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the block-scaled recipe runs on compute capability 9.0; this GPU is {torch.cuda.get_device_capability()}"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_hopper() is not None, reason=_hopper() or "")
def test_a_hopper_gpu_runs_the_block_scaled_gemm_and_gets_the_dequantized_product():
    gpu = torch.device("cuda", 0)
    assert bw.works_on(gpu), kernel_fallbacks.fallbacks()
    _, wq, rows = block_weight(1024, 2048, seed=3)
    layer = fp8.Fp8Linear(2048, 1024, bk=128).to(gpu)
    layer.weight.copy_(wq.to(gpu))
    layer.weight_scale_inv.copy_(rows.to(gpu))
    layer.prepare()
    assert layer.block_scales is not None
    x = torch.randn(33, 2048, device=gpu, dtype=torch.bfloat16)
    got = layer(x).float()
    xq, a = bw.quantize_groups(x)
    want = bw.reference_product(xq, a, layer.weight, layer.block_scales).float()
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
