"""Builds a LlamaModel around an existing state dict without copying it (`assign=True`), so weights
that live in shared memory (or arrive by CUDA IPC handle) are used in place."""

from __future__ import annotations

import torch

from engines.model.llama import LlamaModel
from engines.model.rope import RotaryEmbedding
from engines.model_config import ModelConfig


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (RoPE tables) are not in the state dict: rebuild them on the device.
    with torch.device(device):
        model.rope = RotaryEmbedding(config)
    return model.eval().requires_grad_(False)
