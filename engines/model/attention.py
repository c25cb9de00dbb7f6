"""Attention over a paged KV pool: write the new K/V into their slots, then attend.

Three shapes of work, chosen per step from the ForwardContext:
* decode (every sequence has one new token): gather each context from the pool, one batched SDPA;
* plain prefill (a sequence's whole context is new): causal SDPA over its fresh K/V, no gather;
* continued prefill (a chunk after cached tokens): gather its context, bottom-right causal mask.
Only torch ops, so the same code runs on CUDA tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.forward_context import ForwardContext


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
    # Explicit grouped-query attention: for one query token per sequence this is ~9x faster than
    # torch's CPU SDPA kernels in bf16 (measured: 0.2 ms vs 1.7 ms for 32 x 9 heads x 133 keys).
    b, max_ctx = ctx.kv_slots.shape
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    flat = ctx.kv_slots.reshape(-1)
    ks = k_cache.index_select(0, flat).view(b, max_ctx, kvh, d).transpose(1, 2).to(q.dtype)  # [B, KVH, C, D]
    vs = v_cache.index_select(0, flat).view(b, max_ctx, kvh, d).transpose(1, 2).to(q.dtype)
    scores = torch.matmul(q.view(b, kvh, group, d), ks.transpose(-1, -2)).float() * scale  # [B, KVH, G, C]
    scores = scores.masked_fill(~ctx.kv_valid.view(b, 1, 1, max_ctx), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vs).view(b, q.shape[1], d)
