"""Paged attention in Triton: decode and extend read K/V straight from the pool's pages.

`TritonPagedKernels` implements `engines.model.paged_attention.PagedKernels` on CUDA tensors (and on
CPU tensors under `TRITON_INTERPRET=1`, which is how the tests check it against the torch reference).
The kernels are in `triton_attention_kernels`; this module picks block sizes and grids and launches.

Why these choices (reasoned, not measured: no GPU has timed these kernels yet;
`artifact/benchmarks/bench_attention_gpu.py` does, on one):

* **Decode is memory bound.** One new token per sequence: a step reads every context's K and V
  once and does ~2 flops per byte, so the goal is enough bytes in flight on every SM. One program
  serves *all* the query heads of one KV head (GQA: each K/V block is loaded once for the group,
  4 query heads in Llama-3.1-8B, 3 in SmolLM2) as a [16, D] x [D, 64] tensor-core dot: the group is
  padded to 16 rows (the smallest `tl.dot` tile), which costs flops decode has to spare, not bytes.
* **Flash-decoding splits.** A grid of batch x KV heads is 8 programs for one Llama sequence, 8 of
  an H100's 132 SMs. So each sequence's context is cut into `NUM_SPLITS` slices of whole 64-key
  blocks, one program each, and a second kernel merges the partial outputs by their log-sum-exp.
  The split count aims at about two programs per SM (Little's law: ~4 TB/s x ~1 us of memory
  latency / 132 SMs is ~32 KB in flight per SM; one 64-token K+V block is 32 KB at D=128 in bf16),
  but keeps at least `MIN_SPLIT_TOKENS` of the widest possible context per split (each split
  writes a [group, D] float32 partial that the reduce reads back) and at most `MAX_SPLITS`.
  Llama-3.1-8B on 132 SMs: 1 x 1024 -> 8 splits (64 programs); 32 x 1024 -> 2 (512 programs);
  128 x 512 -> 1, and with one split the first kernel writes the output itself (no reduce
  launch). Each sequence cuts *its own* length into the splits on the device, so a ragged batch
  stays balanced; the count depends only on host ints (batch, KV heads, the page table's width,
  the SM count), as a CUDA graph needs. 4 warps, 2 stages: a [16, 64] score tile is small work.
* **A finite set of compiled kernels.** `NUM_SPLITS` is a compile-time constant, and an eager
  step's page table is as wide as its longest context: a count that followed every width would
  compile a new kernel pair for each new one in the middle of serving (a chunked run on an H200
  would have needed ~12 counts, ~20 compiles inside served steps). So the count is rounded down to a power
  of two (`decode_splits`; rounding down keeps every split at least `MIN_SPLIT_TOKENS` long), and
  Triton is told not to specialise on the table's row stride (`stride_pt`, the width: Triton
  would otherwise compile apart widths divisible by 16, width 1 and the rest). The kernels a
  server can launch are then known from its configuration (`split_buckets`: 1, 2, 4, ... up to
  the count its longest context and its SMs allow), and `engines.kernel_warmup` launches each
  once before serving.
* **Extend** (chunks after a cached prefix, and the chunks of mixed prefill/decode steps, whose
  one-token rows the runner sends to decode, `paged_attention.split_mixed`; a step of fresh prompts
  only stays on SDPA, see `engines.model.attention`) is flash attention over pages: one program per
  (query head, BLOCK_M new tokens, sequence), online softmax over 64-key blocks. Blocks below the
  block's first query need no mask (a loop of their own); the diagonal blocks are masked; blocks
  past its last query are never read, nor anything for the query blocks past a short sequence's
  end (the grid is sized by the longest). Query heads of one KV head are adjacent in the grid, so
  their K/V reads hit L2. BLOCK_M = 128 with 8 warps for 16-bit inputs when some sequence brings
  more than 64 tokens (a [128, 128] float32 accumulator is 64 registers per thread), 64 with 4
  warps otherwise; float32 (rare on a GPU: exact dots on CUDA cores) takes 32 x 32 tiles. 2 stages
  let Triton overlap the next block's loads with this block's math where its pipeliner can: the
  K/V loads are gathers through the page table, so no TMA.
* **Precision.** Scores, softmax statistics and accumulators are float32; probabilities are rounded
  to the value dtype before the P x V dot, as flash attention does; float32 inputs use exact
  (IEEE) dots rather than tf32; the output is written in q's dtype.

Scratch for the split partials is allocated with `torch.empty` inside the call: the caching
allocator serves it from the graph's private pool under CUDA-graph capture, and its shape is a
function of (batch, heads, splits, D) only. Nothing in `decode` reads a device value on the host.
The first call per configuration compiles: run one eager step before capturing a graph."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from engines.model import triton_attention_kernels as K
from engines.model.paged_attention import PagedTables
from engines.triton_compiles import launch_key

MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 32
DECODE_BLOCK_N = 64
INTERPRETED_SMS = 4  # no SM count on the CPU: a small nominal one, so the tests exercise several splits
# TRITON_INTERPRET=1 when triton was imported: the kernels run on CPU tensors (the tests)
INTERPRETED = not isinstance(K.extend_kernel, triton.runtime.JITFunction)


@dataclass
class Launch:
    """One kernel launch, kept as data so tests can also compile it ahead of time for a GPU."""

    kernel: object
    grid: tuple[int, ...]
    args: dict
    constexprs: dict
    options: dict = field(default_factory=dict)  # num_warps, num_stages

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.constexprs, **self.options)

    def key(self) -> tuple:
        """The compiled kernel this launch runs, as Triton's JIT cache keys it (`launch_key`)."""
        return launch_key(self.kernel, {**self.args, **self.constexprs}, self.options)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch: int, kv_heads: int, max_context: int, sms: int) -> int:
    """Splits per sequence: about two programs per SM, at least MIN_SPLIT_TOKENS per split, rounded
    down to a power of two (each count is a kernel of its own: a few counts, all warmed at start-up)."""
    want = -(-2 * sms // max(1, batch * kv_heads))
    by_length = -(-max_context // MIN_SPLIT_TOKENS)
    return 1 << (max(1, min(want, by_length, MAX_SPLITS)).bit_length() - 1)


def split_buckets(kv_heads: int, max_context: int, sms: int) -> list[int]:
    """Every split count `decode_splits` can return for a context of at most `max_context` tokens,
    whatever the batch: the powers of two up to the count of one sequence at that length (it only
    falls as the batch grows or the context shrinks)."""
    top = decode_splits(1, kv_heads, max_context, sms)
    return [1 << i for i in range(top.bit_length())]


def device_sms(device: torch.device | str) -> int:
    """The SM count the split heuristic uses on `device` (a nominal one for CPU tensors)."""
    return _sm_count(torch.device(device))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [T, H, D] and k/v caches [KV heads, slots, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"{q.shape[1]} query heads of dim {q.shape[2]} do not fit {k_cache.shape[0]} KV heads "
                         f"of dim {k_cache.shape[2]}")
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"Triton kernels on {q.device} tensors run only under its interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q and the KV caches need a contiguous head dimension")
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous head dimension")
    return out


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dot_options(q: torch.Tensor) -> dict:
    """DOT_DTYPE / PRECISION of triton_attention_kernels: q's dtype on a GPU, float32 for bfloat16
    under the interpreter (which cannot multiply bfloat16); exact products for float32 models."""
    if q.dtype not in _TL_DTYPES:
        raise ValueError(f"paged attention kernels take float32, float16 or bfloat16, not {q.dtype}")
    return {"DOT_DTYPE": tl.float32 if INTERPRETED and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype],
            "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}


def decode_launches(q, k_cache, v_cache, tables: PagedTables, scale: float, out: torch.Tensor,
                    num_splits: int | None = None) -> list[Launch]:
    batch, heads, dim = q.shape
    if batch != tables.batch:
        raise ValueError(f"decode takes one query row per sequence: {batch} rows, {tables.batch} sequences")
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    if num_splits is None:
        max_context = tables.page_table.shape[1] * tables.page_size
        num_splits = decode_splits(batch, kv_heads, max_context, _sm_count(q.device))
    block_d = triton.next_power_of_2(dim)
    part_o = part_lse = out  # unused when one split writes the output itself
    if num_splits > 1:
        part_o = torch.empty((batch, heads, num_splits, dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    po_strides = part_o.stride()[:3] if num_splits > 1 else (0, 0, 0)
    pl_strides = part_lse.stride()[:2] if num_splits > 1 else (0, 0)
    split = Launch(
        K.decode_split_kernel, (batch, kv_heads, num_splits),
        dict(q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, page_table_ptr=tables.page_table, seq_lens_ptr=tables.seq_lens,
             out_ptr=out, part_o_ptr=part_o, part_lse_ptr=part_lse, scale_log2=scale * math.log2(math.e),
             stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kh=k_cache.stride(0), stride_ks=k_cache.stride(1),
             stride_vh=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_pt=tables.page_table.stride(0),
             stride_ot=out.stride(0), stride_oh=out.stride(1), stride_pob=po_strides[0], stride_poh=po_strides[1],
             stride_pos=po_strides[2], stride_plb=pl_strides[0], stride_plh=pl_strides[1]),
        dict(PAGE_SIZE=tables.page_size, GROUP=group, HEAD_DIM=dim, NUM_SPLITS=num_splits,
             BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=DECODE_BLOCK_N, BLOCK_D=block_d,
             **_dot_options(q)),
        dict(num_warps=4, num_stages=2))
    if num_splits == 1:
        return [split]
    reduce = Launch(
        K.decode_reduce_kernel, (batch, heads),
        dict(part_o_ptr=part_o, part_lse_ptr=part_lse, out_ptr=out, stride_pob=po_strides[0],
             stride_poh=po_strides[1], stride_pos=po_strides[2], stride_plb=pl_strides[0], stride_plh=pl_strides[1],
             stride_ot=out.stride(0), stride_oh=out.stride(1)),
        dict(HEAD_DIM=dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d),
        dict(num_warps=4, num_stages=1))
    return [split, reduce]


def extend_launch(q, k_cache, v_cache, tables: PagedTables, scale: float, out: torch.Tensor) -> Launch:
    heads, dim = q.shape[1], q.shape[2]
    if q.dtype == torch.float32:
        block_m, block_n, warps = 32, 32, 4
    elif tables.max_q_len > 64:
        block_m, block_n, warps = 128, 64, 8
    else:
        block_m, block_n, warps = 64, 64, 4
    return Launch(
        K.extend_kernel, (heads, triton.cdiv(max(tables.max_q_len, 1), block_m), tables.batch),
        dict(q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, page_table_ptr=tables.page_table, seq_lens_ptr=tables.seq_lens,
             q_starts_ptr=tables.q_starts, out_ptr=out, scale_log2=scale * math.log2(math.e),
             stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kh=k_cache.stride(0), stride_ks=k_cache.stride(1),
             stride_vh=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_pt=tables.page_table.stride(0),
             stride_ot=out.stride(0), stride_oh=out.stride(1)),
        dict(PAGE_SIZE=tables.page_size, GROUP=heads // k_cache.shape[0], HEAD_DIM=dim, BLOCK_M=block_m,
             BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim), **_dot_options(q)),
        dict(num_warps=warps, num_stages=2))


class TritonPagedKernels:
    """`num_splits`: force the decode split count (tests, the start-up warm-up through
    `forced_splits`); None picks it per batch shape."""

    name = "triton"
    attends_prompts = False

    def __init__(self, num_splits: int | None = None):
        if num_splits is not None and not 1 <= num_splits <= 256:
            raise ValueError(f"num_splits must be in 1..256, got {num_splits}")
        self.num_splits = num_splits

    def split_buckets(self, kv_heads: int, max_context: int, device: torch.device | str) -> list[int]:
        """The decode split counts steps on `device` can use (see the module's docstring)."""
        if self.num_splits is not None:
            return [self.num_splits]
        return split_buckets(kv_heads, max_context, device_sms(device))

    @contextlib.contextmanager
    def forced_splits(self, num_splits: int):
        """Decode with `num_splits` splits inside the block: how a warm-up compiles each count
        with a one-token context."""
        if not 1 <= num_splits <= 256:
            raise ValueError(f"num_splits must be in 1..256, got {num_splits}")
        before, self.num_splits = self.num_splits, num_splits
        try:
            yield self
        finally:
            self.num_splits = before

    def decode(self, q, k_cache, v_cache, tables, scale, out=None):
        out = _check(q, k_cache, v_cache, out)
        if q.shape[0]:
            for launch in decode_launches(q, k_cache, v_cache, tables, scale, out, self.num_splits):
                launch.run()
        return out

    def extend(self, q, k_cache, v_cache, tables, scale, out=None):
        out = _check(q, k_cache, v_cache, out)
        if q.shape[0]:
            extend_launch(q, k_cache, v_cache, tables, scale, out).run()
        return out
