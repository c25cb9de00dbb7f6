"""Builds the model of a config's architecture around an existing state dict without copying it
(`assign=True`), so weights that live in shared memory (or arrive by CUDA IPC handle) are used in
place."""

from __future__ import annotations

import torch

from engines import architectures
from engines.model.llama import LlamaModel
from engines.model.qwen3 import Qwen3Model
from engines.model.qwen3_moe import Qwen3MoeModel
from engines.model.rope import RotaryEmbedding
from engines.model_config import ModelConfig
from engines.quant import down_block_of, is_int8_state
from engines.quant.fp8 import Fp8Linear, is_fp8_state, use_fp8_linears
from engines.quant.int8 import Int8Linear

# Mistral and Qwen2 are Llama's decoder with a switch of the config (engines.architectures)
MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    architectures.LLAMA: LlamaModel, architectures.MISTRAL: LlamaModel, architectures.QWEN2: LlamaModel,
    architectures.QWEN3: Qwen3Model, architectures.QWEN3_MOE: Qwen3MoeModel,
}


def model_class(config: ModelConfig) -> type[LlamaModel]:
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(f"no model for architecture {config.architecture!r}; supported: {', '.join(MODEL_CLASSES)}")
    return cls


def float_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the float model of `config`, by name (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> LlamaModel:
    """The state dict says which model it is: float weights, the int8 buffers of `engines.quant`, or
    projections kept in FP8 (`engines.quant.fp8`)."""
    int8_block = down_block_of(state) if is_int8_state(state) else None
    tied = config.tie_word_embeddings and "lm_head.weight" not in state and "lm_head.qweight" not in state
    with torch.device("meta"):
        model = model_class(config)(config, int8_block, tied)
    if is_fp8_state(state):  # projections kept in FP8 (a CUDA device's load of an FP8 checkpoint)
        use_fp8_linears(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (RoPE tables) are not in the state dict: rebuild them on the device.
    with torch.device(device):
        model.rope = RotaryEmbedding(config)
    # int8 GEMMs run on fbgemm's packed copy of the weights, built here in the process that runs
    # them (it cannot be shared): the first step then costs no packing
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.pack()
        elif isinstance(module, Fp8Linear):  # block scales in the layout of the block-scaled GEMM, where it runs
            module.prepare()

    return model.eval().requires_grad_(False)
