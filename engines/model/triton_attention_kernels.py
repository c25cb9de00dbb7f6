"""The Triton kernels behind `engines.model.triton_attention` (launch logic and the performance
rationale live there). Every kernel reads K/V through the page table: token position `pos` of
sequence `b` is slot `page_table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE` of its KV head,
so no context is ever gathered or padded. Scores and softmax run in base 2 (`scale_log2` is the
attention scale times log2(e)); accumulators are float32.

Dot operands are cast to DOT_DTYPE and multiplied with PRECISION: on a GPU, q's dtype (tensor
cores) and "tf32" (the default, which only matters for float32 operands) or "ieee" (exact float32
products, chosen for float32 models). Under Triton's interpreter, which multiplies bfloat16 tensors
as raw integers (numpy has no bfloat16), DOT_DTYPE is float32: the operands keep the GPU's
bfloat16 rounding (probabilities included) and are then multiplied exactly. The kernels avoid
calling helper jit functions in their loops (the interpreter re-patches Triton on every such call,
which made the tests several times slower): the page lookup is written out in each loop."""

from __future__ import annotations

import triton
import triton.language as tl


# stride_pt is the page table's width, which differs from step to step in eager steps: Triton would
# otherwise compile a kernel apart for width 1, widths divisible by 16 and the rest (triton_attention)
@triton.jit(do_not_specialize=["stride_pt"])
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, scale_log2,
    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_pt, stride_ot, stride_oh,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (b, kv head, split): the GROUP query heads of one KV head attend over one slice of
    sequence b's context. NUM_SPLITS == 1: the result goes straight to `out`; otherwise a
    normalised partial output and its log2-sum-exp go to the scratch buffers for the reduce."""
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # each sequence cuts its own context into NUM_SPLITS slices of whole blocks: ragged batches stay balanced
    split_len = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(DOT_DTYPE)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    table_row = page_table_ptr + b.to(tl.int64) * stride_pt

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page = tl.load(table_row + pos // PAGE_SIZE, mask=valid, other=0)
        slots = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        k = tl.load(k_base + slots[None, :] * stride_ks + d[:, None], mask=valid[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every block holds at least one valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded like the values, as flash attention does
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty slice (or context) leaves zeros
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = b.to(tl.int64) * stride_pob + heads[:, None] * stride_poh + split * stride_pos + d[None, :]
        tl.store(part_o_ptr + part, o, mask=g_ok[:, None] & d_ok[None, :])
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + b.to(tl.int64) * stride_plb + heads * stride_plh + split, lse, mask=g_ok)


@triton.jit
def decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b, query head): merge the NUM_SPLITS partial outputs, each weighted by its share
    of the softmax denominator."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_plb + h * stride_plh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key at all (an empty row): weights are all 0
    w = tl.exp2(lse - top)
    o = tl.load(part_o_ptr + b * stride_pob + h * stride_poh + s[:, None] * stride_pos + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["stride_pt"])  # as decode_split_kernel's
def extend_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, q_starts_ptr, out_ptr, scale_log2,
    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_pt, stride_ot, stride_oh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (query head, query block, b): BLOCK_M new tokens of sequence b, causal over its
    context. KV blocks wholly visible to the block's first query take an unmasked loop; the blocks
    on the diagonal a masked one; blocks past the last query are never read."""
    h = tl.program_id(0).to(tl.int64)
    m_block = tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(q_starts_ptr + b)
    q_len = tl.load(q_starts_ptr + b + 1) - q0
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # cached tokens before the new ones

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = prefix + rows  # each new token's position in the sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q0 + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(DOT_DTYPE)
    kvh = h // GROUP
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    table_row = page_table_ptr + b.to(tl.int64) * stride_pt

    first_pos = prefix + m_block * BLOCK_M
    kv_end = prefix + tl.minimum(q_len, (m_block + 1) * BLOCK_M)  # keys past the block's last query
    kv_end = tl.where(m_block * BLOCK_M < q_len, kv_end, 0)  # a block of padding rows reads nothing
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, kv_end)  # keys <= first_pos: seen by all rows

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start in range(0, full_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        page = tl.load(table_row + pos // PAGE_SIZE)
        slots = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        k = tl.load(k_base + slots[None, :] * stride_ks + d[:, None], mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + d[None, :], mask=d_ok[None, :], other=0.0)
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
        m = m_new
    for start in range(full_end, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        page = tl.load(table_row + pos // PAGE_SIZE, mask=valid, other=0)
        slots = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        k = tl.load(k_base + slots[None, :] * stride_ks + d[:, None], mask=valid[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2
        # key 0 is in the first block any row reads, so no row's running max stays -inf
        s = tl.where((pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q0 + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
