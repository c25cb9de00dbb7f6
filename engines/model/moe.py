"""The mixture-of-experts MLP of Qwen3-MoE's sparse layers.

A router (a linear map hidden -> experts) scores every expert for every token; the scores go
through a softmax in float32, the `top_k` most probable experts are kept, and where the config says
`norm_topk_prob` their probabilities are renormalised to sum to 1. Each picked expert is a SwiGLU
MLP of its own (gate/up fused in one [2I, H] matrix, gate rows first, then down [H, I]); a token's
output is the sum of its experts' outputs times their probabilities.

On a CPU a decode-sized batch (at most `CPU_KERNEL_TOKENS` tokens) runs its experts in the C kernel of
`engines.model.cpu_gemv` (each picked expert's weights read once for all its rows); on a CPU with AMX a
larger bfloat16 batch runs them there too, on the tiles (`TILE_EXPERT_ROWS`). Otherwise
`grouped_experts` is the path of every device: the (token,
pick) rows are sorted by expert, so each expert that any token picked runs once, as two GEMMs over
its own rows (SwiGLU's product between them is `fused.silu_mul`, one kernel on a GPU); the results
go back to their rows, are weighted and summed over the picks. On a CPU the experts that a few rows
picked run in the C kernel (`KERNEL_EXPERT_ROWS`), or where it is not built in a form measured faster
there: weight @ columns in float32 (`_expert_columns`), torch's own GEMM instead of oneDNN's in
bfloat16 (`_without_onednn`); on a CPU with AMX, bfloat16 experts of up to `WEIGHTS_FIRST_ROWS` rows
run weights-first (`_expert_weights_first`). It
reads the per-expert row counts on the host, so a CUDA decode graph cannot capture it. On CUDA
tensors the Triton kernels of `engines.model.triton_moe` run instead (the same computation, no host read: graphs capture them),
where triton imports and the fused kernels are on (`BULLET_FUSED_KERNELS`); else the grouped path,
and `engines.cuda_graphs.graph_blocker` keeps decode eager."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engines import kernel_fallbacks
from engines.device import cpu_has_amx
from engines.model import cpu_gemv, fused

log = logging.getLogger("engines.moe")


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
    # whole rows copied: x[index] took 3-12x as long for a 512-token prefill's 4096 rows (measured)
    rows = x.index_select(0, order // k)
    out = torch.empty((t * k, x.shape[1]), dtype=x.dtype, device=x.device)
    cpu = x.device.type == "cpu" and not fused.fused_on(x)
    kernel = KERNEL_EXPERT_ROWS if cpu and cpu_gemv.available(x, gate_up, down) else 0
    columns = COLUMN_ROWS if cpu and x.dtype == torch.float32 else 0
    # (where torch's backend flags are frozen, `_without_onednn` may not switch: oneDNN then runs them)
    native = NATIVE_BF16_ROWS if cpu and x.dtype == torch.bfloat16 and not torch.backends.flags_frozen() else 0
    weights_first = WEIGHTS_FIRST_ROWS if cpu and x.dtype == torch.bfloat16 and cpu_has_amx() else 0
    few: list[torch.Tensor] = []  # rows of the experts the C kernel runs
    start = 0
    for expert, n in enumerate(counts):
        if n:
            end = start + n
            if n <= kernel:
                few.append(torch.arange(start, end, device=x.device))
            elif n <= columns:
                out[start:end] = _expert_columns(rows[start:end], gate_up[expert], down[expert])
            elif n <= native:
                with _without_onednn():
                    out[start:end] = _expert_rows(rows[start:end], gate_up[expert], down[expert])
            elif n <= weights_first:
                out[start:end] = _expert_weights_first(rows[start:end], gate_up[expert], down[expert])
            else:
                out[start:end] = _expert_rows(rows[start:end], gate_up[expert], down[expert])
            start = end
    if few:
        # each row its own token of one pick, weight 1 (exact): the kernel's output is the expert's, rounded once
        few_rows = torch.cat(few)
        picked = flat.index_select(0, order.index_select(0, few_rows)).unsqueeze(1)
        out.index_copy_(0, few_rows, cpu_gemv.experts(rows.index_select(0, few_rows),
                                                      torch.ones(picked.shape, dtype=torch.float32), picked,
                                                      gate_up, down))
    # back to (token, pick) order, then each token's picks weighted and summed in one batched product
    # (float32 accumulation, one rounding): 2-3x faster than a scatter and a [T, k, H] product (measured)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_pick = out.index_select(0, inverse).view(t, k, -1)
    return torch.bmm(weights.to(out.dtype).unsqueeze(1), per_pick).squeeze(1)


# On a CPU, the experts of a large batch (prefill's) that at most KERNEL_EXPERT_ROWS rows picked run in the
# C kernel of `engines.model.cpu_gemv`, which reads their weights once at the memory's rate; 0 turns it off.
# Why: in a 512-token prefill of the MoE benchmark (artifact/benchmarks/bench_moe.py, one thread of an
# Intel Xeon with AMX, weights cold), an expert of 1-4 rows took ~1 ms through oneDNN or MKL, and the
# prefill's experts took 559 ms with these in the kernel against 622 without (bfloat16; limits of 8 and 16
# took 618 and 606 ms, and within 4 % of 4's on two threads and in float32; docs/moe_cpu.md): past a few
# rows the GEMMs' compute wins
KERNEL_EXPERT_ROWS = 4


# On a CPU, an expert with at most COLUMN_ROWS rows runs weights-first in float32 (`_expert_columns`),
# one with at most NATIVE_BF16_ROWS rows in bfloat16 runs on torch's own GEMM (`_without_onednn`); 0
# turns either off (the benchmark times the MoE with both off beside it)
COLUMN_ROWS = 3
NATIVE_BF16_ROWS = 2


# On a CPU with AMX, a bfloat16 expert of at most WEIGHTS_FIRST_ROWS rows (past the forms above) runs
# weights-first (`_expert_weights_first`); 0 turns it off (the benchmark's --rowwise side)
WEIGHTS_FIRST_ROWS = 256


def _expert_weights_first(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU over its rows [n, H] -> [n, H] as W @ x^T: gate_up @ rows^T, SwiGLU over each
    row's gate and up halves (read through the transposed view), down @ that.

    Why: oneDNN multiplies bfloat16 on AMX with its right operand packed into tiles. In x @ W^T that
    operand is the expert's weight, which every call packs anew, and a prefill's experts are read cold
    (a 512-token prompt touches most of them); here it is the few rows, and the weight is read as it
    lies. One thread of an Intel Xeon with AMX, an expert of 768x1024 and 1024x384 read from memory:
    x @ W^T took 0.42, 0.40, 0.55, 1.01 and 1.51 ms at 5, 16, 64, 256 and 512 rows, this form 0.31,
    0.29, 0.39, 0.75 and 1.25 ms (1.21-1.41x); on two threads 1.08-1.41x up to 256 rows but 0.81x at
    512. In float32 (MKL) neither form won (0.74-1.20x), and a CPU without AMX was not measured: both
    keep x @ W^T. The same sums in another blocking: results equal the row form's within bfloat16
    rounding."""
    # views throughout, not `layers._weights_first` twice: its contiguous rows cost this prefill 8-10 %
    h = (gate_up @ rows.T).T  # [n, 2I], a view
    width = h.shape[1] // 2
    act = F.silu(h[:, :width]) * h[:, width:]  # SwiGLU's product (fused.silu_mul_reference)
    return (down @ act.T).T


