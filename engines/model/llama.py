"""A Llama-family decoder (RMSNorm, RoPE incl. Llama-3.1 scaling, GQA, SwiGLU, tied or untied head)
that runs any layer range [start, end) of a packed batch against a paged KV pool.

Q/K/V and gate/up projections are fused into one matrix each (fewer, larger GEMMs); the loaders
produce weights in that layout. Parameter names: embed_tokens, layers.{i}.{input_norm, qkv_proj,
o_proj, post_attn_norm, gate_up_proj, down_proj}, norm, lm_head (absent when tied)."""

from __future__ import annotations

import torch
from torch import nn

from engines.forward_context import ForwardContext
from engines.model.attention import paged_attention, write_kv
from engines.model.rope import RotaryEmbedding
from engines.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics whatever the storage dtype, as the reference implementation does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        h, i = config.hidden_size, config.intermediate_size
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attn_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_norm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(ctx.positions, q, k)
        write_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
        attn = paged_attention(q, k, v, k_cache, v_cache, ctx, self.scale)
        x = x + self.o_proj(attn.reshape(t, self.q_size))
        gate, up = self.gate_up_proj(self.post_attn_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward_layers(self, hidden: torch.Tensor, start: int, end: int, ctx: ForwardContext,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        """Run layers [start, end). kv_cache: [num_layers, 2, num_slots, KVH, D]."""
        for layer in self.layers[start:end]:
            hidden = layer(hidden, ctx, self.rope, kv_cache[layer.layer_id, 0], kv_cache[layer.layer_id, 1])
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return nn.functional.linear(self.norm(hidden), head).float()
