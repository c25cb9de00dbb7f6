"""The Qwen3 decoder: Llama's, with each q and k head RMS-normalized over head_dim (a weight per
channel, shared by the heads: `q_norm`, `k_norm`) after the QKV projection and before RoPE. Its
head_dim is a config value of its own (Qwen3-32B: 64 heads of 128 over a hidden size of 5120).

The norms read the per-head views of the QKV output and write contiguous q and k, which is the
layout the fused RoPE kernel takes, so on a GPU the kernel rotates heads that are already normed.
In the int8 model they stay float RMSNorms: the rotations of `engines.quant.rotation` leave q and
k unchanged, so there is nothing to fold."""

from __future__ import annotations

from typing import Callable

import torch

from engines.forward_context import ForwardContext
from engines.model.layers import RMSNorm
from engines.model.llama import DecoderLayer, LlamaModel
from engines.model.rope import rotate_heads
from engines.model_config import ModelConfig


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int, int8_block: int | None = None):
        super().__init__(config, layer_id, int8_block)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def rotate(self, qkv: torch.Tensor, ctx: ForwardContext, rope: Callable):
        """As `DecoderLayer.rotate`, with q and k normed first (q and k rotate in two calls: the norms
        wrote them apart)."""
        t, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, : self.q_size].view(t, h, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kvh, d))
        v = qkv[:, self.q_size + self.kv_size:].view(t, kvh, d)
        if ctx.rope_cos is not None:
            return rotate_heads(q, ctx.rope_cos, ctx.rope_sin), rotate_heads(k, ctx.rope_cos, ctx.rope_sin), v
        q, k = rope(ctx.positions, q, k)
        return q, k, v


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer
