"""Rotary position embedding, including Llama-3.1 frequency scaling.

Layout is the Hugging Face one (rotate the two halves of each head), so Q/K weights must be in
HF order; the GGUF loader un-permutes llama.cpp's interleaved layout on load."""

from __future__ import annotations

import math

import torch

from engines.model import fused
from engines.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq.float()
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, blended)
    scaled = torch.where(wavelen < high_wavelen, inv_freq, scaled)
    return scaled.float()


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables computed up to the longest position seen so far (grown on demand), so a
    131k-context config does not allocate its whole table up front."""

    def __init__(self, config: ModelConfig, initial_positions: int = 4096):
        super().__init__()
        self.max_positions = config.max_position_embeddings
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self._cos = self._sin = None
        self._grow(min(initial_positions, self.max_positions))

    def _grow(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D]; returns rotated copies in the input dtype."""
        self.reserve(int(positions.max()) + 1 if positions.numel() else 0)
        return self.rotate(positions, q, k)

    # -- for CUDA graphs (engines/cuda_graphs.py): `forward` and `tables` read the largest position back
    # to the host, which a graph capture forbids; a captured step reserves its positions once, then
    # looks them up (`lookup`) or rotates (`rotate`).
    def reserve(self, need: int) -> None:
        """Make the tables cover positions 0 .. need - 1."""
        if need > self._cos.shape[0]:
            if need > self.max_positions:
                raise ValueError(f"position {need - 1} exceeds the model's context ({self.max_positions})")
            self._grow(min(self.max_positions, max(need, 2 * self._cos.shape[0])))

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """`forward` without the table check: positions must already be reserved."""
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of a step's positions: gathered once per step (the runner puts them in
        the ForwardContext) instead of once per layer."""
        self.reserve(int(positions.max()) + 1 if positions.numel() else 0)
        return self.lookup(positions)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tables` without the table check (no host read: a CUDA graph body may call it): positions
        must already be reserved."""
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [T, heads, D] with per-step tables: Q and K heads rotated in one call (the layer passes
    both as one view of its QKV output), the same arithmetic as `RotaryEmbedding.rotate`."""
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # float32 arithmetic, the result in x's dtype; one kernel on a GPU (`fused.rope`)
    return fused.rope(x, cos, sin)
