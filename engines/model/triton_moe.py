"""The mixture-of-experts MLP on CUDA tensors in two Triton kernels, with no value read back on the
host (a CUDA decode graph captures it), computing what `engines.model.moe.grouped_experts` does.

Alignment (`align`, torch ops on the device): the (token, pick) rows are sorted by expert, and each
expert's run of rows is padded to a multiple of BLOCK_M, so every block of BLOCK_M slots belongs to
one expert; `slots` holds each slot's row (token * k + pick, or `rows` for padding), `block_expert`
each block's expert (`num_experts` for the blocks past the last expert's: their programs return at
once). The number of blocks is the bound cdiv(rows, BLOCK_M) + min(experts, rows), known without
the counts, so the launch grid depends only on the batch's row count.

Grouped GEMMs: `gate_up_kernel` multiplies each block's rows (gathered from x by token) by its
expert's gate and up matrices and writes silu(gate) * up per slot; `down_kernel` multiplies those by
the expert's down matrix, scales each row by its routing weight and writes it to its (token, pick)
row. The picks of a token are summed in torch. Accumulation is in float32, one rounding at each
kernel's store (the grouped torch path rounds after each GEMM and again after the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (slots [blocks * block_m] int64, block_expert [blocks] int64)."""
    flat = ids.reshape(-1)
    rows = flat.numel()
    blocks = -(-rows // block_m) + min(num_experts, rows)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks_of = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks_of, 0)
    first_row = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    slot_of = (block_end - blocks_of)[expert] * block_m + torch.arange(rows, device=ids.device) - first_row[expert]
    slots = torch.full((blocks * block_m,), rows, dtype=torch.int64, device=ids.device)
    slots[slot_of] = order
    block_expert = torch.searchsorted(block_end, torch.arange(blocks, device=ids.device), right=True)
    return slots, block_expert


# `rows` (tokens x picks) changes with every step's size: unspecialised, so a step of one row or of a
# multiple of 16 rows runs the kernel every other size does instead of compiling its own mid-serve
@triton.jit(do_not_specialize=["rows"])
def gate_up_kernel(x_ptr, w_ptr, slots_ptr, block_expert_ptr, out_ptr, rows, stride_xt, stride_we, stride_wn,
                   stride_ot, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                   EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program (block, n): out[slot, n:n+BLOCK_N] = silu(x_t @ gate_e^T) * (x_t @ up_e^T) for the
    block's slots (t = the slot's token, e = the block's expert); w [E, 2 * WIDTH, HIDDEN]."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= EXPERTS:
        return
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(slots_ptr + m)
    valid = row < rows
    token = (row // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < WIDTH
    w = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < HIDDEN
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_ok, other=0.0)
        wu = tl.load(w + (WIDTH + n[None, :]) * stride_wn + k[:, None], mask=w_ok, other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate += tl.dot(a, wg, input_precision=PRECISION)
        up += tl.dot(a, wu, input_precision=PRECISION)
    h = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_ot + n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["rows"])  # as gate_up_kernel's
def down_kernel(h_ptr, w_ptr, weights_ptr, slots_ptr, block_expert_ptr, out_ptr, rows, stride_ht, stride_we,
                stride_wn, stride_ot, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, EXPERTS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """Program (block, n): out[row, n:n+BLOCK_N] = weight_row * (h_slot @ down_e^T) for the block's
    slots; w [E, HIDDEN, WIDTH], weights the routing weights per (token, pick) row."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= EXPERTS:
        return
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(slots_ptr + m)
    valid = row < rows
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, WIDTH, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < WIDTH
        a = tl.load(h_ptr + m[:, None].to(tl.int64) * stride_ht + k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    scale = tl.load(weights_ptr + row, mask=valid, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


SMALL_BLOCK_MAX_ROWS = 512  # up to this many (token, pick) rows a step takes 16-row blocks


def block_rows(rows: int) -> int:
    """BLOCK_M for a step of `rows` (token, pick) rows: 16 for decode-sized steps (a few rows per
    expert), 64 beyond. Two compiled variants per kernel, both warmed at start-up
    (`engines.kernel_warmup`)."""
    return 16 if rows <= SMALL_BLOCK_MAX_ROWS else 64


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, block_m: int | None = None, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """As `moe.grouped_experts`: x [T, H], weights/ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    t, top_k = ids.shape
    experts, double, hidden = gate_up.shape
    width = double // 2
    if (x.shape[1] != hidden or down.shape != (experts, hidden, width) or x.stride(1) != 1
            or gate_up.stride(2) != 1 or down.stride(2) != 1):
        raise ValueError(f"MoE kernels need x [T, {hidden}] and experts [E, 2I, H] / [E, H, I] with contiguous rows, "
                         f"got {tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    rows = t * top_k
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(t, top_k, hidden).sum(dim=1)
    block_m = block_m or block_rows(rows)
    slots, block_expert = align(ids, experts, block_m)
    blocks = block_expert.numel()
    h = torch.empty((blocks * block_m, width), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (tf32 is its default on a GPU)
    # Triton's interpreter (CPU tensors, the tests) multiplies 16-bit floats wrongly in tl.dot: it gets
    # them in float32, exactly (the GPU multiplies them exactly too, accumulating in float32)
    upcast = not x.is_cuda and x.dtype != torch.float32
    if upcast:
        precision = "ieee"
    gate_up_kernel[(blocks, triton.cdiv(width, block_n))](
        x, gate_up, slots, block_expert, h, rows, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOP_K=top_k, HIDDEN=hidden, WIDTH=width, EXPERTS=experts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, UPCAST=upcast, num_warps=4)
    down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, down, flat_weights, slots, block_expert, out, rows, h.stride(0), down.stride(0), down.stride(1),
        out.stride(0), HIDDEN=hidden, WIDTH=width, EXPERTS=experts, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast, num_warps=4)
    return out.view(t, top_k, hidden).sum(dim=1)
