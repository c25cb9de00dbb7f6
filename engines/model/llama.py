"""The Llama family's decoder (RMSNorm, RoPE incl. Llama-3.1 scaling, GQA, SwiGLU, tied or untied
head) that runs any layer range [start, end) of a packed batch against a paged KV pool. It serves
LlamaForCausalLM, MistralForCausalLM (without a sliding window: `engines.architectures`) and
Qwen2ForCausalLM, whose only difference is a bias on the q/k/v projections (`config.qkv_bias`):
`nn.Linear` adds it inside the QKV GEMM, so RoPE (fused or not) rotates q and k with it, as
Qwen2 does. Other families subclass the layer (`engines.model.qwen3`).

Q/K/V and gate/up projections are fused into one matrix each (fewer, larger GEMMs); the loaders
produce weights in that layout. Parameter names: embed_tokens, layers.{i}.{input_norm, qkv_proj,
o_proj, post_attn_norm, gate_up_proj, down_proj}, norm, lm_head (absent when tied); qkv_proj has a
`bias` too where `config.qkv_bias`.

`int8_block` >= 0 builds the int8 (W8A8) model of `engines.quant` instead: the projections, the head
and the embedding hold int8 buffers (`qweight`, `scale`), the head is untied, and down_proj rotates
its input in blocks of `int8_block` columns (0: no rotation)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engines.forward_context import ForwardContext
from engines.model import fused
from engines.model.attention import paged_attention, write_kv
from engines.model.layers import RMSNorm, float_linear, linear, pre_norm
from engines.model.rope import RotaryEmbedding, rotate_heads
from engines.model_config import ModelConfig
from engines.quant.int8 import Int8Embedding

__all__ = ["DecoderLayer", "LlamaModel", "RMSNorm"]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, int8_block: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_norm = pre_norm(h, eps, int8_block)
        self.qkv_proj = linear(h, self.q_size + 2 * self.kv_size, int8_block, norm_eps=eps, bias=config.qkv_bias)
        self.o_proj = linear(self.q_size, h, int8_block)
        self.post_attn_norm = pre_norm(h, eps, int8_block)
        self.build_mlp(config, int8_block)

    def build_mlp(self, config: ModelConfig, int8_block: int | None) -> None:
        """The dense SwiGLU (a family with another MLP in some layers overrides this and `mlp`)."""
        h, i, eps = config.hidden_size, config.intermediate_size, config.rms_norm_eps
        self.gate_up_proj = linear(h, 2 * i, int8_block, norm_eps=eps)
        self.down_proj = linear(i, h, int8_block, int8_block or 0)

    # The layer's stages, as methods: `forward` chains them, and the estimator's kernel sweep
    # (estimator/profiler/kernel_timing.py) times the same calls one by one.
    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: Callable,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(self.input_norm(x))
        q, k, v = self.rotate(qkv, ctx, rope)
        x = x + self.o_proj(self.attend(q, k, v, ctx, k_cache, v_cache))
        return x + self.mlp(self.post_attn_norm(x))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))

    def rotate(self, qkv: torch.Tensor, ctx: ForwardContext, rope: Callable):
        """Split the fused QKV output into q [T, H, D], k, v [T, KVH, D] and apply RoPE to q and k:
        with the step's tables (ctx.rope_cos/sin) in one call over both, else through `rope`
        (a RotaryEmbedding, or its `rotate` for callers that reserved the positions)."""
        t, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size:].view(t, kvh, d)
        if ctx.rope_cos is not None:
            qk = rotate_heads(qkv[:, : self.q_size + self.kv_size].view(t, h + kvh, d), ctx.rope_cos, ctx.rope_sin)
            return qk[:, :h], qk[:, h:], v
        q, k = rope(ctx.positions, qkv[:, : self.q_size].view(t, h, d),
                    qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kvh, d))
        return q, k, v

    def attend(self, q, k, v, ctx: ForwardContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Write the new K/V to the pool, attend; returns [T, H * D]."""
        write_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
        return paged_attention(q, k, v, k_cache, v_cache, ctx, self.scale).reshape(q.shape[0], self.q_size)

    @staticmethod
    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(gate_up)  # silu(gate) * up; one kernel on a GPU


def _on_meta() -> bool:
    return torch.get_default_device().type == "meta"


def _embedding(num: int, dim: int) -> nn.Embedding:
    """A token embedding, left uninitialised on the meta device (a model built around weights that exist
    elsewhere): nn.Embedding's own normal_ on a meta tensor runs through torch._refs, whose first use
    imports torch._dynamo — ~1.5 s of every worker's start on a 2-core machine, for a tensor never read."""
    if _on_meta():
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class LlamaModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer  # a family's own layer (its subclass of this model says)

    def __init__(self, config: ModelConfig, int8_block: int | None = None, tied_head: bool | None = None):
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        self.embed_tokens = _embedding(v, h) if int8_block is None else Int8Embedding(v, h)
        self.layers = nn.ModuleList(self.layer_class(config, i, int8_block) for i in range(config.num_hidden_layers))
        self.norm = pre_norm(h, config.rms_norm_eps, int8_block)
        # a rotated model unties the head from the embedding (the head carries the final norm)
        self.tied_head = config.tie_word_embeddings and int8_block is None if tied_head is None else tied_head
        if not self.tied_head:
            self.lm_head = linear(h, v, int8_block, norm_eps=config.rms_norm_eps)
        # on the meta device the RoPE tables (non-persistent buffers, computed through torch._refs there)
        # are left to whoever places the model: build_model makes them on the model's device
        self.rope = None if _on_meta() else RotaryEmbedding(config)

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
        if self.tied_head:
            return float_linear(self.norm(hidden), self.embed_tokens.weight).float()
        return self.lm_head(self.norm(hidden)).float()
