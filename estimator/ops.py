"""Inventory of the kernels of one Llama-family layer (plus embedding and LM head) for an execution
state: FLOPs, bytes moved and grid size of every kernel.

An execution state is a packed prefill (sequence lengths) and/or a decode batch (context lengths).
Linear and element-wise kernels see `T = sum(prefill lens) + decode batch` rows; their work is
affine in T (`TokenOp`), which is what lets the predictor precompute coefficients. Attention is not:
prefill attention grows with sum(s^2), decode attention with the total context read.

Byte counts are the minimum traffic to main memory: weights once, activations read and written
once, KV cache read once (decode) or written once (prefill and decode). `dtype_bytes` is the size of
weights, activations and KV cache alike (2 for bf16); `weight_bytes`, where given, that of the
projection weights alone (1 for FP8 weights; norms, embedding and LM head stay in `dtype_bytes`).

A mixture-of-experts layer (Qwen3-MoE) is priced by what it activates: its FLOPs are those of the
`num_experts_per_tok` experts each token routes to, and its expert weights are read once per expert
that some row of the batch routes to: under uniform routing, B rows picking k of E experts each
touch E * (1 - (1 - k/E)^B) experts on average (`expected_experts`): ~k per row for a few rows, all
E for a large batch. The routing's top-k and sort are not priced (a few values per row)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from engines.model_config import ModelConfig
from estimator.tiling import (
    FixedTiling,
    HeuristicTiling,
    decode_attention_grid,
    gemm_grid,
    prefill_attention_grid,
)

Tiling = FixedTiling | HeuristicTiling

# Calibration classes; each kernel has its own. The names of the Vidur profile columns they match
# are in `estimator.reference.data`.
LAYER_TOKEN_CLASSES = ("input_norm", "qkv_proj", "rope", "o_proj", "post_attn_norm",
                       "gate_up_proj", "act", "down_proj", "residual_add")
ATTENTION_CLASSES = ("attn_prefill", "attn_decode")
HEAD_CLASSES = ("embedding", "final_norm", "lm_head")
# a mixture-of-experts layer's MLP, in place of gate_up_proj, act and down_proj (no sweep times them yet)
MOE_CLASSES = ("router", "expert_gate_up", "expert_act", "expert_down")
ALL_CLASSES = LAYER_TOKEN_CLASSES + ATTENTION_CLASSES + HEAD_CLASSES + MOE_CLASSES


def expected_experts(rows: int, experts: int, top_k: int) -> float:
    """Distinct experts `rows` tokens route to, each picking `top_k` of `experts` uniformly at random
    (an expert escapes one token with probability 1 - k/E): E * (1 - (1 - k/E)^rows)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


@dataclass(frozen=True, slots=True)
class Op:
    """One kernel launch (run `count` times per layer) in a concrete execution state."""

    name: str
    flops: float
    bytes: float
    grid: int  # thread blocks; 0 = element-wise kernel, waves not modelled (memory-bound)
    size: int  # what calibration interpolates over: rows, or KV tokens for attention
    count: int = 1


