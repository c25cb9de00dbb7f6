"""Decode attention on the CPU that reads the paged KV pool in place (the `engines._cpu_attention`
C kernel).

The torch path (`engines.decode_groups`) copies every decode row's context out of its pages, per
layer, before two batched matmuls read it again: at batch 32 over ~300-token contexts that gather
was the largest share of a decode step. The kernel walks each row's pages directly — one work item
per (sequence, KV head) on torch's OpenMP threads, its query heads sharing each key and value read,
float32 arithmetic (a float16/bfloat16 pool widened in registers) — and writes the output rows.

It serves the int8 model (the CPU default: float32 queries over a float32 pool; the kernel also
reads float16/bfloat16 pools). Float models keep the torch path, so the fp32 reference mode computes
exactly what it did. `BULLET_CPU_ATTENTION=gather` turns the kernel off (an A/B switch for benchmarks);
the vector code follows the process's kernel cap (`ATEN_CPU_CAPABILITY=avx2`: AVX2, see
`engines.device.AVX2_ONLY_ENV`)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

try:
    from engines import _cpu_attention as _ext
except ImportError:  # a source tree whose C extension was not built: the torch path serves
    _ext = None

ENV = "BULLET_CPU_ATTENTION"
KV_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ISA_GENERIC, ISA_AVX2, ISA_AVX512 = 0, 1, 2


@functools.lru_cache(maxsize=1)
def kernel_isa() -> int:
    """The widest implementation this CPU runs under the process's kernel cap."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        flags = set()
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if _ext is None or not all(_ext.compiled_isas()):
        return ISA_GENERIC
    if {"avx512f", "avx512bw", "avx512vl", "f16c", "fma"} <= flags and cap not in ("avx2", "avx", "default"):
        return ISA_AVX512
    if {"avx2", "f16c", "fma"} <= flags and cap not in ("avx", "default"):
        return ISA_AVX2
    return ISA_GENERIC


def enabled() -> bool:
    """Whether decode rows over a half-width pool take the kernel (vector code, not switched off)."""
    choice = os.environ.get(ENV, "auto").lower()
    if choice not in ("auto", "gather"):
        raise ValueError(f"{ENV} must be auto or gather, got {choice!r}")
    return choice == "auto" and kernel_isa() != ISA_GENERIC


def uses_kernel(kv: torch.Tensor, quantized_model: bool) -> bool:
    """Whether a runner over pool `kv` reads it in place: the int8 model's pool on a CPU. Float models
    keep the gather path (the fp32 reference stays bit for bit; bf16 queries stay bf16)."""
    return quantized_model and kv.device.type == "cpu" and kv.dtype in KV_CODES and enabled()


@dataclass
class InPlacePlan:
    """The decode rows of one step: where each row's query is, its pages and its context length."""

    rows: torch.Tensor  # [B] int64: token row of each decode sequence in the packed batch
    page_table: torch.Tensor  # [B, W] int32: its pool pages in order (past its context: never read)
    ctx_lens: torch.Tensor  # [B] int32: context length after this step (the new token included)
    page_size: int


    num_tokens: int  # rows in the step's packed batch
    num_pages: int  # pages in the pool


def plan_in_place(rows: Sequence[int], ctx_lens: Sequence[int], page_tables: Sequence[Sequence[int]],
                  page_size: int, num_tokens: int, num_pages: int) -> InPlacePlan:
    """Checked here, once per step, so that the kernel (which trusts its tables) never reads outside
    the pool or the batch."""
    need = [-(-n // page_size) for n in ctx_lens]
    table = np.zeros((len(rows), max(need, default=1)), dtype=np.int32)
    for i, (pages, n) in enumerate(zip(page_tables, need)):
        if len(pages) < n:
            raise ValueError(f"decode row {i}: {len(pages)} pages cover fewer than its {ctx_lens[i]} tokens")
        table[i, :n] = pages[:n]
    if len(rows) and (min(rows) < 0 or max(rows) >= num_tokens or min(ctx_lens) < 1
                      or table.min() < 0 or table.max() >= num_pages):
        raise ValueError("decode plan out of range: a row past the batch, an empty context or a page past the pool")
    return InPlacePlan(torch.tensor(list(rows), dtype=torch.int64), torch.from_numpy(table),
                       torch.tensor(list(ctx_lens), dtype=torch.int32), page_size, num_tokens, num_pages)


def decode_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: InPlacePlan, scale: float,
                    out: torch.Tensor | None = None, isa: int | None = None) -> torch.Tensor:
    """q: [T, H, D] float32; k_cache/v_cache: [KV heads, slots, D] (one layer, contiguous). Writes the
    attention output of every row of `plan` into `out` ([T, H, D], created when None). `isa`: one of
    ISA_* (default `kernel_isa()`; the tests run each implementation this CPU has)."""
    if _ext is None:
        raise RuntimeError("engines._cpu_attention is not built (python setup.py build_ext --inplace)")
    kvh, slots, d = k_cache.shape
    if q.dtype != torch.float32 or q.dim() != 3 or q.shape[2] != d or q.shape[1] % kvh:
        raise ValueError(f"q must be float32 [T, H, {d}] with H a multiple of {kvh}, got {q.dtype} {tuple(q.shape)}")
    if k_cache.dtype not in KV_CODES or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must share one shape and a float32/float16/bfloat16 dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache of a layer must be contiguous")
    if q.shape[0] != plan.num_tokens or slots != plan.num_pages * plan.page_size:
        raise ValueError("the plan was made for another batch or pool")
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()  # rows may lie apart (q is a view of the fused QKV output), heads may not
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    if out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 tensor shaped like q")
    isa = kernel_isa() if isa is None else isa
    if isa > kernel_isa():
        raise ValueError(f"implementation {isa} needs instructions this CPU (or the process's cap) lacks")
    if torch.autograd.profiler._is_profiler_enabled:  # named in a profile (a C call is no torch op)
        with torch.profiler.record_function("cpu_attention::decode"):
            return _call(q, k_cache, v_cache, plan, scale, out, isa)
    return _call(q, k_cache, v_cache, plan, scale, out, isa)


def _call(q, k_cache, v_cache, plan: InPlacePlan, scale: float, out: torch.Tensor, isa: int) -> torch.Tensor:
    kvh, slots, d = k_cache.shape
    _ext.decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), plan.page_table.data_ptr(),
                plan.ctx_lens.data_ptr(), plan.rows.data_ptr(), len(plan.rows), q.shape[1], kvh, d, slots,
                plan.page_size, plan.page_table.shape[1], KV_CODES[k_cache.dtype], scale, isa,
                torch.get_num_threads(), q.stride(0))
    return out
