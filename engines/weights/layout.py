"""Mapping per-projection weights onto the model's fused layout, and checking a state against the
model it is for."""

from __future__ import annotations

import torch

from engines.model.build import float_shapes
from engines.model_config import ModelConfig
from engines.quant.fp8 import BLOCK_SUFFIX, SCALE_SUFFIX, fp8_extras


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
    """Fail with the offending tensor's name rather than deep inside load_state_dict: one the float
    model of `config` has and `state` lacks, one it has no place for, one of another shape. The
    model itself (built on the meta device) says what it has, so every family is checked alike."""
    expected = float_shapes(config)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"missing weights: {missing[:5]}{' …' if len(missing) > 5 else ''}")
    extras = fp8_extras(state)  # an FP8 projection's scales beside its weight (engines.quant.fp8)
    for name in sorted(n for n in extras if n.endswith(SCALE_SUFFIX)):
        weight = name[: -len(SCALE_SUFFIX)]
        bk = state.get(weight + BLOCK_SUFFIX)
        if weight not in expected or bk is None:
            raise ValueError(f"FP8 scales {name} without their projection or block")
        n, k = expected[weight]
        if tuple(state[name].shape) != (n, -(-k // int(bk))):
            raise ValueError(f"FP8 scales {name} have shape {tuple(state[name].shape)}, expected {(n, -(-k // int(bk)))}")
    unused = sorted(set(state) - set(expected) - extras)
    if unused:
        raise ValueError(f"weights the {config.architecture} model does not use: {unused[:5]}"
                         f"{' …' if len(unused) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(state[name].shape)}, expected {shape}")