@dataclass(frozen=True, slots=True)
class TokenOp:
    """A kernel whose FLOPs and bytes are affine in the number of rows it processes."""

    name: str
    flops_per_row: float
    bytes_fixed: float  # weights, read once whatever the batch
    bytes_per_row: float  # activations in and out
    cols: int = 0  # output features of a GEMM; 0 for element-wise kernels
    # launches per layer; of a model whose layers differ (dense MLPs among mixtures of experts), the
    # mean layer's: the fraction of layers that run it
    count: float = 1
    # a grouped GEMM over `experts` experts, each row routed to `top_k` of them: the weights of every
    # expert some row routes to are read once (`expected_experts`), `bytes_per_expert` each
    experts: int = 0
    top_k: int = 0
    bytes_per_expert: float = 0.0

    def bytes_at(self, rows: int) -> float:
        nbytes = self.bytes_fixed + self.bytes_per_row * rows
        if self.experts:
            nbytes += self.bytes_per_expert * expected_experts(rows, self.experts, self.top_k)
        return nbytes

    def grid_at(self, rows: int, tiling: Tiling) -> int:
        """Thread blocks of the launch: a grouped GEMM's are each active expert's over its share of
        the rows x top_k (routed) rows."""
        if not self.cols:
            return 0
        if not self.experts:
            return gemm_grid(rows, self.cols, tiling.gemm_tile(rows, self.cols))
        active = max(1, min(rows * self.top_k, round(expected_experts(rows, self.experts, self.top_k))))
        per_expert = -(-rows * self.top_k // active)
        return active * gemm_grid(per_expert, self.cols, tiling.gemm_tile(per_expert, self.cols))

    def at(self, rows: int, tiling: Tiling) -> Op:
        return Op(self.name, self.flops_per_row * rows, self.bytes_at(rows), self.grid_at(rows, tiling), rows, self.count)


def _gemm(name: str, k: int, n: int, dt: int, wt: int | None = None) -> TokenOp:
    return TokenOp(name, flops_per_row=2.0 * k * n, bytes_fixed=float(k * n * (dt if wt is None else wt)),
                   bytes_per_row=float((k + n) * dt), cols=n)


def _dense_mlp(i: int, h: int, dt: int, wt: int | None, count: float = 1) -> tuple[TokenOp, ...]:
    return (
        replace(_gemm("gate_up_proj", h, 2 * i, dt, wt), count=count),  # gate and up fused in one GEMM
        # silu(gate) * up: reads 2i, writes i; silu ~ 4 FLOPs + the product
        TokenOp("act", 5.0 * i, 0.0, 3.0 * i * dt, count=count),
        replace(_gemm("down_proj", i, h, dt, wt), count=count),
    )


def _moe_mlp(cfg: ModelConfig, dt: int, wt: int | None, count: float) -> tuple[TokenOp, ...]:
    """Router, then the experts each row routes to: their gate/up GEMM (each pick reads its row), the
    SwiGLU product, their down GEMM and the weighted sum of a row's picks (reads k rows, writes one)."""
    h, e, k, w = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    wt = dt if wt is None else wt
    routed = dict(experts=e, top_k=k, count=count)
    return (
        replace(_gemm("router", h, e, dt), count=count),  # the router stays in the activations' dtype
        TokenOp("expert_gate_up", 2.0 * h * 2 * w * k, 0.0, float((h + 2 * w) * k * dt), cols=2 * w,
                bytes_per_expert=float(2 * w * h * wt), **routed),
        TokenOp("expert_act", 5.0 * w * k, 0.0, 3.0 * w * k * dt, count=count),
        TokenOp("expert_down", 2.0 * w * h * k, 0.0, float(((w + h) * k + (k + 1) * h) * dt), cols=h,
                bytes_per_expert=float(w * h * wt), **routed),
    )


def layer_token_ops(cfg: ModelConfig, dtype_bytes: int = 2, weight_bytes: int | None = None) -> tuple[TokenOp, ...]:
    """The per-token kernels of one decoder layer, in execution order (attention excluded); of a model
    whose layers differ, its mean layer (each MLP's kernels counted by the fraction of layers that
    run them). `weight_bytes`: the projections' weights, if not stored in `dtype_bytes`."""
    h, i, q, kv, dt, wt = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, dtype_bytes, weight_bytes
    norm = dict(flops_per_row=4.0 * h, bytes_fixed=float(h * dt), bytes_per_row=2.0 * h * dt)
    # rotates q and k: read and write both, ~3 FLOPs per element; a family that RMS-normalizes q and k
    # heads first (qk_norm: the layer's same `rotate` stage) passes over them once more, ~4 FLOPs each
    passes = 1 + cfg.qk_norm
    sparse = len(cfg.moe_layers) / cfg.num_hidden_layers
    mlp = ((_moe_mlp(cfg, dt, wt, sparse) if sparse else ())
           + (_dense_mlp(i, h, dt, wt, 1 - sparse if sparse else 1) if sparse < 1 else ()))
    return (
        TokenOp("input_norm", **norm),
        _gemm("qkv_proj", h, q + 2 * kv, dt, wt),
        TokenOp("rope", (3.0 + 4.0 * cfg.qk_norm) * (q + kv), 0.0, 2.0 * passes * (q + kv) * dt),
        _gemm("o_proj", q, h, dt, wt),
        TokenOp("post_attn_norm", **norm),
        *mlp,
        # two residual adds per layer (after attention, after MLP): read 2 vectors, write 1
        TokenOp("residual_add", float(h), 0.0, 3.0 * h * dt, count=2),
    )


def head_token_ops(cfg: ModelConfig, dtype_bytes: int = 2) -> tuple[TokenOp, ...]:
    """Embedding lookup and final norm (over all rows) and the LM head (over the output rows)."""
    h, dt = cfg.hidden_size, dtype_bytes
    return (
        TokenOp("embedding", 0.0, 0.0, 2.0 * h * dt),  # gather a row, write it
        TokenOp("final_norm", 4.0 * h, float(h * dt), 2.0 * h * dt),
        _gemm("lm_head", h, cfg.vocab_size, dt),
    )


def prefill_attention(cfg: ModelConfig, seq_lens: Sequence[int], dtype_bytes: int = 2) -> Op:
    """Causal self-attention of a packed prefill (no cached prefix): QK^T and PV over the lower
    triangle, 2*d*s(s+1)/2 FLOPs each per head; reads Q, K, V, writes O and the new KV cache."""
    heads, d, q, kv = cfg.num_attention_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    tokens = sum(seq_lens)
    square = sum(s * (s + 1) for s in seq_lens)
    return Op("attn_prefill", flops=2.0 * heads * d * square,
              bytes=float(tokens * (2 * q + 4 * kv) * dtype_bytes),
              grid=prefill_attention_grid(seq_lens, heads), size=tokens)


def chunk_attention_pairs(chunk_lens: Sequence[int], prefix_lens: Sequence[int]) -> int:
    """(query, key) pairs of prefill chunks that each attend to a cached prefix and, causally, to
    themselves: a chunk of c new tokens after p cached ones has c*p + c(c+1)/2."""
    return sum(c * p + c * (c + 1) // 2 for c, p in zip(chunk_lens, prefix_lens))


def chunked_prefill_attention(cfg: ModelConfig, chunk_lens: Sequence[int], prefix_lens: Sequence[int],
                              dtype_bytes: int = 2) -> Op:
    """Prefill chunks attending to their already-cached prefix (chunked prefill, Bullet §2.3.2): the
    work of `prefill_attention` plus every new query against the prefix, and the prefix's K and V
    read back from the cache ("KV reloads"). With empty prefixes this is `prefill_attention`."""
    if len(chunk_lens) != len(prefix_lens):
        raise ValueError("one prefix length per prefill chunk")
    heads, d, q, kv = cfg.num_attention_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    tokens = sum(chunk_lens)
    return Op("attn_prefill", flops=4.0 * heads * d * chunk_attention_pairs(chunk_lens, prefix_lens),
              bytes=float((tokens * (2 * q + 4 * kv) + 2 * kv * sum(prefix_lens)) * dtype_bytes),
              grid=prefill_attention_grid(chunk_lens, heads), size=tokens)


def decode_attention(cfg: ModelConfig, batch: int, sum_ctx: int, dtype_bytes: int = 2) -> Op:
    """One query token per request against its whole context (the new token included): reads the
    KV cache, Q, writes O and the new token's K and V."""
    heads, d, q, kv = cfg.num_attention_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    return Op("attn_decode", flops=4.0 * heads * d * sum_ctx,
              bytes=float((2 * kv * sum_ctx + batch * (2 * q + 2 * kv)) * dtype_bytes),
              grid=decode_attention_grid(batch, sum_ctx, cfg.num_key_value_heads), size=sum_ctx)


@dataclass(frozen=True)
class ExecutionState:
    """What one step runs: a packed prefill and/or a decode batch (a hybrid batch has both)."""

    prefill_lens: tuple[int, ...] = ()
    decode_ctx_lens: tuple[int, ...] = ()
    tokens: int = field(init=False)
    # tokens of each prefill chunk's prompt already in the KV cache (chunked prefill); empty = none
    prefill_prefix_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prefill_prefix_lens and len(self.prefill_prefix_lens) != len(self.prefill_lens):
            raise ValueError("prefill_prefix_lens needs one entry per prefill chunk")
        object.__setattr__(self, "tokens", sum(self.prefill_lens) + len(self.decode_ctx_lens))

    @property
    def output_rows(self) -> int:
        """Rows that reach the LM head: the last token of each prefill, every decode request."""
        return len(self.prefill_lens) + len(self.decode_ctx_lens)


def layer_ops(cfg: ModelConfig, state: ExecutionState, dtype_bytes: int = 2,
              tiling: Tiling = FixedTiling(), attention_per_sequence: bool = False,
              weight_bytes: int | None = None) -> list[Op]:
    """Every kernel of one decoder layer for `state`, in execution order (with
    `attention_per_sequence`, a packed prefill's attention as one kernel per sequence)."""
    tokens = state.tokens
    ops = [op.at(tokens, tiling) for op in layer_token_ops(cfg, dtype_bytes, weight_bytes)]
    attention = []
    if state.prefill_lens and any(state.prefill_prefix_lens):
        attention.append(chunked_prefill_attention(cfg, state.prefill_lens, state.prefill_prefix_lens, dtype_bytes))
    elif state.prefill_lens and attention_per_sequence:
        attention += [prefill_attention(cfg, (s,), dtype_bytes) for s in state.prefill_lens]
    elif state.prefill_lens:
        attention.append(prefill_attention(cfg, state.prefill_lens, dtype_bytes))
    if state.decode_ctx_lens:
        attention.append(decode_attention(cfg, len(state.decode_ctx_lens), sum(state.decode_ctx_lens),
                                          dtype_bytes))
    return ops[:3] + attention + ops[3:]  # attention runs after RoPE, before the O projection


def head_ops(cfg: ModelConfig, state: ExecutionState, dtype_bytes: int = 2,
             tiling: Tiling = FixedTiling()) -> list[Op]:
    embedding, final_norm, lm_head = head_token_ops(cfg, dtype_bytes)
    return [embedding.at(state.tokens, tiling), final_norm.at(state.tokens, tiling),
            lm_head.at(state.output_rows, tiling)]
