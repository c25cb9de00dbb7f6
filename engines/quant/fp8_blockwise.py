"""The block-scaled FP8 GEMM of checkpoints quantized in 128 x 128 blocks (Qwen3-FP8, DeepSeek-V3):
the activation quantized to e4m3 per 1 x 128 group of each row, the weight kept with its 128 x 128
block scales, one `torch.nn.functional.scaled_mm` call (`ScalingType.BlockWise1x128` by
`BlockWise128x128`). torch 2.13 runs that recipe through cuBLASLt on compute capability 9.0 (Hopper)
only; elsewhere `Fp8Linear` dequantizes the weight for a bf16 GEMM, as before.

The layouts are torch's contract for the recipe (its meta registration checks them, which a CPU
test runs): for A [M, K] the scales [M, K/128] with stride (1, M), M-major; for B = W^T [K, N] the
scales [L4, N/128] with L4 = K/128 rounded up to 4 and stride (1, L4), element [kb, nb] the scale of
W's block (nb, kb). The product is C[m, n] = sum over kb of a_scale[m, kb] x b_scale[kb, nb] x the
e4m3 partial product of that group — what `reference_product` computes in float64 for the tests.

Whether a GPU runs the recipe, and runs it right, is asked once per device (`works_on`): a 256 x 256
product checked against the dequantized one. A device that refuses it or gets it wrong keeps the
dequantized GEMM, and the fallback is recorded (`engines.kernel_fallbacks`) so a report says so."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from engines import kernel_fallbacks

log = logging.getLogger("engines.fp8")

GROUP = 128  # the recipe's block edge: activation groups of 1 x 128, weight blocks of 128 x 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def weight_scales(scale_rows: torch.Tensor, n: int, k: int, bk: int) -> torch.Tensor | None:
    """`Fp8Linear`'s row scales [N, K/bk] (each block's scale repeated over its rows) -> B's scales in
    the recipe's layout, or None where the weight is not in 128 x 128 blocks: bk other than 128, N or
    K not multiples of 128, or a group of 128 rows whose scales differ (a fused q/k/v or gate/up whose
    parts do not start on a block). Reads the scales on the host: call it at load, not in a step."""
    if bk != GROUP or n % GROUP or k % GROUP or tuple(scale_rows.shape) != (n, k // GROUP):
        return None
    kb = k // GROUP
    groups = scale_rows.float().view(n // GROUP, GROUP, kb)
    if not torch.equal(groups, groups[:, :1].expand_as(groups)):
        return None
    l4 = -(-kb // 4) * 4
    out = torch.ones(n // GROUP, l4, dtype=torch.float32, device=scale_rows.device)  # the padding is never read
    out[:, :kb] = groups[:, 0]
    return out.t()  # [L4, N/128], stride (1, L4)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] (multiples of 128) -> (e4m3 [N, K], `Fp8Linear`'s row scales [N, K/128]):
    each 128 x 128 block's largest magnitude maps to 448, as block-wise FP8 checkpoints store it."""
    n, k = w.shape
    blocks = w.float().view(n // GROUP, GROUP, k // GROUP, GROUP).abs().amax(dim=(1, 3)).clamp_(min=1e-12) / FP8_MAX
    rows = blocks.repeat_interleave(GROUP, dim=0)
    return (w.float() / rows.repeat_interleave(GROUP, dim=1)).to(FP8), rows


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [M, K], float32 scales [M, K/128] with stride (1, M)):
    each 1 x 128 group's largest magnitude maps to 448. Tensor ops only: a CUDA graph captures it."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    scale = g.abs().amax(dim=-1).clamp_(min=1e-12) / FP8_MAX
    q = (g / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    # stride (1, M) even where M is 1 (`.t().contiguous().t()` would keep a [1, G] row's own strides)
    out = torch.empty(k // GROUP, m, dtype=torch.float32, device=x.device).t()
    return q, out.copy_(scale)


def product(x: torch.Tensor, weight: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 with `weight_scales`)^T -> [M, N] in `out_dtype`."""
    xq, a_scales = quantize_groups(x)
    return F.scaled_mm(xq, weight.t(), a_scales, F.ScalingType.BlockWise1x128, b_scales,
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def reference_product(xq: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, b_scales: torch.Tensor) -> torch.Tensor:
    """What the recipe computes, in float64 on any device: sum over k-groups of the two scales times
    the group's e4m3 partial product."""
    m, k = xq.shape
    n, kb = weight.shape[0], k // GROUP
    a = xq.double().view(m, kb, GROUP)
    w = weight.double().view(n // GROUP, GROUP, kb, GROUP)  # [nb, row, kb, col]
    partial = torch.einsum("mgc,brgc->mgbr", a, w)  # [m, kb, nb, row]
    scaled = partial * a_scales.double()[:, :, None, None] * b_scales[:kb].double()[None, :, :, None]
    return scaled.sum(dim=1).reshape(m, n)


@functools.lru_cache(maxsize=None)
def works_on(device: torch.device) -> bool:
    """Whether `device` runs the recipe and gets the dequantized product (cosine >= 0.999 on a
    256 x 256 weight in 2 x 2 blocks). Asked once per device, at load (it reads results on the host)."""
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False  # torch 2.13 offers the recipe on Hopper only; others dequantize without trying
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        wq, rows = quantize_blocks(torch.randn(256, 256, device=device, generator=gen))
        x = torch.randn(16, 256, device=device, generator=gen, dtype=torch.bfloat16)
        got = product(x, wq, weight_scales(rows, 256, 256, GROUP), torch.bfloat16).float()
        want = F.linear(x.float(), wq.float() * rows.repeat_interleave(GROUP, dim=1))
        cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        if cos < 0.999:
            raise RuntimeError(f"its product is off the dequantized one (cosine {cos:.4f})")
    except Exception as exc:  # a toolchain or GPU without the recipe: dequantized GEMMs, said once
        log.warning("block-scaled FP8 GEMM unavailable on %s (%s: %s): block-wise FP8 weights are dequantized "
                    "for each product", device, type(exc).__name__, exc)
        kernel_fallbacks.record("FP8 block-scaled GEMM", "the weight dequantized for a bf16 GEMM", exc)
        return False
    return True
