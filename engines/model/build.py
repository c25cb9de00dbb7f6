"""Builds a LlamaModel around an existing state dict without copying it (`assign=True`), so weights
that live in shared memory (or arrive by CUDA IPC handle) are used in place."""

from __future__ import annotations

import torch

from engines.model.llama import LlamaModel
from engines.model.rope import RotaryEmbedding
from engines.model_config import ModelConfig
from engines.quant import down_block_of, is_int8_state
from engines.quant.int8 import Int8Linear


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> LlamaModel:
    """The state dict says which model it is: float weights, or the int8 buffers of `engines.quant`."""
    int8_block = down_block_of(state) if is_int8_state(state) else None
    tied = config.tie_word_embeddings and "lm_head.weight" not in state and "lm_head.qweight" not in state
    with torch.device("meta"):
        model = LlamaModel(config, int8_block, tied)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (RoPE tables) are not in the state dict: rebuild them on the device.
    with torch.device(device):
        model.rope = RotaryEmbedding(config)
    # int8 GEMMs run on fbgemm's packed copy of the weights, built here in the process that runs
    # them (it cannot be shared): the first step then costs no packing
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.pack()

    return model.eval().requires_grad_(False)