def _expert_rows(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU over its rows [n, H] -> [n, H]: x @ W^T twice."""
    return F.linear(fused.silu_mul(F.linear(rows, gate_up)), down)


@contextlib.contextmanager
def _without_onednn():
    """torch's own CPU GEMM for the block instead of oneDNN's. Why: in bfloat16 an expert's SwiGLU
    over 1, 2 and 3 rows took 320, 326 and 324 us through oneDNN (MKL-DNN 3.12, one thread of an
    AVX-512-BF16 EPYC, an expert of 768x1024 and 1024x384: ~7 GB/s of weights) and 168, 265 and 382
    us through torch's own kernels. The same sums with float32 accumulation in another order:
    results equal within bfloat16 rounding. The switch is process-wide, so it is put back at once (a
    worker's forward runs on one Python thread; another thread's GEMM in that window would take
    torch's kernels too, with results equal within the same rounding)."""
    kept = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = kept


def _expert_columns(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU over a few rows [n, H] -> [n, H], as weight @ columns: gate_up @ x^T
    [2I, n], SwiGLU over its row halves, down @ that [H, n].

    Why: a decode step runs each picked expert for one to three rows, so its time is the bytes of the
    expert's matrices. On a CPU in float32 (MKL, one thread of an AVX-512 EPYC, an expert of
    768x1024 and 1024x384) x @ W^T took 405, 592 and 703 us for 1, 2 and 3 rows (its matrix-vector
    product streamed the down projection's 384-long rows at 9 GB/s, its 2- and 3-row GEMMs slower
    still), this form 298, 304 and 402 us (13-19 GB/s); at 4 rows both took ~560 us. A single row is
    given a second, equal column so that it takes the matrix product too. The same sums in another
    order: the results equal the row form's within float32 rounding (as the row form's own results
    for a row already differ with how many rows share its GEMM). In bfloat16 this form was slower
    than the row form (`_without_onednn` is bfloat16's)."""
    n = rows.shape[0]
    # each right operand is the transposed view of contiguous rows: given as a contiguous [K, n]
    # matrix instead, MKL took a path 5x slower (measured)
    cols = (rows if n > 1 else rows.expand(2, -1)).contiguous().T  # [H, n or 2]
    h = gate_up @ cols
    width = h.shape[0] // 2
    act = (F.silu(h[:width]) * h[width:]).T.contiguous()  # SwiGLU's product (fused.silu_mul_reference), rows
    return (down @ act.T)[:, :n].T


@functools.lru_cache(maxsize=1)
def _triton_moe():
    """The GPU kernels, or None where triton does not import (then every device takes the grouped path)."""
    try:
        from engines.model import triton_moe  # deferred: triton is optional
    except ImportError:
        return None
    return triton_moe


_TRITON_FAILED: list[str] = []  # set once the kernels failed to compile or launch here


# On a CPU, a batch of at most CPU_KERNEL_TOKENS tokens (decode's) runs its experts in the C kernel
# (`engines.model.cpu_gemv`); 0 turns it off (the benchmark times the grouped path beside it)
CPU_KERNEL_TOKENS = 64


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """The Triton kernels on CUDA tensors, else (or once they failed on this GPU) the grouped path;
    on a CPU, decode-sized batches in the C kernel."""
    if triton_on(x):
        try:
            return _triton_moe().fused_experts(x, weights, ids, gate_up, down)
        except Exception as exc:  # e.g. a toolchain this Triton cannot drive: serve on, slower
            log.warning("Triton MoE kernels failed (%s: %s): the experts run grouped in torch from now on",
                        type(exc).__name__, exc)
            _TRITON_FAILED.append(repr(exc))
            kernel_fallbacks.record("triton MoE experts", "grouped experts in torch", exc)
    # (not where the fused GPU stages are on: the tests run that path on CPU tensors)
    elif (x.shape[0] > CPU_KERNEL_TOKENS and TILE_EXPERT_ROWS and not fused.fused_on(x)
          and cpu_gemv.tiles_available(x, gate_up, down)):
        return tiled_experts(x, weights, ids, gate_up, down)
    elif x.shape[0] <= CPU_KERNEL_TOKENS and not fused.fused_on(x) and cpu_gemv.available(x, gate_up, down):
        return cpu_gemv.experts(x, weights, ids, gate_up, down)
    return grouped_experts(x, weights, ids, gate_up, down)


# On a CPU with AMX, a bfloat16 batch of more than CPU_KERNEL_TOKENS tokens (prefill's) runs its experts in
# the C kernel, those that at least TILE_EXPERT_ROWS rows picked on AMX tiles (csrc/cpu_amx.c); 0 turns
# this off (the benchmark's --untiled side). Why: the MoE benchmark's 512-token prefill
# (artifact/benchmarks/bench_moe.py, an Intel Xeon with AMX, docs/moe_cpu.md) spent 347 ms in its experts
# through the grouped path and 177 ms here on one thread (245 -> 90 ms on two; with picks spread
# uniformly, 598 -> 282 ms on one). Sending the experts of fewer rows to the decode kernel's dot products
# instead (TILE_EXPERT_ROWS 2 or 4: 568 and 557 ms for the whole prefill step against 556, alternating
# rounds) gained nothing, so every expert takes the tiles. Decode batches keep the decode kernel, whose
# results do not depend on the batch.
TILE_EXPERT_ROWS = 1
# Each thread keeps float32 sums [tokens, hidden] until the end of a call: a call takes at most this many
# bytes of them, so a long prompt goes in slices of tokens
TILE_CALL_BYTES = 64 << 20


def tiled_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The C kernel with AMX tiles, over slices of the batch that keep its sums within TILE_CALL_BYTES."""
    per_call = max(1, TILE_CALL_BYTES // (torch.get_num_threads() * x.shape[1] * 4))
    if x.shape[0] <= per_call:  # one call, and no copy of its result
        return cpu_gemv.experts(x, weights, ids, gate_up, down, tile_rows=TILE_EXPERT_ROWS)
    return torch.cat([cpu_gemv.experts(x[i:i + per_call], weights[i:i + per_call], ids[i:i + per_call], gate_up, down,
                                       tile_rows=TILE_EXPERT_ROWS) for i in range(0, x.shape[0], per_call)])


def triton_on(x: torch.Tensor) -> bool:
    """Whether `x`'s experts take the Triton kernels (the tests turn them on for CPU tensors, which
    Triton's interpreter runs)."""
    return x.is_cuda and not runs_on_host_counts(x.device)


def runs_on_host_counts(device: torch.device) -> bool:
    """Whether the experts on `device` read their row counts on the host (then no CUDA graph)."""
    return device.type != "cuda" or not fused.ENABLED or bool(_TRITON_FAILED) or _triton_moe() is None


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
