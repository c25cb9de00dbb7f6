"""A tiny random Llama (2 layers, fp32) and a runner over a private KV pool, for tests that run real
model steps on the CPU in milliseconds."""

from __future__ import annotations

import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.model_config import ModelConfig
from engines.runner import ModelRunner, SeqChunk
from engines.weights.dummy import dummy_weights

PAGE_SIZE = 4
CONFIG = ModelConfig(name="tiny", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=512)


def tiny_runner(pages: int = 64, seed: int = 0, paged: bool = False, kernels=None) -> ModelRunner:
    """`paged`: attention through page tables (the GPU's path, which decode graphs need), with
    `kernels` (default: what `kernels_for` picks for float32 on the CPU: the in-place C kernel where
    it is built, else the torch reference)."""
    model = build_model(CONFIG, dummy_weights(CONFIG, torch.float32, seed=seed))
    kv = KVPool(CONFIG, pages, PAGE_SIZE, torch.float32)
    return ModelRunner(model, kv, paged=paged, kernels=kernels)


def prefill(runner: ModelRunner, prompts: list[list[int]], first_page: int = 0) -> list[list[int]]:
    """Write the prompts' K/V into consecutive pages (one page table per prompt, room for 8 more
    tokens each); returns the page tables."""
    tables, page = [], first_page
    for prompt in prompts:
        n = -(-(len(prompt) + 8) // PAGE_SIZE)
        tables.append(list(range(page, page + n)))
        page += n
    runner.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    return tables
