"""The building blocks every model family shares: RMSNorm and the projections, in float or as the
int8 (W8A8) modules of `engines.quant` (attention, RoPE and SwiGLU's product are
`engines.model.attention`, `engines.model.rope` and `engines.model.fused`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.device import cpu_has_amx
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


# On a CPU with AMX, bfloat16 batches of more rows than the C kernel takes and at most WEIGHTS_FIRST_ROWS
# are multiplied weights-first (`_weights_first`); 0 turns it off (the decode benchmark's row-wise side)
WEIGHTS_FIRST_ROWS = 16


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias). A bfloat16 decode step's few rows on a CPU take the C kernel that reads
    the weights once for all rows (`engines.model.cpu_gemv`): torch's bfloat16 GEMMs over so few rows
    stream the weights far below the memory's rate there. A few more rows, on a CPU with AMX, go
    weights-first (`_weights_first`). Everything else is torch's GEMM."""
    if cpu_gemv.linear_available(x, weight):
        return cpu_gemv.linear(x, weight, bias)
    if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.dtype == torch.bfloat16
            and x.numel() <= WEIGHTS_FIRST_ROWS * x.shape[-1] and cpu_has_amx()):
        return _weights_first(x, weight, bias)
    return F.linear(x, weight, bias)


def _weights_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T computed as (weight @ x^T)^T. Why: oneDNN multiplies bfloat16 on AMX with its right
    operand packed into tiles; in x @ W^T that is the weight, packed anew from memory on every call,
    here it is the few rows. A whole bfloat16 decode step of SmolLM2-135M (Intel Xeon with AMX, one / two
    threads; artifact/benchmarks/bench_cpu_gemv.py, docs/cpu_gemv.md): batch 6 1.22x / 1.17x, 8 1.20x /
    1.13x, 16 1.13x / 1.08x faster than F.linear; at 32 (F.linear there) the two were within 1 %. A CPU
    without AMX was not measured and keeps F.linear. The same sums in another blocking, the bias added
    before the one rounding: results equal F.linear's within bfloat16 rounding."""
    rows = x.reshape(-1, x.shape[-1])
    out = weight @ rows.T if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows.T)
    return out.T.contiguous().view(*x.shape[:-1], weight.shape[0])  # the next layers read rows


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
