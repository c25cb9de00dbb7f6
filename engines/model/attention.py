"""Attention over a paged KV pool: write the new K/V into their slots, then attend.

Three shapes of work, chosen per step from the ForwardContext:
* decode (every sequence has one new token): gather each context from the pool, one batched SDPA;
* plain prefill (a sequence's whole context is new): causal SDPA over its fresh K/V, no gather;
* continued prefill (a chunk after cached tokens): gather its context, bottom-right causal mask.
Only torch ops, so the same code runs on CUDA tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.context import ForwardContext


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache/v_cache: [num_slots, KVH, D]; k/v: [T, KVH, D]; slots: [T]."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ctx: ForwardContext, scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k/v: [T, KVH, D] (already written to the cache). Returns [T, H, D]."""
    if ctx.all_decode:
        return _decode_attention(q, k_cache, v_cache, ctx, scale)
    out = torch.empty_like(q)
    for i, (start, q_len, ctx_len) in enumerate(zip(ctx.q_starts, ctx.q_lens, ctx.ctx_lens)):
        qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if q_len == ctx_len:
            ki = k[start : start + q_len].transpose(0, 1).unsqueeze(0)
            vi = v[start : start + q_len].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            slots = ctx.kv_slots[i, :ctx_len]
            ki = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vi = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            # Query j (0-based among the new tokens) sees keys 0 .. ctx_len - q_len + j.
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx_len - q_len)
            cols = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=cols <= rows, scale=scale, enable_gqa=True)
        out[start : start + q_len] = oi.squeeze(0).transpose(0, 1)
    return out


def _decode_attention(q, k_cache, v_cache, ctx: ForwardContext, scale: float) -> torch.Tensor:
    b, max_ctx = ctx.kv_slots.shape
    flat = ctx.kv_slots.reshape(-1)
    ks = k_cache.index_select(0, flat).view(b, max_ctx, *k_cache.shape[1:]).transpose(1, 2).to(q.dtype)
    vs = v_cache.index_select(0, flat).view(b, max_ctx, *v_cache.shape[1:]).transpose(1, 2).to(q.dtype)
    qb = q.unsqueeze(2)  # [B, H, 1, D]
    o = F.scaled_dot_product_attention(qb, ks, vs, attn_mask=ctx.kv_valid, scale=scale, enable_gqa=True)
    return o.squeeze(2)
