"""Runs the model on a packed batch of sequence chunks: builds the per-step ForwardContext, runs
all layers at once or a few layers at a time (layer-wise prefill), and returns the logits the
caller asked for. Knows nothing about requests, queues or sampling."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engines.decode_groups import plan_decode
from engines.forward_context import ForwardContext
from engines.kv_pool import KVPool
from engines.model.llama import LlamaModel
from engines.model.paged_attention import PagedKernels, build_tables, kernels_for, split_mixed
from engines.quant.int8 import Int8Embedding

# Prompt attention (SDPA) on a GPU may use any backend but cuDNN's. On Hopper torch may pick cuDNN,
# which builds a graph per new sequence length. On an H200 (torch 2.11, 2026-11-26) the first layer
# group of every prompt of a new length took 50-70 ms longer than the next ones, whatever its size
# (more than a whole 2048-token prefill), and only fresh prompts (SDPA) paid it, not chunks over a
# cached prefix (the Triton kernel): a per-shape set-up. Prompts rarely repeat a length, so every
# prefill paid it. Flash attention (GQA, causal, no mask: our case) has none; the engine benchmark
# times prompts of new lengths under both choices (`bench_engine_gpu`, "new_lengths").
PROMPT_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prompt_attention_backends(device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends a runner on `device` allows (None: torch's choice, on a CPU)."""
    return PROMPT_ATTENTION_BACKENDS if device.type == "cuda" else None


@dataclass
class SeqChunk:
    """New tokens of one sequence: `token_ids` go after `start` tokens already in the pool.
    `page_table` must cover start + len(token_ids) tokens. `logits`: "last" (next-token logits),
    "all" (every position, for prompt logprobs) or "none" (a middle chunk of a chunked prefill)."""

    token_ids: list[int]
    start: int
    page_table: list[int]
    logits: str = "last"


@dataclass
class StepOutput:
    last_logits: torch.Tensor  # [num chunks with logits != "none", vocab] float32
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk index -> [len, vocab]


@dataclass
class LayerwiseState:
    """An in-flight batch between layer steps: the residual stream after `next_layer` layers."""

    chunks: list[SeqChunk]
    hidden: torch.Tensor
    ctx: ForwardContext
    next_layer: int = 0


