"""Hugging Face model directories: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engines.model_config import ModelConfig
from engines.weights.errors import ModelLoadError
from engines.weights.layout import check_shapes, fuse_layer


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()), name=path.name)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: {exc}") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has a config.json but no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    raw[key.removeprefix("model.")] = st.get_tensor(key).to(dtype)
        except Exception as exc:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({exc})") from exc

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"{path}: weight {name!r} missing")
        return raw.pop(name)

    state = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}"
        state.update(fuse_layer(
            p,
            q=take(f"{p}.self_attn.q_proj.weight"), k=take(f"{p}.self_attn.k_proj.weight"),
            v=take(f"{p}.self_attn.v_proj.weight"), o=take(f"{p}.self_attn.o_proj.weight"),
            gate=take(f"{p}.mlp.gate_proj.weight"), up=take(f"{p}.mlp.up_proj.weight"),
            down=take(f"{p}.mlp.down_proj.weight"),
            input_norm=take(f"{p}.input_layernorm.weight"), post_norm=take(f"{p}.post_attention_layernorm.weight"),
        ))
    try:
        check_shapes(config, state)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return config, state
