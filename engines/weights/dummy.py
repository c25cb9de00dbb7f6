"""Random weights of the right shapes from a config alone (`--load-format dummy`), as Bullet's own
artifact does for Llama-3.1-8B: lets the runtime, the profiler and the simulator run a model whose
real weights are not on this machine. Seeded, so two loads give the same model."""

from __future__ import annotations

import torch

from engines.model_config import ModelConfig


def dummy_weights(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    state = {"embed_tokens.weight": normal(config.vocab_size, h), "norm.weight": torch.ones(h, dtype=dtype)}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}"
        state[f"{p}.input_norm.weight"] = torch.ones(h, dtype=dtype)
        state[f"{p}.post_attn_norm.weight"] = torch.ones(h, dtype=dtype)
        state[f"{p}.qkv_proj.weight"] = normal(config.q_size + 2 * config.kv_size, h)
        state[f"{p}.o_proj.weight"] = normal(h, config.q_size)
        state[f"{p}.gate_up_proj.weight"] = normal(2 * i, h)
        state[f"{p}.down_proj.weight"] = normal(h, i)
    return state
