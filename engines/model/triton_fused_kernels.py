"""Triton kernels that fuse a layer's small stages on a GPU (`engines.model.fused` picks them and
says why). Each reads its input once in its storage dtype, computes in float32 and writes once; the
torch lines they replace launch one kernel per operation (RMSNorm: 8, RoPE: 7, SwiGLU's product: 2).

Both take one program per token row and no token count, so neither recompiles when a step's size
changes (a CUDA graph per batch bucket replays the same compiled kernel)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program t: every head of token t rotated, the two halves of each head as in Hugging Face's
    layout: out = x * cos + cat(-x2, x1) * sin, with cos/sin the token's float32 table row."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    ok = (h < HEADS)[:, None] & (j < HALF)[None, :]
    row = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(row, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + j, mask=j < HALF, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + j, mask=j < HALF, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + j, mask=j < HALF, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + j, mask=j < HALF, other=0.0)[None, :]
    out = out_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(out, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, block): silu(gate) * up for BLOCK columns of token t, where row t of x is
    [gate | up], each WIDTH wide."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_xt, stride_ot, eps, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: row t scaled by the reciprocal root mean square of its float32 values, times the
    weight."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < WIDTH
    x = tl.load(x_ptr + t * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / WIDTH + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (x * scale * w).to(out_ptr.dtype.element_ty), mask=ok)
