"""The building blocks every model family shares: RMSNorm and the projections, in float or as the
int8 (W8A8) modules of `engines.quant` (attention, RoPE and SwiGLU's product are
`engines.model.attention`, `engines.model.rope` and `engines.model.fused`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.model import cpu_gemv, fused
from engines.quant.int8 import Int8Linear


class RMSNorm(nn.Module):
    """Over the last dimension: a hidden state [T, hidden], or each head of q/k [T, heads, head_dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)  # float32 statistics; one kernel on a GPU


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias). A bfloat16 decode step's few rows on a CPU take the C kernel that reads
    the weights once for all rows (`engines.model.cpu_gemv`): torch's bfloat16 GEMMs over so few rows
    stream the weights far below the memory's rate there. Everything else is torch's GEMM."""
    if cpu_gemv.linear_available(x, weight):
        return cpu_gemv.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class FloatLinear(nn.Linear):
    """`nn.Linear` (its parameters, its name in checkpoints), multiplied by `float_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, self.weight, self.bias)


def linear(in_features: int, out_features: int, int8_block: int | None, block: int = 0,
           norm_eps: float | None = None, bias: bool = False) -> nn.Module:
    """A float projection, or an int8 one (which takes over the RMSNorm before it, if `norm_eps`)."""
    if int8_block is None:
        return FloatLinear(in_features, out_features, bias=bias)
    return Int8Linear(in_features, out_features, block, norm_eps, bias)


def pre_norm(dim: int, eps: float, int8_block: int | None) -> nn.Module:
    """The RMSNorm before a projection that reads the residual stream. int8 models fold its weight
    into that projection, which applies the norm itself (Int8Linear.norm_eps)."""
    return RMSNorm(dim, eps) if int8_block is None else nn.Identity()
