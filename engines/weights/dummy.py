"""Random weights of the right shapes from a config alone (`--load-format dummy`), as Bullet's own
artifact does for Llama-3.1-8B: lets the runtime, the profiler and the simulator run a model whose
real weights are not on this machine. Seeded, so two loads give the same model.

They are drawn where the model is served. On the CPU the values are those every profile and test
was made with (a CPU generator, fp32 draws cast to `dtype`). On a GPU they are drawn there by the
device's own generator, directly in `dtype` — other values, same seed-determinism — because 8
billion normal samples take minutes on a CPU and well under a second on a GPU, and nothing has to
be copied across afterwards."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Generator

from engines.model_config import ModelConfig

SCALE = 0.02  # the standard deviation of the projections: keeps activations finite through every layer


def _normal_draws(seed: int, dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor]:
    if device.type == "cpu":
        gen = Generator().manual_seed(seed)
        return lambda *shape: (torch.randn(*shape, generator=gen) * SCALE).to(dtype)
    gen = Generator(device=device).manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(SCALE)


def dummy_weights(config: ModelConfig, dtype: torch.dtype, seed: int = 0,
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    device = torch.device(device)
    normal = _normal_draws(seed, dtype, device)
    h, i = config.hidden_size, config.intermediate_size

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=dtype, device=device)

    state = {"embed_tokens.weight": normal(config.vocab_size, h), "norm.weight": ones()}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}"
        state[f"{p}.input_norm.weight"] = ones()
        state[f"{p}.post_attn_norm.weight"] = ones()
        state[f"{p}.qkv_proj.weight"] = normal(config.q_size + 2 * config.kv_size, h)
        state[f"{p}.o_proj.weight"] = normal(h, config.q_size)
        if n in config.moe_layers:  # a mixture of experts in place of the dense SwiGLU
            e, w = config.num_experts, config.moe_intermediate_size
            state[f"{p}.moe.router.weight"] = normal(e, h)
            state[f"{p}.moe.experts.gate_up_proj"] = normal(e, 2 * w, h)
            state[f"{p}.moe.experts.down_proj"] = normal(e, h, w)
        else:
            state[f"{p}.gate_up_proj.weight"] = normal(2 * i, h)
            state[f"{p}.down_proj.weight"] = normal(h, i)
        # drawn after the layer's matrices: a Llama config draws the values it always has
        if config.qkv_bias:
            state[f"{p}.qkv_proj.bias"] = normal(config.q_size + 2 * config.kv_size)
        if config.qk_norm:
            state[f"{p}.q_norm.weight"] = torch.ones(config.head_dim, dtype=dtype, device=device)
            state[f"{p}.k_norm.weight"] = torch.ones(config.head_dim, dtype=dtype, device=device)
    return state