class ModelRunner:
    """`paged`: attention reads the pool's pages through page tables (`paged_attention`) instead of
    gathering each step's context — the default on CUDA, and on a CPU for the int8 model where the
    in-place C kernel serves its pool (`engines.model.cpu_attention`); float models on a CPU keep
    the gather path, so the fp32 reference stays bit for bit. `kernels` picks the implementation
    (default `kernels_for(device, compute dtype, pool dtype)`)."""

    def __init__(self, model: LlamaModel, kv: KVPool, device: torch.device | str = "cpu", paged: bool | None = None,
                 kernels: PagedKernels | None = None):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.page_size = kv.page_size
        self.max_context = model.config.max_position_embeddings
        quantized = isinstance(model.embed_tokens, Int8Embedding)
        # what attention computes in (the pool may store another dtype: --kv-cache-dtype)
        self.compute_dtype = torch.float32 if quantized else model.embed_tokens.weight.dtype
        if paged is None and self.device.type != "cuda":
            # on a CPU only the int8 model pages, and only through the in-place kernel (the torch
            # reference, e.g. under BULLET_ATTENTION_KERNELS=torch, is slower than the gather path)
            if kernels is None and quantized:
                kernels = kernels_for(self.device, self.compute_dtype, kv.tensor.dtype)
            paged = quantized and getattr(kernels, "name", None) == "cpu"
        self.paged = True if paged is None else paged
        if self.paged and kernels is None:
            kernels = kernels_for(self.device, self.compute_dtype, kv.tensor.dtype)
        self.kernels = kernels if self.paged else None
        self.sdpa_backends = prompt_attention_backends(self.device)
        # a paged step mixing decode rows and chunks runs each kind on its own kernel (`split_mixed`);
        # False: one extend over every row, what the engine benchmark times beside it
        self.split_mixed = True

    # -- batch preparation -------------------------------------------------------------------
    def _context(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, ForwardContext]:
        ps = self.page_size
        ids, positions, slots, q_lens, ctx_lens = [], [], [], [], []
        for c in chunks:
            n, end = len(c.token_ids), c.start + len(c.token_ids)
            if n == 0:
                raise ValueError("a chunk needs at least one new token")
            if end > self.max_context:
                raise ValueError(f"sequence of {end} tokens exceeds the model context ({self.max_context})")
            if len(c.page_table) * ps < end:
                raise ValueError(f"page table covers {len(c.page_table) * ps} tokens, chunk needs {end}")
            pos = np.arange(c.start, end, dtype=np.int64)
            table = np.asarray(c.page_table, dtype=np.int64)
            ids.extend(c.token_ids)
            positions.append(pos)
            slots.append(table[pos // ps] * ps + pos % ps)
            q_lens.append(n)
            ctx_lens.append(end)
        dev = self.device
        ctx = ForwardContext(
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            q_lens=q_lens, ctx_lens=ctx_lens, all_decode=all(n == 1 for n in q_lens),
        )
        ctx.rope_cos, ctx.rope_sin = self.model.rope.tables(ctx.positions)
        if self.paged:
            page_tables = [c.page_table for c in chunks]
            if self.split_mixed and not ctx.all_decode:
                ctx.paged_parts = split_mixed(page_tables, ctx_lens, q_lens, ps, dev)
            if ctx.paged_parts is None:  # a split step's parts carry their own tables: no whole-step copy
                ctx.paged = build_tables(page_tables, ctx_lens, q_lens, ps, dev)
            ctx.kernels = self.kernels
        elif ctx.all_decode or any(c.start > 0 for c in chunks):
            table, valid = self._context_slots(chunks, ctx_lens)
            ctx.kv_slots = torch.from_numpy(table).to(dev)
            ctx.kv_valid = torch.from_numpy(valid).to(dev).view(len(chunks), 1, 1, table.shape[1])
            decode = np.flatnonzero(np.asarray(q_lens) == 1)
            if len(decode):
                lens = np.asarray(ctx_lens, dtype=np.int64)
                rows = np.asarray(ctx.q_starts, dtype=np.int64)[decode]
                ctx.decode_plan = plan_decode(rows, lens[decode], table[decode], self.kv.tensor.shape[2],
                                              self.kv.num_slots, self.compute_dtype, dev)
        return torch.tensor(ids, dtype=torch.long, device=dev), ctx

    def _context_slots(self, chunks: list[SeqChunk], ctx_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """[sequences, longest context] slot table (padded with slot 0) and its validity."""
        ps, max_ctx = self.page_size, max(ctx_lens)
        max_pages = -(-max_ctx // ps)
        table = np.zeros((len(chunks), max_pages), dtype=np.int64)
        for i, c in enumerate(chunks):
            used = -(-ctx_lens[i] // ps)
            table[i, :used] = c.page_table[:used]
        pos = np.arange(max_ctx, dtype=np.int64)
        slots = table[:, pos // ps] * ps + pos % ps
        valid = pos[None, :] < np.asarray(ctx_lens, dtype=np.int64)[:, None]
        return slots, valid

    # -- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, chunks: list[SeqChunk]) -> LayerwiseState:
        ids, ctx = self._context(chunks)
        return LayerwiseState(chunks, self.model.embed(ids), ctx)

    @torch.inference_mode()
    def run_layers(self, state: LayerwiseState, num_layers: int | None = None) -> bool:
        """Advance by `num_layers` (all remaining if None); True once every layer has run."""
        end = self.model.num_layers if num_layers is None else min(self.model.num_layers, state.next_layer + num_layers)
        # once per layer group, not per attention call (entering it costs ~25 us)
        with sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else nullcontext():
            state.hidden = self.model.forward_layers(state.hidden, state.next_layer, end, state.ctx, self.kv.tensor)
        state.next_layer = end
        return end == self.model.num_layers

    @torch.inference_mode()
    def finish(self, state: LayerwiseState) -> StepOutput:
        if state.next_layer != self.model.num_layers:
            raise RuntimeError(f"finish() after {state.next_layer} of {self.model.num_layers} layers")
        rows, all_logits = [], {}
        for i, (c, start) in enumerate(zip(state.chunks, state.ctx.q_starts)):
            n = len(c.token_ids)
            if c.logits == "all":
                all_logits[i] = self.model.compute_logits(state.hidden[start : start + n])
            if c.logits != "none":
                rows.append(start + n - 1)
        if all_logits and len(all_logits) == len(rows):  # every last row is already computed
            last = torch.stack([all_logits[i][-1] for i in sorted(all_logits)])
        else:
            last = self.model.compute_logits(state.hidden[rows]) if rows else torch.empty(0)
        return StepOutput(last, all_logits)

    def forward(self, chunks: list[SeqChunk], between_layers: Callable[[int], None] | None = None) -> StepOutput:
        """Every layer of `chunks`. `between_layers(n)` runs after each layer but the last, with the
        number of layers done: the caller may change how the step runs on (its threads, its cores)."""
        state = self.start(chunks)
        if between_layers is None:
            self.run_layers(state)
        else:
            while not self.run_layers(state, 1):
                between_layers(state.next_layer)
        return self.finish(state)
