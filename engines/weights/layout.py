"""Mapping per-projection weights onto the model's fused layout."""

from __future__ import annotations

import torch

from engines.model_config import ModelConfig


def fuse_layer(prefix: str, q, k, v, o, gate, up, down, input_norm, post_norm) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.input_norm.weight": input_norm,
        f"{prefix}.qkv_proj.weight": torch.cat([q, k, v], dim=0),
        f"{prefix}.o_proj.weight": o,
        f"{prefix}.post_attn_norm.weight": post_norm,
        f"{prefix}.gate_up_proj.weight": torch.cat([gate, up], dim=0),
        f"{prefix}.down_proj.weight": down,
    }


def check_shapes(config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Fail with the offending tensor's name rather than deep inside load_state_dict."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    expected = {"embed_tokens.weight": (v, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (v, h)
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}"
        expected.update({
            f"{p}.input_norm.weight": (h,), f"{p}.post_attn_norm.weight": (h,),
            f"{p}.qkv_proj.weight": (config.q_size + 2 * config.kv_size, h),
            f"{p}.o_proj.weight": (h, config.q_size),
            f"{p}.gate_up_proj.weight": (2 * i, h), f"{p}.down_proj.weight": (h, i),
        })
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"missing weights: {missing[:5]}{' …' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(state[name].shape)}, expected {shape}")
