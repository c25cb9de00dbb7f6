"""A decode step's mixture-of-experts SwiGLU experts on the CPU, around the `engines._cpu_moe` C kernel.

At decode the experts a batch touches get one to a few rows each, so an expert's time is the bytes
of its matrices. The grouped path (`engines.model.moe.grouped_experts`) runs each expert as two
small torch GEMMs, which in bfloat16 stream the weights at ~7 GB/s on one core; the kernel reads
each expert's matrices once for all its rows (`csrc/cpu_moe.c`), widening bfloat16 weights in
registers, with float32 arithmetic throughout and one rounding of each output. A token's output is
the same alone or batched, and the same whichever thread ran which expert.

`experts_forward` (engines.model.moe) takes it on a CPU for float32 and bfloat16 batches of at most
`moe.CPU_KERNEL_TOKENS` tokens (prefill's large groups stay GEMMs, which compute faster there). The
vector code is the widest the CPU has under the process's kernel cap (`engines.device`)."""

from __future__ import annotations

import functools

import torch

from engines.device import ISA_GENERIC, own_kernel_isa_ceiling

try:
    from engines import _cpu_moe as _ext
except ImportError:  # a source tree whose C extension was not built: the grouped path serves
    _ext = None

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}  # csrc/cpu_vec.h ELEM_*


@functools.lru_cache(maxsize=1)
def kernel_isa() -> int:
    """The widest implementation this build and this CPU run, under the process's kernel cap."""
    return ISA_GENERIC if _ext is None else min(_ext.best_isa(), own_kernel_isa_ceiling())


def available(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the kernel runs these experts at vector speed: CPU tensors of one supported dtype,
    contiguous stacked weights (the portable C is for tests, slower than the grouped path)."""
    return (_ext is not None and kernel_isa() != ISA_GENERIC and x.device.type == "cpu"
            and x.dtype in DTYPE_CODES and gate_up.dtype == x.dtype and down.dtype == x.dtype
            and gate_up.is_contiguous() and down.is_contiguous())


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            isa: int | None = None) -> torch.Tensor:
    """x [T, H], weights/ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x's dtype:
    sum over k of weight x down @ (silu(gate @ x) * (up @ x)). `isa`: one of engines.device.ISA_*
    (default `kernel_isa()`; the tests run every implementation this CPU has)."""
    if _ext is None:
        raise RuntimeError("engines._cpu_moe is not built (python setup.py build_ext --inplace)")
    t, k = ids.shape
    e, two_i, h = gate_up.shape
    if (x.shape != (t, h) or weights.shape != (t, k) or down.shape != (e, h, two_i // 2) or two_i % 2
            or x.dtype not in DTYPE_CODES or gate_up.dtype != x.dtype or down.dtype != x.dtype):
        raise ValueError(f"experts: x {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)}, ids "
                         f"{tuple(ids.shape)}, gate_up {tuple(gate_up.shape)} {gate_up.dtype}, down "
                         f"{tuple(down.shape)} {down.dtype} do not fit together")
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    ids = ids.to(torch.int64).contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    out = torch.empty((t, h), dtype=x.dtype)
    if t:
        _ext.experts(x.data_ptr(), out.data_ptr(), weights.data_ptr(), ids.data_ptr(), gate_up.data_ptr(),
                     down.data_ptr(), t, k, e, h, two_i // 2, DTYPE_CODES[x.dtype],
                     kernel_isa() if isa is None else isa, torch.get_num_threads())
    return out
