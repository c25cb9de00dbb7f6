"""Paged attention on the CPU that reads the KV pool in place: the `cpu` set of `PagedKernels`
(`engines.model.paged_attention`), around the `engines._cpu_attention` C kernel.

The gather path (`engines.model.attention` with `engines.decode_groups`) copies every decode row's
context out of its pages, per layer, before two batched matmuls read it again: at batch 32 over
~300-token contexts that gather was the largest share of a decode step. The kernel walks each row's
pages directly — one work item per block of a sequence's rows and KV head on torch's OpenMP threads,
the rows and query heads sharing each key and value read, float32 arithmetic (a float16/bfloat16 pool
widened in registers).

`decode` attends the decode rows (one new token each); `extend` every row, a prompt chunk's as a
decode row at its place — and the runner sends it fresh prompts too (`attends_prompts`), not SDPA: a
token's output is then the same bits in any batch, in a decode step or in any chunk of its prompt,
whatever a prefix cache held. That matters for the int8 model, the one `kernels_for` picks this set
for on a CPU (float32 queries): its activations are rounded to 8 bits per token, so SDPA's blocking,
which follows a chunk's length, moved a prompt's logits by up to ~1.2 between a cold prompt and a cached
one (the same request gave other log-probabilities, and in time other tokens). Float models keep the
gather path, so the fp32 reference computes exactly what it did. The vector code is the widest the
CPU has (the C side asks the CPU, never running an instruction it lacks), capped by the process's
kernel cap (`ATEN_CPU_CAPABILITY=avx2`: AVX2, see `engines.device.AVX2_ONLY_ENV`)."""

from __future__ import annotations

import functools

import torch

from engines.device import ISA_AVX2, ISA_AVX512, ISA_GENERIC, own_kernel_isa  # noqa: F401 (ISA_* named by callers)
from engines.model.paged_attention import PagedTables

try:
    from engines import _cpu_attention as _ext
except ImportError:  # a source tree whose C extension was not built: the torch reference serves
    _ext = None

KV_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@functools.lru_cache(maxsize=1)
def kernel_isa() -> int:
    """The widest implementation this build and this CPU run, under the process's kernel cap."""
    return own_kernel_isa(_ext)


def available(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernel serves these queries over this pool at vector speed (the portable C is
    for tests: the torch reference is no slower than it)."""
    return _ext is not None and q_dtype == torch.float32 and kv_dtype in KV_CODES and kernel_isa() != ISA_GENERIC


class CpuPagedKernels:
    """q: [T, H, D] float32; k_cache/v_cache: [KV heads, slots, D] float32/float16/bfloat16, one layer.
    `isa`: one of ISA_* (default `kernel_isa()`; the tests run every implementation this CPU has)."""

    name = "cpu"
    # prompts too: every row is computed as a decode row at its place, so a token's output does not
    # depend on how its prompt was cut into chunks or how much of it the prefix cache held
    attends_prompts = True

    def __init__(self, isa: int | None = None):
        if _ext is None:
            raise RuntimeError("engines._cpu_attention is not built (python setup.py build_ext --inplace)")
        self.isa = kernel_isa() if isa is None else isa

    def decode(self, q, k_cache, v_cache, tables: PagedTables, scale, out=None):
        return self._named(q, k_cache, v_cache, tables, scale, out, every_row=False)

    def extend(self, q, k_cache, v_cache, tables: PagedTables, scale, out=None):
        """Every row, a prompt chunk's too, each as a decode row at its own place (row j of n new tokens
        over a context of L sees its first L - n + 1 + j tokens)."""
        return self._named(q, k_cache, v_cache, tables, scale, out, every_row=True)

    def _named(self, q, k_cache, v_cache, tables: PagedTables, scale, out, every_row: bool):
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        if torch.autograd.profiler._is_profiler_enabled:  # named in a profile (a C call is no torch op)
            with torch.profiler.record_function("cpu_attention::extend" if every_row else "cpu_attention::decode"):
                return self._call(q, k_cache, v_cache, tables, scale, out, every_row)
        return self._call(q, k_cache, v_cache, tables, scale, out, every_row)

    def _call(self, q, k_cache, v_cache, tables: PagedTables, scale, out, every_row: bool):
        kvh, slots, d = k_cache.shape
        if q.dtype != torch.float32 or q.dim() != 3 or q.shape[2] != d or q.shape[1] % kvh:
            raise ValueError(f"q must be float32 [T, H, {d}] with H a multiple of {kvh}, got {q.dtype} {tuple(q.shape)}")
        if k_cache.dtype not in KV_CODES or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
            raise ValueError("k_cache and v_cache must share one shape and a float32/float16/bfloat16 dtype")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.device.type != "cpu":
            raise ValueError("the KV cache of a layer must be contiguous CPU memory")
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()  # rows may lie apart (q is a view of the fused QKV output), heads may not
        if out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("out must be a contiguous float32 tensor shaped like q")
        table, lens, starts = (t.to(torch.int32).contiguous() for t in (tables.page_table, tables.seq_lens, tables.q_starts))
        batch = lens.shape[0]
        if table.dim() != 2 or table.shape[0] != batch or starts.shape[0] != batch + 1:
            raise ValueError("page_table, seq_lens and q_starts describe different batches")
        if batch == 0:
            return out
        # the C side checks every page, row and length against the pool and the batch
        _ext.decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), table.data_ptr(),
                    lens.data_ptr(), starts.data_ptr(), batch, q.shape[0], q.shape[1], kvh, d, slots, tables.page_size,
                    table.shape[1], KV_CODES[k_cache.dtype], scale, self.isa, torch.get_num_threads(),
                    q.stride(0), every_row)
        return out
