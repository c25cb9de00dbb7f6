"""Attention over a paged KV pool: write the new K/V into their slots, then attend.

The pool is head-major, [KV heads, slots, head_dim] per layer and K/V: a gather of context slots
along dim 1 yields [KV heads, n, D] ready for a batched matmul per head, with no transpose copy.

Three shapes of work, chosen per sequence from the ForwardContext:
* decode (one new token): in groups of same-width sequences (`engines.decode_groups`): one gather of
  K, V and queries for the batch, then a baddbmm (scores + padding mask), a softmax and a bmm per
  group — no per-sequence loop; without a plan (a caller's own padded tables, e.g. CUDA graphs) the
  whole batch is one group;
* plain prefill (a sequence's whole context is new): causal SDPA over its fresh K/V, no gather;
* continued prefill (a chunk after cached tokens): gather its context, bottom-right causal mask.
Only torch ops, so the same code runs on CUDA tensors. On a GPU (and on a CPU for the int8 model,
`engines.model.cpu_attention`) the runner sets `ctx.paged` instead: kernels then read K/V from the
pool's pages (`engines.model.paged_attention`), except in a step of fresh prompts only, which SDPA
serves from its new K/V as above (on the GPU; the CPU kernels attend prompts too, `attends_prompts`);
a step mixing decode rows and chunks runs each kind on its own kernel (`paged_attention.split_mixed`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.decode_groups import DecodePlan, padded_plan
from engines.forward_context import ForwardContext


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache/v_cache: [KVH, num_slots, D]; k/v: [T, KVH, D]; slots: [T]."""
    k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ctx: ForwardContext, scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k/v: [T, KVH, D] (already written to the cache). Returns [T, H, D]."""
    if ctx.paged is not None or ctx.paged_parts is not None:
        if ctx.all_decode:
            return ctx.kernels.decode(q, k_cache, v_cache, ctx.paged, scale)
        if all(n == c for n, c in zip(ctx.q_lens, ctx.ctx_lens)) and not getattr(ctx.kernels, "attends_prompts", False):
            # Every sequence is a fresh prompt: its keys are this step's k/v, contiguous already, and
            # SDPA's flash kernel is the fastest causal attention torch has (measured fine for GPU
            # prefill); the paged kernels are for chunks that attend to a cached prefix. Kernels that
            # attend prompts themselves (`attends_prompts`, the CPU's) compute a row the same way
            # whatever chunk it came in: SDPA's blocks follow the chunk's length.
            out = torch.empty_like(q)
            for start, q_len in zip(ctx.q_starts, ctx.q_lens):
                out[start : start + q_len] = _causal_sdpa(q, k, v, start, q_len, scale)
            return out
        if ctx.paged_parts is not None:
            return _paged_parts(q, k_cache, v_cache, ctx, scale)
        return ctx.kernels.extend(q, k_cache, v_cache, ctx.paged, scale)
    plan = ctx.decode_plan
    if plan is None and ctx.all_decode:
        plan = padded_plan(ctx.kv_slots, ctx.kv_valid, k_cache.shape[0], k_cache.shape[1], q.dtype)
    out = torch.empty_like(q) if plan is None or not ctx.all_decode else None
    if plan is not None:
        out = _decode(q, k_cache, v_cache, plan, scale, out)
    if ctx.all_decode:
        return out
    for i, (start, q_len, ctx_len) in enumerate(zip(ctx.q_starts, ctx.q_lens, ctx.ctx_lens)):
        if q_len == 1 and plan is not None:
            continue  # attended in its decode group
        qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if q_len == ctx_len:
            ki = k[start : start + q_len].transpose(0, 1).unsqueeze(0)
            vi = v[start : start + q_len].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            slots = ctx.kv_slots[i, :ctx_len]
            ki = k_cache.index_select(1, slots).unsqueeze(0).to(q.dtype)  # [1, KVH, ctx, D]
            vi = v_cache.index_select(1, slots).unsqueeze(0).to(q.dtype)
            # Query j (0-based among the new tokens) sees keys 0 .. ctx_len - q_len + j.
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx_len - q_len)
            cols = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=cols <= rows, scale=scale, enable_gqa=True)
        out[start : start + q_len] = oi.squeeze(0).transpose(0, 1)
    return out


def _paged_parts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext,
                 scale: float) -> torch.Tensor:
    """A mixed step's decode rows on the decode kernel, its chunks on extend (`split_mixed`)."""
    out = torch.empty_like(q)
    for part in ctx.paged_parts:
        run = ctx.kernels.decode if part.decode else ctx.kernels.extend
        if isinstance(part.rows, slice):  # views: the kernels read and write the rows in place
            run(q[part.rows], k_cache, v_cache, part.tables, scale, out[part.rows])
        else:
            out.index_copy_(0, part.rows, run(q.index_select(0, part.rows), k_cache, v_cache, part.tables, scale))
    return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, q_len: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of one fresh sequence (rows start .. start + q_len) over its own new K/V
    (the paged path's prefill; the gather path above inlines the same call)."""
    qi, ki, vi = (x[start : start + q_len].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, n, D]
    oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    return oi.squeeze(0).transpose(0, 1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float,
            out: torch.Tensor | None) -> torch.Tensor:
    """Every decode row of `plan` (one query token each), written into `out` ([T, H, D], created when
    None). Explicit grouped-query attention: for one query token per sequence several times faster
    than torch's CPU SDPA kernels."""
    kvh, d = k_cache.shape[0], k_cache.shape[2]
    t, heads = q.shape[0], q.shape[1]
    group = heads // kvh
    k_flat, v_flat = k_cache.view(-1, d), v_cache.view(-1, d)
    qs = q.reshape(t * kvh, group, d).index_select(0, plan.pair_index)  # (row, KV head) pairs in group order
    res = torch.empty_like(qs)
    for g in plan.groups:
        # gathered group by group: each group's K/V is still in cache when its two matmuls read it
        idx = plan.kv_index[g.kv_start : g.kv_start + g.pairs * g.width]
        kg = k_flat.index_select(0, idx).view(g.pairs, g.width, d)
        vg = v_flat.index_select(0, idx).view(g.pairs, g.width, d)
        if kg.dtype != q.dtype:
            kg, vg = kg.to(q.dtype), vg.to(q.dtype)
        scores = torch.baddbmm(g.mask, qs[g.q_start : g.q_start + g.pairs], kg.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        torch.bmm(probs if probs.dtype == vg.dtype else probs.to(vg.dtype), vg, out=res[g.q_start : g.q_start + g.pairs])
    if out is None:
        out = torch.empty_like(q)
    out.view(t * kvh, group, d).index_copy_(0, plan.pair_index, res)
    return out
