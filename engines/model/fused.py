"""One kernel for each of a layer's small stages on a GPU: RMSNorm, RoPE, SwiGLU's product.

Written as torch lines, a Llama layer launches about 40 kernels (counted by dispatching one), and
25 of them are these stages: RMSNorm in float32 statistics is 8 (twice a layer), RoPE over the Q
and K heads 7, SwiGLU's `silu(gate) * up` 2. Served on an H200 (2026-11-26), a prefill layer group
of 16 tokens took as long as one of 400 (0.8 ms a layer on 88 SMs: launches, not math), and a
decode step replayed from a CUDA graph still ran at 1.7x its memory floor, most of its ~1,300
kernels small ones. Here they are one Triton kernel each (`triton_fused_kernels`; torch's own
`rms_norm` dispatches the same lines again, at least on a CPU).

Each stage's torch lines stay the reference and the path of every other device: the CPU's float
models keep their results bit for bit (the tests compare them with transformers'). On a GPU the
fused forms round once where the lines round after each operation: within two units in the last
place of the storage dtype. `BULLET_FUSED_KERNELS=0` keeps the torch lines on a GPU too (the
engine benchmark times both)."""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from engines import kernel_fallbacks

log = logging.getLogger("engines.fused")

FUSED_ENV = "BULLET_FUSED_KERNELS"
ENABLED = os.environ.get(FUSED_ENV, "1") != "0"  # read once; the benchmark flips it to time both
SILU_BLOCK = 1024


@functools.lru_cache(maxsize=1)
def _kernels():
    """The Triton kernels, or None where triton does not import (then the torch lines run)."""
    try:
        from engines.model import triton_fused_kernels  # deferred: triton is optional
    except ImportError:
        return None
    return triton_fused_kernels


def fused_on(x: torch.Tensor) -> bool:
    """Whether `x`'s stages take the fused kernels: on a CUDA tensor, unless turned off."""
    return ENABLED and x.is_cuda


# -- the references (and every device's path but a GPU's) ----------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 statistics whatever the storage dtype, as the reference implementation does."""
    if x.dtype == torch.float32:  # torch's op: bit-identical to the lines below in fp32, fewer dispatches
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    out = xf * cos + rotated * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- the stages, as a layer calls them -----------------------------------------------------------------

# Each takes its kernel only for the layouts the kernel reads (the layer's own); anything else, e.g. a
# weight kept in another dtype than x (the lines promote the result), takes the lines.

def _guarded(kernel, lines, *args) -> torch.Tensor:
    """`kernel(*args)`, or, where Triton fails to compile or launch it on this GPU, the torch lines
    from then on (for every stage, with one warning): a server keeps serving, slower."""
    global ENABLED
    try:
        return kernel(*args)
    except Exception as exc:  # e.g. a toolchain this Triton cannot drive; the lines need none
        log.warning("fused %s failed (%s: %s): the layer's stages run as torch lines from now on "
                    "(%s=0 does so from the start)", kernel.__name__, type(exc).__name__, exc, FUSED_ENV)
        kernel_fallbacks.record(f"fused {kernel.__name__}", "torch lines for every fused stage", exc)
        ENABLED = False
        return lines(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (fused_on(x) and weight.dtype == x.dtype and weight.shape == x.shape[-1:] and x.stride(-1) == 1
            and _kernels() is not None):
        return _guarded(rms_norm_triton, rms_norm_reference, x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any row stride, contiguous heads); cos/sin [T, 1, D] float32."""
    if (fused_on(x) and x.dim() == 3 and x.shape[2] % 2 == 0 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
            and cos.is_contiguous() and sin.is_contiguous() and _kernels() is not None):
        return _guarded(rope_triton, rope_reference, x, cos, sin)
    return rope_reference(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu of the first half times the second."""
    if (fused_on(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1
            and _kernels() is not None):
        return _guarded(silu_mul_triton, silu_mul_reference, gate_up)
    return silu_mul_reference(gate_up)


# -- the Triton launches (on CUDA tensors, or CPU ones under TRITON_INTERPRET=1 in the tests) -------------

def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, dim = x.shape
    if dim % 2 or x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError(f"RoPE needs [T, heads, D] with contiguous heads and an even D, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    cos, sin = cos.reshape(t, dim), sin.reshape(t, dim)
    if cos.dtype != torch.float32 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("RoPE tables must be float32 rows [T, 1, D] laid out alike")
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        import triton  # deferred: only where the kernels imported

        _kernels().rope_kernel[(t,)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
                                     out.stride(1), HEADS=heads, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                                     BLOCK_HALF=triton.next_power_of_2(dim // 2), num_warps=4)
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    t, double = gate_up.shape
    if double % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"SwiGLU needs [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    width = double // 2
    out = torch.empty((t, width), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        import triton  # deferred: only where the kernels imported

        _kernels().silu_mul_kernel[(t, triton.cdiv(width, SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=SILU_BLOCK, num_warps=4)
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    if weight.shape != (width,) or x.stride(-1) != 1:
        raise ValueError(f"RMSNorm needs [..., {weight.shape[0]}] rows with a contiguous last dimension, "
                         f"got {tuple(x.shape)}")
    rows = x.reshape(-1, width)  # a view where the rows allow it
    out = torch.empty((rows.shape[0], width), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        import triton  # deferred: only where the kernels imported

        block = triton.next_power_of_2(width)
        _kernels().rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), eps,
                                                     WIDTH=width, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out.view(x.shape)
