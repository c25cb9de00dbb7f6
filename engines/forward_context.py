"""Per-step metadata read by the attention layers (positions, KV slots, per-sequence spans).

A step runs a packed batch: the new tokens of every sequence concatenated along one axis. Each
sequence has `q_len` new tokens appended after `ctx_len - q_len` tokens already in the paged pool.
The runner builds one `ForwardContext` per step; layers read it instead of threading a dozen
arguments through every call (nano-vllm's `Context`, made explicit)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.decode_groups import DecodePlan
from engines.model.paged_attention import PagedKernels, PagedPart, PagedTables


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64 position of each new token
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot (page * page_size + offset) of each new token
    q_lens: list[int]  # new tokens per sequence
    ctx_lens: list[int]  # total tokens per sequence after this step (cached + new)
    # Sequences whose whole context is new (plain prefill) attend over their fresh K/V directly.
    # The others gather their context from the pool through these slot tables:
    kv_slots: torch.Tensor | None = None  # [B, max_ctx] int64 slots, padded with 0
    kv_valid: torch.Tensor | None = None  # [B, 1, 1, max_ctx] bool, True where a slot is real
    # Decode fast path: all sequences have q_len == 1, attention is one batched call.
    all_decode: bool = False
    q_starts: list[int] = field(default_factory=list)
    # Built by the runner for eager CPU steps (None when a caller builds its own context, e.g. the
    # CUDA-graph tables, which then take the padded path above):
    rope_cos: torch.Tensor | None = None  # [T, 1, D] RoPE tables of `positions`, gathered once per step
    rope_sin: torch.Tensor | None = None
    decode_plan: DecodePlan | None = None  # every q_len == 1 sequence, in groups of one context width
    # The GPU path (engines.model.paged_attention): kernels read K/V from the pool's pages through
    # these tables; when set, attention takes it and the gather tables above stay None.
    paged: PagedTables | None = None
    # a step mixing decode rows with longer chunks: each kind on its own kernel (`split_mixed`), each
    # part with its own tables; `paged` then stays None (the whole step's tables would go unread)
    paged_parts: list[PagedPart] | None = None
    kernels: PagedKernels | None = None

    def __post_init__(self):
        if not self.q_starts:
            starts, acc = [], 0
            for n in self.q_lens:
                starts.append(acc)
                acc += n
            self.q_starts = starts

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
