"""A decode step's products on the CPU, around the `engines._cpu_gemv` C kernel: a few token rows times
weights that are read once (`csrc/cpu_gemv.c`).

A decode step multiplies a handful of rows by every weight matrix, so its time is the bytes of the
weights. Through torch, small-M GEMMs in bfloat16 stream the weights well below the memory's rate on
a CPU (oneDNN, and torch's own kernels, which read the weights once per row); the kernel reads each
weight row once for all the rows, widening bfloat16 in registers, with float32 arithmetic and one
rounding of each output. A row's result is the same alone or batched.

* `linear`: x @ W^T (+ bias). `engines.model.layers.float_linear` takes it for bfloat16 batches of at
  most `LINEAR_ROWS` rows on a CPU. float32 keeps torch's GEMM: MKL's was as fast at one row and
  0.7-1.7x the kernel's time at 4-32 rows, no clear winner, and the float32 model is the reference.
* `experts`: a mixture-of-experts layer's SwiGLU experts, each picked expert's matrices read once for
  all its rows. `engines.model.moe.experts_forward` takes it for float32 and bfloat16 batches of at most
  `moe.CPU_KERNEL_TOKENS` tokens (prefill's large groups stay GEMMs, which compute faster there), and,
  on a CPU with AMX, for larger bfloat16 batches with `tile_rows`: each expert then multiplies on the
  AMX tiles (`csrc/cpu_amx.c`: the weights as the tiles' left operand, read as they lie, the rows packed).

The vector code is the widest the CPU has under the process's kernel cap (`engines.device`)."""

from __future__ import annotations

import functools

import torch

from engines.device import ISA_AVX512, ISA_GENERIC, cpu_has_amx, own_kernel_isa

try:
    from engines import _cpu_gemv as _ext
except ImportError:  # a source tree whose C extension was not built: torch's GEMMs serve
    _ext = None

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}  # csrc/cpu_vec.h ELEM_*
# The most rows `float_linear` sends here. A whole bfloat16 decode step of SmolLM2-135M on an Intel Xeon
# with AMX, torch's GEMM over the kernel (one / two threads; artifact/benchmarks/bench_cpu_gemv.py
# --linear-rows 8, docs/cpu_gemv.md): batch 1-2 1.22-1.38x, batch 3 1.26x / 1.18x, batch 4 1.25x / 1.19x,
# batch 6 1.09x / 1.01x, batch 8 1.02x / 0.97x. One projection from memory (--cold-mb) at 4 rows: 0.99-2.4x
# over nine weight shapes. Beyond 4 rows oneDNN's GEMM, on AMX there, computes as fast as these dot
# products read.
LINEAR_ROWS = 4


@functools.lru_cache(maxsize=1)
def kernel_isa() -> int:
    """The widest implementation this build and this CPU run, under the process's kernel cap."""
    return own_kernel_isa(_ext)


def available(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the kernel runs these experts at vector speed: CPU tensors of one supported dtype,
    contiguous stacked weights (the portable C is for tests, slower than the grouped path)."""
    return (_ext is not None and kernel_isa() != ISA_GENERIC and x.device.type == "cpu"
            and x.dtype in DTYPE_CODES and gate_up.dtype == x.dtype and down.dtype == x.dtype
            and gate_up.is_contiguous() and down.is_contiguous())


def tiles_available(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `experts` may run these experts on AMX tiles: bfloat16 experts whose hidden size and width
    are whole multiples of 32, on a CPU with AMX that this process may use (`engines.device.cpu_has_amx`,
    which a kernel cap below AVX-512 turns off), where `available` holds."""
    return (available(x, gate_up, down) and x.dtype == torch.bfloat16 and kernel_isa() == ISA_AVX512
            and gate_up.shape[-1] % 32 == 0 and down.shape[-1] % 32 == 0 and cpu_has_amx() and _ext.amx_ready())


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            isa: int | None = None, tile_rows: int = 0) -> torch.Tensor:
    """x [T, H], weights/ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x's dtype:
    sum over k of weight x down @ (silu(gate @ x) * (up @ x)). `isa`: one of engines.device.ISA_*
    (default `kernel_isa()`; the tests run every implementation this CPU has). `tile_rows`: experts that
    at least this many rows picked run on AMX tiles (0: none; needs `tiles_available`)."""
    if _ext is None:
        raise RuntimeError("engines._cpu_gemv is not built (python setup.py build_ext --inplace)")
    t, k = ids.shape
    e, two_i, h = gate_up.shape
    if (x.shape != (t, h) or weights.shape != (t, k) or down.shape != (e, h, two_i // 2) or two_i % 2
            or x.dtype not in DTYPE_CODES or gate_up.dtype != x.dtype or down.dtype != x.dtype):
        raise ValueError(f"experts: x {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)}, ids "
                         f"{tuple(ids.shape)}, gate_up {tuple(gate_up.shape)} {gate_up.dtype}, down "
                         f"{tuple(down.shape)} {down.dtype} do not fit together")
    if tile_rows and not tiles_available(x, gate_up, down):  # the C side does not know the process's kernel cap
        raise ValueError(f"experts: AMX tiles need bfloat16, hidden and expert sizes in whole multiples of 32 and a "
                         f"CPU with AMX under a kernel cap of AVX-512 (x {x.dtype}, hidden {h}, width {two_i // 2})")
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    ids = ids.to(torch.int64).contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    out = torch.empty((t, h), dtype=x.dtype)
    if t:
        _ext.experts(x.data_ptr(), out.data_ptr(), weights.data_ptr(), ids.data_ptr(), gate_up.data_ptr(),
                     down.data_ptr(), t, k, e, h, two_i // 2, DTYPE_CODES[x.dtype],
                     kernel_isa() if isa is None else isa, torch.get_num_threads(), tile_rows)
    return out


def linear_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs x @ weight^T at vector speed: bfloat16 CPU tensors of at most LINEAR_ROWS
    rows and a contiguous weight."""
    return (_ext is not None and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.numel() <= LINEAR_ROWS * x.shape[-1] and weight.is_contiguous()
            and kernel_isa() != ISA_GENERIC)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           isa: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype (float32 or bfloat16)."""
    if _ext is None:
        raise RuntimeError("engines._cpu_gemv is not built (python setup.py build_ext --inplace)")
    n, k = weight.shape
    if (x.shape[-1] != k or x.dtype not in DTYPE_CODES or weight.dtype != x.dtype
            or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype))):
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)} do not fit together")
    rows = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype)
    _ext.linear(rows.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
                rows.shape[0], n, k, DTYPE_CODES[x.dtype], kernel_isa() if isa is None else isa,
                torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
