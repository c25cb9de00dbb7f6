"""The paged KV pool: one tensor [num_layers, 2 (K, V), KV heads, num_pages * page_size, head_dim].

A token's K/V live at slot `page * page_size + offset` of every head. Head-major, so gathering a
context's slots gives [KV heads, n, head_dim]: what a batched matmul per head reads, no transpose. The tensor is allocated once; in the
two-process runtime the launcher allocates it in shared memory (CPU) or shares it by IPC handle
(CUDA) and both workers address the same storage. Page bookkeeping is the allocator's concern."""

from __future__ import annotations

import torch

from engines.model_config import ModelConfig


class KVPool:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tensor: torch.Tensor | None = None):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.num_pages, self.page_size = num_pages, page_size
        shape = self.shape_for(config, num_pages, page_size)
        if tensor is None:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(tensor.shape) != shape:
            raise ValueError(f"shared KV tensor has shape {tuple(tensor.shape)}, expected {shape}")
        self.tensor = tensor

    @staticmethod
    def shape_for(config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
        return config.num_hidden_layers, 2, config.num_key_value_heads, num_pages * page_size, config.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def pages_for_tokens(cls, max_total_tokens: int, page_size: int) -> int:
        return max(1, -(-max_total_tokens // page_size))
