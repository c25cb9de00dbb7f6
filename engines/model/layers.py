"""The building blocks every model family shares: RMSNorm and the projections, in float or as the
int8 (W8A8) modules of `engines.quant` (attention, RoPE and SwiGLU's product are
`engines.model.attention`, `engines.model.rope` and `engines.model.fused`)."""

from __future__ import annotations

import torch
from torch import nn

from engines.model import fused
from engines.quant.int8 import Int8Linear


class RMSNorm(nn.Module):
    """Over the last dimension: a hidden state [T, hidden], or each head of q/k [T, heads, head_dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)  # float32 statistics; one kernel on a GPU


def linear(in_features: int, out_features: int, int8_block: int | None, block: int = 0,
           norm_eps: float | None = None, bias: bool = False) -> nn.Module:
    """A float projection, or an int8 one (which takes over the RMSNorm before it, if `norm_eps`)."""
    if int8_block is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return Int8Linear(in_features, out_features, block, norm_eps, bias)


def pre_norm(dim: int, eps: float, int8_block: int | None) -> nn.Module:
    """The RMSNorm before a projection that reads the residual stream. int8 models fold its weight
    into that projection, which applies the norm itself (Int8Linear.norm_eps)."""
    return RMSNorm(dim, eps) if int8_block is None else nn.Identity()
