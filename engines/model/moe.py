"""The mixture-of-experts MLP of Qwen3-MoE's sparse layers.

A router (a linear map hidden -> experts) scores every expert for every token; the scores go
through a softmax in float32, the `top_k` most probable experts are kept, and where the config says
`norm_topk_prob` their probabilities are renormalised to sum to 1. Each picked expert is a SwiGLU
MLP of its own (gate/up fused in one [2I, H] matrix, gate rows first, then down [H, I]); a token's
output is the sum of its experts' outputs times their probabilities.

`grouped_experts` is the path of every device: the (token,
pick) rows are sorted by expert, so each expert that any token picked runs once, as two GEMMs over
its own rows (SwiGLU's product between them is `fused.silu_mul`, one kernel on a GPU); the results
go back to their rows, are weighted and summed over the picks. It reads the per-expert row counts on
the host, so a CUDA decode graph cannot capture it (`engines.cuda_graphs.graph_blocker` says so)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.model import fused


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64), the
    most probable expert first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """x [T, H], weights/ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H]: one GEMM pair per
    expert that some row picked, over the rows that picked it."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, pick) rows, grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x[order // k]
    out = torch.empty((t * k, x.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            end = start + n
            out[start:end] = F.linear(fused.silu_mul(F.linear(rows[start:end], gate_up[expert])), down[expert])
            start = end
    per_pick = torch.empty_like(out)
    per_pick[order] = out  # back to (token, pick) order
    return (per_pick.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def _triton_moe():
    """The GPU kernels, where there are some (None: every device takes the grouped path)."""
    return None


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and fused.ENABLED and _triton_moe() is not None:
        return _triton_moe().fused_experts(x, weights, ids, gate_up, down)
    return grouped_experts(x, weights, ids, gate_up, down)


def runs_on_host_counts(device: torch.device) -> bool:
    """Whether the experts on `device` read their row counts on the host (then no CUDA graph)."""
    return device.type != "cuda" or not fused.ENABLED or _triton_moe() is None


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs as two stacked tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, weights, ids, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    """Router and experts: [T, H] -> [T, H]."""

    def __init__(self, hidden: int, num_experts: int, width: int, top_k: int, renormalize: bool):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, width)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"
